"""Idempotent create-or-patch of owned objects.

Each object carries, in an annotation, the manifest the operator last applied to it. The next apply
compares the new manifest with that record, not with the live object (which the API server fills with
defaults), and sends only the difference as a JSON merge-patch, with removed keys set to null. Nothing
changed: no request beyond the GET. The one live field also checked is `spec.replicas`, because the
operator alone owns it: a value someone else wrote is put back, and the caller is told so.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from specsplit.operator import naming
from specsplit.operator.kube_client import KIND_OF_MANIFEST, KubeClient

CREATED, PATCHED, UNCHANGED = "created", "patched", "unchanged"


class OwnershipConflict(Exception):
    """An object with the wanted name exists and another controller owns it: never take it over silently."""


@dataclasses.dataclass(frozen=True)
class Applied:
    live: dict[str, Any]  # the object as the API server returned it after this apply
    action: str  # CREATED | PATCHED | UNCHANGED
    replicas_overridden: int | None = None  # replicas someone else had set, which were put back


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The RFC 7386 merge-patch that turns `old` into `new` (lists are replaced whole, as the RFC says)."""
    patch: dict[str, Any] = {}
    for key in old:
        if key not in new:
            patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif key not in old or before != value:
            patch[key] = copy.deepcopy(value)
    return patch


def apply_merge_patch(document: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """What the API server does with a merge-patch (RFC 7386): the inverse of merge_patch()."""
    result = copy.deepcopy(dict(document))
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = apply_merge_patch(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def last_applied(live: Mapping[str, Any]) -> dict[str, Any] | None:
    raw = (live.get("metadata", {}).get("annotations") or {}).get(naming.ANNOTATION_LAST_APPLIED)
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for reference in obj.get("metadata", {}).get("ownerReferences") or []:
        if reference.get("controller"):
            return reference.get("uid")
    return None


def _encode(manifest: Mapping[str, Any]) -> str:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"))


async def apply(client: KubeClient, namespace: str, manifest: Mapping[str, Any]) -> Applied:
    kind = KIND_OF_MANIFEST[manifest["kind"]]
    name = manifest["metadata"]["name"]
    live = await client.get(kind, namespace, name)
    if live is None:
        body = copy.deepcopy(dict(manifest))
        body["metadata"].setdefault("annotations", {})[naming.ANNOTATION_LAST_APPLIED] = _encode(manifest)
        return Applied(await client.create(kind, namespace, body), CREATED)

    owner = _controller_uid(live)
    if owner is not None and owner != _controller_uid(manifest):
        raise OwnershipConflict(f"{manifest['kind']} {name} exists and is controlled by another owner ({owner})")

    previous = last_applied(live)
    if previous == manifest:
        patch: dict[str, Any] = {}
    else:  # no record (an object made elsewhere): send the whole manifest
        patch = merge_patch(previous, manifest) if previous else copy.deepcopy(dict(manifest))
    if patch:
        patch.setdefault("metadata", {}).setdefault("annotations", {})[naming.ANNOTATION_LAST_APPLIED] = \
            _encode(manifest)

    overridden = None
    wanted = manifest.get("spec", {}).get("replicas")
    actual = live.get("spec", {}).get("replicas")
    if wanted is not None and actual != wanted:
        patch.setdefault("spec", {})["replicas"] = wanted
        if previous is not None and previous.get("spec", {}).get("replicas") != actual:
            overridden = actual  # not what the operator last wrote: someone else changed it

    if not patch:
        return Applied(live, UNCHANGED)
    return Applied(await client.patch(kind, namespace, name, patch), PATCHED, overridden)


async def remove(client: KubeClient, namespace: str, kind_name: str, name: str) -> bool:
    """Delete an owned object if it is there; True if a delete was issued."""
    return await client.delete(KIND_OF_MANIFEST[kind_name], namespace, name)
