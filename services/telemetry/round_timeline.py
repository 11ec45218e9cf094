"""Where a round's time goes across the processes: per-stage timestamps, off unless asked for.

`SPECSPLIT_ROUND_TIMELINE=PREFIX` makes every specsplit process of that environment record `(stage, ns)` pairs at
the marks placed along the round's path (coordinator: round start, each worker call built / sent / answered /
unpacked, commit, client stream; worker: message received, unpacked, step start and end, answer built) and write
them to `PREFIX.<role>.<pid>.json` at exit. The clock is CLOCK_MONOTONIC, shared by every process of a host, so
marks of different processes order against each other (bench/bench_split_breakdown.py reads them).

Off (the default), `mark` is one global read and a return.
"""

import atexit
import json
import os
import time

PREFIX = os.environ.get("SPECSPLIT_ROUND_TIMELINE", "")
ENABLED = bool(PREFIX)
MAX_MARKS = 2_000_000  # a bound on memory for a long run: later marks are dropped

_marks: list[tuple[str, int]] = []
_role = ["process"]


def mark(stage: str) -> None:
    if ENABLED and len(_marks) < MAX_MARKS:
        _marks.append((stage, time.monotonic_ns()))


def set_role(role: str) -> None:
    """Name this process's file (coordinator, draft, target, ...)."""
    _role[0] = role


def _write() -> None:
    if _marks:
        with open(f"{PREFIX}.{_role[0]}.{os.getpid()}.json", "w") as out:
            json.dump({"role": _role[0], "pid": os.getpid(), "marks": _marks}, out)


if ENABLED:
    atexit.register(_write)
