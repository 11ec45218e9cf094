"""Status conditions in the Kubernetes shape (type, status, reason, message, lastTransitionTime, observedGeneration).

A condition keeps its lastTransitionTime until its status flips, so an unchanged condition is an unchanged
status and costs no write.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

READY, PROGRESSING, DEGRADED, INVALID_SPEC = "Ready", "Progressing", "Degraded", "InvalidSpec"
ORDER = (READY, PROGRESSING, DEGRADED, INVALID_SPEC)


def timestamp(seconds: float) -> str:
    """RFC 3339 in UTC, as Kubernetes writes times."""
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).replace(microsecond=0)
    return moment.isoformat().replace("+00:00", "Z")


def parse_timestamp(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def condition(kind: str, true: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if true else "False", "reason": reason, "message": message}


def merge(existing: Iterable[Mapping[str, Any]] | None, wanted: Iterable[Mapping[str, Any]], generation: int | None,
          now: float) -> list[dict[str, Any]]:
    """The new conditions list: wanted conditions, with transition times kept where the status did not flip."""
    before = {item.get("type"): item for item in existing or []}
    merged = []
    for item in wanted:
        old = before.get(item["type"])
        flipped = old is None or old.get("status") != item["status"]
        merged.append({
            **item,
            "observedGeneration": generation,
            "lastTransitionTime": timestamp(now) if flipped else old.get("lastTransitionTime", timestamp(now)),
        })
    merged.sort(key=lambda item: ORDER.index(item["type"]) if item["type"] in ORDER else len(ORDER))
    return merged
