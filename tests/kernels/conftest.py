"""Kernel tests run the Triton kernels on whatever is here: compiled on a CUDA GPU, else in Triton's CPU
interpreter.

Triton picks interpreted or compiled when a function is decorated with `@triton.jit`, i.e. when its module is
imported, by reading TRITON_INTERPRET. Without a GPU this file therefore
- sets TRITON_INTERPRET=1 just while it imports (or re-imports) the specsplit kernel modules, then puts it back, so
  nothing else in the session sees the variable;
- and, if Triton itself was imported earlier in the session (the root conftest loads `transformers`, which loads
  Triton), swaps Triton's own `@triton.jit` library functions (tl.zeros, tl.sum, tl.cumsum, ...) for interpreted
  twins while this folder's tests run, restoring them afterwards.
"""

import importlib
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Dependencies first: a module's `@triton.jit` helpers must be interpreted before the kernels that call them.
_KERNEL_MODULES = (
    "specsplit.kernels.rounding_triton",
    "specsplit.kernels.counter_rng_triton",
    "specsplit.kernels.kv_write_triton",
    "specsplit.kernels.linear_triton",
    "specsplit.kernels.paged_attention_triton",
    "specsplit.kernels.rejection_sampling_triton",
    "specsplit.kernels.rms_norm_triton",
    "specsplit.kernels.rotary_kv_triton",
    "specsplit.kernels.silu_mul_triton",
    "specsplit.kernels.skinny_linear_triton",
)


def _load_kernels_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in _KERNEL_MODULES:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _interpreted_triton_library() -> list[tuple[object, str, object, object]]:
    """(module, name, compiled original, interpreted twin) for each `@triton.jit` function of triton.language."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    try:  # Triton imports Gluon lazily on a kernel's first launch, and Gluon wants the compiled originals then.
        importlib.import_module("triton.experimental.gluon")
    except ImportError:
        pass

    twins: dict[int, object] = {}
    swaps = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                twin = twins.setdefault(id(value), InterpretedFunction(value.fn))
                swaps.append((module, attr, value, twin))
    return swaps


if not HAS_CUDA:
    _load_kernels_interpreted()


@pytest.fixture(autouse=True, scope="module")
def _interpreted_triton_library_functions():
    swaps = [] if HAS_CUDA else _interpreted_triton_library()
    for module, attr, _, twin in swaps:
        setattr(module, attr, twin)
    yield
    for module, attr, original, _ in swaps:
        setattr(module, attr, original)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def generator(request) -> torch.Generator:
    """A CPU generator seeded from the test's id: fresh inputs for every test, the same on every run."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.nodeid)) % (2**31)
    return torch.Generator().manual_seed(seed)
