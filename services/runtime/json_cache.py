"""A small JSON file of measured choices keyed by machine (the CPU layouts, the OpenMP wait policy): read whole,
updated entry by entry under a lock so processes starting together each add their own. Imports nothing heavy: the
OpenMP choice runs before torch loads."""

import fcntl
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, key: str, entry: dict, quiet: bool = False) -> None:
    """Read-modify-write under a lock; raises OSError where the cache cannot be written, or with `quiet` logs it
    and returns (a read-only cache measures again next start, nothing worse)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = read_cache(path)
            entries[key] = entry
            scratch = path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(entries, indent=1, sort_keys=True))
            os.replace(scratch, path)
    except OSError as error:
        if not quiet:
            raise
        log.warning("could not write the cache %s: %s", path, error)
