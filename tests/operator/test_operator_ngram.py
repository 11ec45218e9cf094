"""The n-gram (prompt-lookup) proposer in a SpeculativeDeployment: `proposer: ngram` for the draft pool or the canary,
validated alike by the operator and the CRD's schema, and the pods it makes (no model, no GPU, the CLI's flags)."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest

from specsplit.cli import build_parser
from specsplit.operator import naming
from specsplit.operator.manifests import RolloutPlan, build_objects
from specsplit.operator.spec import InvalidSpecError, parse_spec
from test_operator_manifests import OWNER, container
from test_operator_spec import schema, with_schema_defaults

BASE = {"image": "registry.example/specsplit:0.1.0", "target": {"model": "big"}}


def spec_of(draft: dict[str, Any], canary: dict[str, Any] | None = None) -> dict[str, Any]:
    raw = copy.deepcopy(BASE) | {"draft": draft}
    if canary is not None:
        raw["canary"] = canary
    return raw


def validator() -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(schema()["properties"]["spec"])


def test_an_ngram_draft_pool_runs_no_model_and_takes_no_gpu() -> None:
    spec = parse_spec(spec_of({"proposer": "ngram"}))
    assert spec.draft.model == "ngram:4:1" and spec.draft.resources.gpus == 0
    assert parse_spec(spec_of({"proposer": "ngram", "ngram": {"max": 3, "min": 2}})).draft.model == "ngram:3:2"
    assert parse_spec(spec_of({"model": "small"})).draft.resources.gpus == 1  # a model draft keeps its default GPU
    raw = spec_of({"proposer": "ngram", "ngram": {"max": 6}})
    # The API server's defaults and the operator's agree.
    assert parse_spec(with_schema_defaults(schema()["properties"]["spec"], raw)) == parse_spec(raw)
    validator().validate(raw)


@pytest.mark.parametrize("draft, fragment", [
    ({"proposer": "ngram", "model": "small"}, "spec.draft.model: the n-gram proposer runs no model"),
    ({"model": "small", "ngram": {"max": 3}}, "spec.draft.ngram: only with proposer: ngram"),
    ({"proposer": "ngram", "ngram": {"max": 2, "min": 3}}, "spec.draft.ngram: min (3) must not exceed max (2)"),
    ({"proposer": "ngram", "ngram": {"max": 65}}, "spec.draft.ngram.max: must be at most 64"),
    ({"proposer": "eagle", "model": "small"}, "spec.draft.proposer: 'eagle' is not one of model, ngram"),
    ({}, "spec.draft.model: required"),
])
def test_bad_ngram_drafts_are_refused_by_the_operator_and_the_schema(draft: dict, fragment: str) -> None:
    raw = spec_of(draft)
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(raw)
    assert any(fragment in error for error in caught.value.errors), caught.value.errors
    if "min (3)" not in fragment:  # min <= max is a CEL rule: the API server checks it, not a JSON Schema validator
        with pytest.raises(jsonschema.ValidationError):
            validator().validate(raw)


def test_pods_of_an_ngram_canary_beside_a_model_draft() -> None:
    raw = spec_of({"model": "small"}, {"proposer": "ngram", "ngram": {"max": 5}, "weight": 10})
    validator().validate(raw)
    spec = parse_spec(raw)
    assert spec.canary.model == "ngram:5:1"
    plan = RolloutPlan(target_replicas=1, draft_replicas=1, draft_model=spec.draft.model,
                       canary_model=spec.canary.model, canary_weight=10)
    built = {(o["kind"], o["metadata"]["name"]): o for o in build_objects(OWNER, spec, plan)}
    draft = container(built[("Deployment", "coder-draft")])
    canary = container(built[("Deployment", "coder-draft-canary")])
    assert draft["command"][:4] == ["specsplit", "draft", "--model", "small"]
    assert draft["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert canary["command"][:8] == ["specsplit", "draft", "--proposer", "ngram", "--ngram-max", "5", "--ngram-min", "1"]
    assert "nvidia.com/gpu" not in json.dumps(canary.get("resources", {}))  # no model: no GPU
    # The commands are what the CLI takes.
    for command in (draft["command"], canary["command"]):
        args = build_parser().parse_args(command[1:])
        assert args.role == "draft"
    args = build_parser().parse_args(canary["command"][1:])
    assert (args.proposer, args.ngram_max, args.ngram_min, args.model) == ("ngram", 5, 1, None)
    variants = json.loads(built[("ConfigMap", "coder-coordinator")]["data"][naming.VARIANTS_KEY])
    assert [v["weight"] for v in variants["variants"]] == [90, 10]


def test_a_promoted_ngram_canary_runs_in_the_draft_pool() -> None:
    spec = parse_spec(spec_of({"model": "small"}, {"proposer": "ngram"}))
    plan = RolloutPlan(target_replicas=1, draft_replicas=2, draft_model=spec.canary.model)  # promoted, canary gone
    built = {(o["kind"], o["metadata"]["name"]): o for o in build_objects(OWNER, spec, plan)}
    draft = container(built[("Deployment", "coder-draft")])
    assert draft["command"][2:4] == ["--proposer", "ngram"] and "--model" not in draft["command"]
    assert "nvidia.com/gpu" not in json.dumps(draft.get("resources", {}))
    assert ("Deployment", "coder-draft-canary") not in built
