"""What this machine is, for the caches of choices measured on it (CPU layouts, the OpenMP wait policy). Imports
nothing heavy: the OpenMP choice runs before torch loads."""

import platform


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
