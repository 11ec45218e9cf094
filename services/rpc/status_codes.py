"""Errors to gRPC status codes and back, so a caller always learns what went wrong (never a bare INTERNAL for a
mistake of theirs), and per-sequence errors inside batched worker calls survive the trip to the coordinator."""

import grpc

from specsplit.services.errors import InvalidArgument, ResourceExhausted, KVCacheFull, Unavailable, UnknownSequence

_CODE_OF = [
    (KVCacheFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownSequence, grpc.StatusCode.NOT_FOUND),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
]
_ERROR_OF = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: KVCacheFull,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: UnknownSequence,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
}
_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code_for(error: BaseException) -> grpc.StatusCode:
    for cls, code in _CODE_OF:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def code_number(code: grpc.StatusCode) -> int:
    return code.value[0]


def error_from_status(number: int, message: str) -> Exception:
    code = _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)
    return _ERROR_OF.get(code, RuntimeError)(message)


def error_from_rpc(error: grpc.RpcError) -> Exception:
    """A whole failed call: UNAVAILABLE and DEADLINE_EXCEEDED mean the replica is unreachable."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return Unavailable(f"{code.name}: {details}")
    return _ERROR_OF.get(code, RuntimeError)(details)
