"""The chart's `draft.proposer: ngram` and `canary.proposer: ngram`: the SpeculativeDeployment it renders (checked
against the CRD) and the pods the operator builds from it: the n-gram proposer's flags, no model, no GPU."""

import json

import helm_python
import pytest
from chart_render import pod_templates, render, speculative_deployment
from test_chart_manifests import validate_against_crd

GPU = "nvidia.com/gpu"


def container(pods, name):
    (only,) = pods[name]["spec"]["containers"]
    return only


def test_an_ngram_draft_pool():
    manifests = render({"draft": {"proposer": "ngram", "ngram": {"max": 3}}})
    cr = speculative_deployment(manifests)
    validate_against_crd(cr)
    draft = cr["spec"]["draft"]
    assert draft["proposer"] == "ngram" and draft["ngram"] == {"max": 3, "min": 1} and "model" not in draft
    assert "gpus" not in draft["resources"]
    pod = container(pod_templates(manifests), "coder-specsplit-draft")
    assert pod["command"][:8] == ["specsplit", "draft", "--proposer", "ngram", "--ngram-max", "3", "--ngram-min", "1"]
    assert GPU not in json.dumps(pod["resources"])
    target = container(pod_templates(manifests), "coder-specsplit-target")
    assert target["resources"]["limits"][GPU] == "1"  # the target keeps its GPU


def test_an_ngram_canary_beside_the_model_draft():
    manifests = render({"canary": {"enabled": True, "proposer": "ngram", "weight": 10}})
    cr = speculative_deployment(manifests)
    validate_against_crd(cr)
    assert cr["spec"]["canary"]["proposer"] == "ngram" and "model" not in cr["spec"]["canary"]
    pods = pod_templates(manifests)
    canary = container(pods, "coder-specsplit-draft-canary")
    assert canary["command"][2:4] == ["--proposer", "ngram"] and GPU not in json.dumps(canary["resources"])
    draft = container(pods, "coder-specsplit-draft")
    assert draft["command"][2:4] == ["--model", "qwen2.5-coder-0.5b-instruct"] and draft["resources"]["limits"][GPU] == "1"


@pytest.mark.parametrize("values, message", [
    ({"draft": {"proposer": "lookup"}}, "at '/draft/proposer': value must be one of 'model', 'ngram'"),
    ({"draft": {"proposer": "ngram", "ngram": {"max": 2, "min": 3}}}, "ngram.min (3) must not exceed ngram.max (2)"),
    ({"draft": {"ngram": {"size": 3}}}, "at '/draft/ngram': additional properties 'size' not allowed"),
    ({"draft": {"proposer": "ngram"}, "canary": {"enabled": True, "proposer": "ngram"}},
     "a canary must try something else than the draft pool"),
])
def test_bad_ngram_values_are_refused(values, message):
    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmRenderError)) as refused:
        render(values)
    assert message in str(refused.value)


def test_notes_name_the_ngram_proposer():
    from chart_render import notes

    text = notes({"draft": {"proposer": "ngram"}, "canary": {"enabled": True, "model": "qwen2.5-coder-1.5b-instruct"}})
    assert "draft   n-gram proposer 4..1, no model" in text and "canary  qwen2.5-coder-1.5b-instruct" in text
    assert "canary  n-gram proposer 3..1" in notes({"canary": {"enabled": True, "proposer": "ngram", "ngram": {"max": 3}}})
