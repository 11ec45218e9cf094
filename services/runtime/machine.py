"""What this machine is, for the caches of choices measured on it (CPU layouts, the OpenMP wait policy). Imports
nothing heavy: the OpenMP choice runs before torch loads."""

import os
import platform


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def available_cores() -> int:
    """The cores this process may run on (its affinity: a container pinned to 4 of 64 cores has 4)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def torch_version() -> str:
    """torch's version without importing it (the OpenMP choice runs before torch loads)."""
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # not installed as a distribution
        return "?"


def machine_key(threads: int | None = None, cores: int | None = None) -> dict:
    """CPU model, cores (available_cores unless given), torch version, and the threads used where they matter."""
    key = {"cpu": cpu_model(), "cores": cores or available_cores(), "torch": torch_version()}
    if threads is not None:
        key["threads"] = threads
    return key
