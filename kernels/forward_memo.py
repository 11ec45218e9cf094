"""Values that every layer of one forward computes alike, computed by the first layer and reused by the others.

The eager torch references run each layer's attention and rotary as a dozen small ops, and some of them depend only
on the step's metadata, not on the layer: attention's gather indices and causal mask, rotary's cos/sin rows. On a
CPU those ops cost more in dispatch than in arithmetic (about a tenth of a speculative round on the real pair), so
inside `one_forward()` the first layer's result is kept and the others reuse it. The values are the same tensors the
op would have computed again, so the output is bit-identical.

Keys hold the identity of the metadata tensors: inside one forward those are the same objects, never modified (the
forward only reads them); the memo keeps them referenced and ends with the forward.
Outside `one_forward()` (the kernels' own tests, a CUDA graph capture of the Triton path) nothing is kept.
"""

import contextlib
import threading

_local = threading.local()  # the draft and the target may run their forwards at once in one process


@contextlib.contextmanager
def one_forward():
    previous = getattr(_local, "memo", None)
    _local.memo = {}
    try:
        yield
    finally:
        _local.memo = previous


def memoized(name: str, tensors: tuple, extras: tuple, compute):
    """compute(), or what it returned for the same tensors (by identity) and extras earlier in this forward."""
    memo = getattr(_local, "memo", None)
    if memo is None:
        return compute()
    key = (name, *(id(t) for t in tensors), *extras)
    entry = memo.get(key)
    if entry is None:  # the tensors stay referenced with the value: their identities cannot be reused meanwhile
        entry = memo[key] = (compute(), tensors)
    return entry[0]
