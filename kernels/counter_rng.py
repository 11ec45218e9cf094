"""Counter-based uniforms: u = hash(seed, position, stream), eager torch reference.

Randomness in specsplit is a pure function of (request seed, absolute token position, stream). That makes every
sample independent of what else is in the batch, of how many rounds it took to reach a position, and of which
device computed it, and it needs no generator state on the host (GPU kernels compute the same hash in registers).

Streams: DRAFT (the draft's sample of a proposal), ACCEPT (the verifier's accept test), SAMPLE (the verifier's
corrected, bonus or plain-decode sample). The committed token at position j depends only on uniforms at positions
<= j, so reusing a position's uniforms after a rejection in an earlier round keeps every committed token exact.

The hash is "lowbias32" (two multiply-xorshift rounds) applied three times to fold seed halves and the counter;
values are kept in int64 lanes masked to 32 bits so the same arithmetic runs in torch and Triton.
"""

import torch

STREAM_DRAFT = 0
STREAM_ACCEPT = 1
STREAM_SAMPLE = 2

_MASK32 = 0xFFFFFFFF


def _lowbias32(x):
    """On int64 tensors or Python ints alike."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def counter_uniform_torch(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in the open interval (0, 1), float32, one per element of the broadcast of `seeds` and `positions`.

    seeds:     int64, any 64-bit value (only the low 63 bits are significant in torch's signed lanes)
    positions: int64, absolute token positions
    """
    return bits_to_uniform(_counter_hash(seeds.to(torch.int64), positions.to(torch.int64), stream))


def counter_uniform_scalar(seed: int, position: int, stream: int) -> float:
    """One uniform of `counter_uniform_torch`, the same value, in plain integer arithmetic (a host-side coin costs
    microseconds, not a dozen tensor ops)."""
    return ((_counter_hash(seed, position, stream) >> 9) + 0.5) * (1.0 / 8388608.0)


def _counter_hash(seeds, positions, stream: int):
    """The 32-bit hash of (seed, position, stream), on int64 tensors or Python ints alike."""
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    counter = ((positions & 0x3FFFFFFF) * 4 + stream) & _MASK32
    return _lowbias32(counter ^ _lowbias32(seed_hi ^ _lowbias32(seed_lo ^ 0x9E3779B9)))


def bits_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit hash -> float32 in (0, 1): 23 random bits, centred in their bucket.

    23 and not 24 bits: (i + 0.5) / 2^24 needs 25 significant bits, so for i >= 2^23 float32 rounds it to even and
    i = 2^24 - 1 gives exactly 1.0. With 23 bits every value (i + 0.5) / 2^23 is exact, in [2^-24, 1 - 2^-24].
    """
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)
