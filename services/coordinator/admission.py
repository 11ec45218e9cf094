"""What admission adds to a request's own validation: the model's limits, names nobody can guess, and proof that
its worker fields encode, so one bad request is refused alone instead of failing a batched worker call.

Handles name a sequence on the workers. They are random (128 bits) and never shown to the caller: a predictable
handle (it used to be the coordinator id plus a counter, and the default request_id) let anyone who could reach a
worker read or overwrite another user's sequence. The default request_id is a separate random name.
"""

import secrets

from specsplit.services.errors import InvalidArgument


def new_handle() -> str:
    return secrets.token_hex(16)


def new_request_id() -> str:
    return f"req-{secrets.token_hex(8)}"


def apply_model_limits(params, vocab: int | None):
    """top_k at or above the vocabulary keeps every token: it is no top-k at all (and then fits any wire type)."""
    if vocab is not None and params.top_k >= vocab:
        params.top_k = 0
    if vocab is not None and any(t >= vocab for t in params.stop_token_ids):
        raise InvalidArgument(f"stop_token_ids must be in [0, {vocab})")
    return params


def check_encodable(sampling) -> None:
    """Encode the sequence's worker sampling once now; what fails here would fail later for a whole batch."""
    from specsplit.services.rpc.worker_messages import sampling_pb

    try:
        sampling_pb(sampling)
    except (ValueError, TypeError, OverflowError) as error:
        raise InvalidArgument(f"sampling settings do not fit the worker protocol: {type(error).__name__}") from None
