"""Merge-patch computation for create-or-patch (pure), and the apply step against the API over HTTP."""

from __future__ import annotations

import json

import kopf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsplit.operator import naming
from specsplit.operator.apply import (
    CREATED,
    PATCHED,
    UNCHANGED,
    OwnershipConflict,
    apply,
    apply_merge_patch,
    merge_patch,
)
from specsplit.operator.kube_client import KubeClient

from kube_harness import NAMESPACE, SpecsplitEmulator

OWNER_REF = {"apiVersion": naming.API_VERSION, "kind": naming.KIND, "name": "coder", "uid": "u-1",
             "controller": True, "blockOwnerDeletion": True}


def test_merge_patch_sends_changes_and_nulls_removed_keys() -> None:
    old = {"spec": {"replicas": 2, "template": {"nodeSelector": {"gpu": "a100"}, "containers": [{"name": "x"}]}}}
    new = {"spec": {"replicas": 2, "template": {"containers": [{"name": "x", "image": "y"}]}}}
    assert merge_patch(old, new) == {"spec": {"template": {"nodeSelector": None,
                                                           "containers": [{"name": "x", "image": "y"}]}}}
    assert merge_patch(new, new) == {}


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=3),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner,
                                                                                        max_size=3), max_leaves=8)
documents = st.dictionaries(st.text(max_size=2), json_values.filter(lambda v: v is not None), max_size=4)


def _without_nulls(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


@settings(max_examples=60)
@given(documents, documents)
def test_applying_the_computed_patch_gives_the_new_document(old: dict, new: dict) -> None:
    new = _without_nulls(new)  # a merge-patch cannot express a null value, only a removal
    assert apply_merge_patch(old, merge_patch(old, new)) == new


def deployment(replicas: int, image: str = "specsplit:1", uid: str = "u-1") -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "coder-target", "ownerReferences": [{**OWNER_REF, "uid": uid}]},
            "spec": {"replicas": replicas, "template": {"spec": {"containers": [{"name": "t", "image": image}]}}}}


@pytest.mark.asyncio
async def test_create_then_unchanged_then_minimal_patch(emulator: SpecsplitEmulator) -> None:
    client = KubeClient(kopf.ConnectionInfo(server=str(emulator.url).rstrip("/")))
    try:
        first = await apply(client, NAMESPACE, deployment(2))
        assert first.action == CREATED
        assert json.loads(first.live["metadata"]["annotations"][naming.ANNOTATION_LAST_APPLIED]) == deployment(2)

        writes = len(emulator.writes())
        assert (await apply(client, NAMESPACE, deployment(2))).action == UNCHANGED
        assert len(emulator.writes()) == writes  # only a GET

        changed = await apply(client, NAMESPACE, deployment(2, image="specsplit:2"))
        assert changed.action == PATCHED and changed.replicas_overridden is None
        [patch] = emulator.writes(since=0)[writes:]
        assert patch.data["spec"] == {"template": {"spec": {"containers": [{"name": "t", "image": "specsplit:2"}]}}}

        # Someone scales it by hand: the next apply puts the operator's count back and says so.
        await emulator.patch(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/coder-target",
                             json={"spec": {"replicas": 9}}, headers={"Content-Type": "application/merge-patch+json"})
        restored = await apply(client, NAMESPACE, deployment(2, image="specsplit:2"))
        assert (restored.action, restored.replicas_overridden, restored.live["spec"]["replicas"]) == (PATCHED, 9, 2)

        with pytest.raises(OwnershipConflict):
            await apply(client, NAMESPACE, deployment(2, uid="someone-else"))
    finally:
        await client.close()
