"""Errors a caller can act on. The gRPC layer maps each to a status code; nothing here is a bare internal error."""


class SpecsplitError(Exception):
    """Base class of errors that carry a caller-facing meaning."""


class InvalidArgument(SpecsplitError, ValueError):
    """The request itself is wrong (empty prompt, k < 0, temperature < 0, ...): INVALID_ARGUMENT."""


class ResourceExhausted(SpecsplitError):
    """No room now (KV blocks, queue bound); the same request may succeed later: RESOURCE_EXHAUSTED."""


class KVCacheFull(ResourceExhausted):
    """The paged KV cache has too few free blocks for the requested tokens."""


class UnknownSequence(SpecsplitError, KeyError):
    """A worker was asked about a sequence handle it does not hold (released, expired, or never prefilled)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown sequence"


class Unavailable(SpecsplitError):
    """A worker or replica cannot be reached: UNAVAILABLE."""
