"""Bounds every request field is checked against, public and worker alike: the range its wire type can carry, the
range the model allows, and the sizes of strings (a field that is echoed back, like request_id, must stay small).

A request outside them is refused alone with INVALID_ARGUMENT, at admission, before anything is encoded for a
worker: an encoding error in a batched worker call would otherwise fail every sequence of that batch.
"""

import math

from specsplit.services.errors import InvalidArgument

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1

# Temperatures below this are greedy. logits / 1e-38 overflows float32 to inf (softmax NaN: garbage tokens, or
# "q probabilities must be finite"); below 1e-5 a logit gap of 0.001 already gives the argmax e^100 times the odds
# of the runner-up, so greedy is what such a request gets anyway. vLLM draws the same line (_SAMPLING_EPS = 1e-5).
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0

MAX_REQUEST_ID_BYTES = 256   # echoed in every stream message
MAX_HANDLE_BYTES = 64        # worker sequence handles (the coordinator sends 32 hex digits)
MAX_VARIANT_NAME_BYTES = 128


def effective_temperature(temperature: float) -> float:
    """The temperature actually used: tiny positive ones are greedy (0)."""
    return 0.0 if 0.0 < temperature < GREEDY_BELOW_TEMPERATURE else temperature


def check_temperature(temperature: float) -> None:
    if not (0.0 <= temperature <= MAX_TEMPERATURE):  # also NaN
        raise InvalidArgument(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")


def check_top_p(top_p: float) -> None:
    if not (0.0 < top_p <= 1.0):
        raise InvalidArgument(f"top_p must be in (0, 1], got {top_p}")


def check_top_k(top_k: int) -> None:
    if not (0 <= top_k <= INT32_MAX):
        raise InvalidArgument(f"top_k must be in [0, {INT32_MAX}] (0 = off), got {top_k}")


def check_string(name: str, value: str, max_bytes: int, required: bool = False) -> None:
    """A bounded string; the message never repeats the value (it may be huge or hostile)."""
    if required and not value:
        raise InvalidArgument(f"{name} must not be empty")
    if len(value) <= max_bytes and value.isascii():  # the common case, without encoding
        return
    size = len(value.encode("utf-8", "surrogatepass")) if len(value) <= max_bytes else max_bytes + 1
    if size > max_bytes:
        raise InvalidArgument(f"{name} must be at most {max_bytes} bytes")


def check_finite_weight(name: str, weight, max_weight: float) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
            or not (0 <= weight <= max_weight):
        raise InvalidArgument(f"{name}: weight must be a finite number in [0, {max_weight:g}], got {weight!r}")
    return float(weight)
