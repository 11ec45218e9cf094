"""Intra-op threads per process, so the processes of `serve` share the cores instead of fighting over them.

A draft and a target take turns within a round (the draft proposes, then the target verifies), so each may use every
core while it works; the coordinator only moves messages and samples small tensors, so one thread is all it needs and
more would only compete with the worker that is busy. Measured with bench/bench_cpu_baselines.py.
"""

import torch

from specsplit.services.runtime.machine import available_cores

# 0 = this role's default
DEFAULT_THREADS = {"coordinator": 1}


def threads_for(role: str, requested: int = 0) -> int:
    if requested < 0:
        raise ValueError(f"--threads must be >= 0, got {requested}")
    return requested or DEFAULT_THREADS.get(role, available_cores())


def apply_threads(role: str, requested: int = 0) -> int:
    """Set this process's intra-op threads for `role` (requested > 0 overrides); returns the count torch now uses."""
    torch.set_num_threads(threads_for(role, requested))
    return torch.get_num_threads()


def add_threads_arg(p, role: str) -> None:
    default = "1" if DEFAULT_THREADS.get(role) == 1 else "all cores"
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help=f"intra-op CPU threads for this process (0 = the default for a {role}: {default})")
