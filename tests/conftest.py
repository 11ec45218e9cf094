"""Shared fixtures: tiny random-weight model folders built from real `transformers` configs."""

import gc
import os
import sys
from pathlib import Path

# The checkout's top-level folders install as specsplit.* and are no import packages of their own, but `python -m
# pytest` puts the working directory first on sys.path, where kernels/ would shadow the `kernels` distribution that
# transformers imports. Drop the checkout from sys.path here and, through PYTHONSAFEPATH, in every Python the tests
# start (the services start theirs with -P: services/service_commands.py).
_CHECKOUT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _CHECKOUT]
os.environ["PYTHONSAFEPATH"] = "1"

# Before torch loads OpenMP, as the specsplit command does (specsplit/cli.py): no spinning threads on a shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "e2e"))

from tiny_models import build_model, perturbed_copy, save_model  # noqa: E402

# Tiny models need little KV: 64 MiB per runner unless a test gives a block count (the default, 1 GiB, is zeroed memory
# per runner, and engines in reference cycles outlive their tests until the collector runs).
os.environ.setdefault("SPECSPLIT_KV_CACHE_BYTES", str(64 << 20))
# "auto" weight layouts take weight_formats.py's fixed defaults instead of timing each tiny model (and writing the
# choice into the user's cache); tests of the calibration itself set it back.
os.environ.setdefault("SPECSPLIT_LAYOUTS", "defaults")


@pytest.fixture(autouse=True, scope="module")
def _collect_engines_after_each_module():
    yield
    gc.collect()


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A qwen2 target, a close draft (perturbed copy), and an unrelated draft, all float64 for exact comparisons."""
    root = tmp_path_factory.mktemp("tiny")
    target = build_model("qwen2", seed=0).to(torch.float64)
    close = perturbed_copy(target, noise=0.01)
    unrelated = build_model("qwen2", seed=7).to(torch.float64)
    return {
        "target": save_model(target, root / "target"),
        "close": save_model(close, root / "close"),
        "unrelated": save_model(unrelated, root / "unrelated"),
        "hf_target": target,
    }
