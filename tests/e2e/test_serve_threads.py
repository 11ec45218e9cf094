"""`serve` sets intra-op threads per process: all cores for the draft and the target (they take turns within a
round), one for the coordinator; `--{target,draft,coordinator}-threads` override each. Real processes."""

import os
import subprocess

import pytest

from specsplit.services.runtime.cpu_threads import threads_for
from specsplit.services.service_commands import spawn_service
from cluster import child_pids

# "Every core": those this process may run on, which the processes it starts inherit.
CORES = len(os.sched_getaffinity(0))


def _serve_threads(tiny_pair, *flags, commands: list | None = None) -> dict[str, int]:
    """Start `serve` on the tiny pair, read what each of its processes says it set, stop it. `commands`: gets each
    child process's argv."""
    argv = ["serve", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["close"]), "--port", "0",
            "--metrics-port", "-1", "--num-kv-blocks", "16", *flags]
    serve, _ = spawn_service(argv, stderr=subprocess.PIPE)
    if commands is not None:
        commands += [open(f"/proc/{pid}/cmdline").read().split("\0") for pid in child_pids(serve.pid)]
    serve.terminate()
    _, stderr = serve.communicate(timeout=60)
    said = {}
    for line in stderr.splitlines():
        if line.startswith("specsplit ") and line.endswith(" CPU threads"):
            words = line.split()
            said[words[1]] = int(words[3])
    return said


def test_serve_sets_each_processes_threads(tiny_pair):
    """Defaults for the target (every core) and the coordinator (one); the draft's flag passed through. One serve
    for both (each start of three processes costs tens of seconds on a loaded 2-core machine), and for what the
    workers warm up: rounds up to serve's bound on k (on a GPU, their graphs before serving)."""
    commands: list = []
    said = _serve_threads(tiny_pair, "--draft-threads", "1", "-k", "6", commands=commands)
    assert said == {"target": CORES, "draft": 1, "coordinator": 1}
    workers = [c for c in commands if c[c.index("specsplit") + 1] in ("target", "draft")]
    assert len(workers) == 2 and all(c[c.index("--warm-up-k") + 1] == "6" for c in workers)
    # Started with -P: a checkout's kernels/ folder in the working directory cannot shadow an installed package.
    assert all(c[1:4] == ["-P", "-m", "specsplit"] for c in commands)


def test_thread_defaults_and_bad_counts():
    assert threads_for("coordinator") == 1 and threads_for("target") == CORES == threads_for("draft")
    assert threads_for("draft", 3) == 3
    with pytest.raises(ValueError, match=">= 0"):
        threads_for("target", -1)


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_threads_wait_passively_in_a_process_that_computes_nothing_unless_told(given, expected):
    """Set before torch loads OpenMP (libgomp reads it once): checked in a fresh interpreter, whose empty command line
    is a process that computes nothing (commands that do: tests/services/test_cpu_wait_policy.py)."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = "import specsplit.cli, os, sys, torch; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == expected
