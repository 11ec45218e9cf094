"""Renders the chart with the real Helm engine (helm-python-sdk binds Helm's Go SDK, offline) and hands the
SpeculativeDeployment it makes to the operator's own pure builders, to see the pods a cluster would run."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import helm_python
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "specsplit"
RELEASE, NAMESPACE = "coder", "ml"
KUBE_VERSION = "1.30"


@dataclasses.dataclass(frozen=True)
class Manifest:
    template: str  # e.g. specsplit/templates/operator-deployment.yaml
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.body["kind"]

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]


# libyaml when present: the tests parse a few hundred rendered documents.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=None)
def _rendered_text(values_json: str) -> tuple[tuple[str, str], ...]:
    """One Helm render per distinct set of values; errors (bad values) are raised, not cached."""
    with helm_python.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True)
    return tuple(sorted(rendered.items()))


def _render_text(values: dict[str, Any] | None) -> dict[str, str]:
    return dict(_rendered_text(json.dumps(values or {}, sort_keys=True)))


def render(values: dict[str, Any] | None = None) -> list[Manifest]:
    """Every object the chart's templates render (NOTES.txt and empty documents left out); fresh dicts each call."""
    return [Manifest(template, body)
            for template, text in _render_text(values).items() if template.endswith(".yaml")
            for body in yaml.load_all(text, Loader=_LOADER) if body]


def notes(values: dict[str, Any] | None = None) -> str:
    return _render_text(values)["specsplit/templates/NOTES.txt"]


def of_kind(manifests: list[Manifest], kind: str) -> list[dict[str, Any]]:
    return [m.body for m in manifests if m.kind == kind]


def speculative_deployment(manifests: list[Manifest]) -> dict[str, Any]:
    (cr,) = of_kind(manifests, "SpeculativeDeployment")
    return cr


def crd_documents(filename: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((CHART_DIR / "crds" / filename).read_text()) if doc]


def operator_objects(cr: dict[str, Any]) -> list[dict[str, Any]]:
    """What the operator creates for the chart's SpeculativeDeployment, through its own spec parser and
    manifest builders; a running canary included when the spec has one."""
    from specsplit.operator.manifests import RolloutPlan, build_objects
    from specsplit.operator.spec import parse_spec

    spec = parse_spec(cr["spec"])
    # The API server would have given the object a uid; owner references need one.
    owner = {**cr, "metadata": {**cr["metadata"], "uid": "0b7c5f0e-5d1c-4a39-9d7e-2f1f3c2a9e10"}}
    plan = RolloutPlan(
        target_replicas=spec.target.replicas.min,
        draft_replicas=spec.draft.replicas.min,
        draft_model=spec.draft.model,
        canary_model=spec.canary.model if spec.canary else None,
        canary_weight=spec.canary.weight if spec.canary else 0,
    )
    return build_objects(owner, spec, plan)


def coordinator_command(objects: list[dict[str, Any]], colocated: bool) -> list[str]:
    """The command of the container the coordinator runs in, among the operator's objects: its own Deployment's, or
    the target pods' when co-located."""
    suffix = "-target" if colocated else "-coordinator"
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith(suffix))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["command"]


def pod_templates(manifests: list[Manifest]) -> dict[str, dict[str, Any]]:
    """Every pod a release runs, by Deployment name: the operator's (rendered by the chart) and, when the chart
    makes a SpeculativeDeployment, the coordinator's and the pools' (built by the operator from it)."""
    deployments = of_kind(manifests, "Deployment")
    if of_kind(manifests, "SpeculativeDeployment"):
        built = operator_objects(speculative_deployment(manifests))
        deployments += [obj for obj in built if obj["kind"] == "Deployment"]
    return {d["metadata"]["name"]: d["spec"]["template"] for d in deployments}
