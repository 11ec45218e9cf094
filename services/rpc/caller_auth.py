"""Checking a secret every call must carry: the public API's bearer tokens and the workers' shared secret.

Every method of a guarded server is checked, whatever its kind (unary or streaming, either way) and whenever it was
added: the check needs only the call's metadata, which gRPC hands the interceptor before the method runs. A call
with a valid secret gets the method's own handler back, untouched, so a long-lived stream pays the check once when
it opens and nothing per message. Any other call gets a refusal of the same kind that reads no request message
(gRPC has received a unary call's bytes already; they are not parsed), waits as long as the failure throttle says
(auth_throttle.py) and ends with UNAUTHENTICATED. Health checking and reflection stay open, for probes.

Secrets are compared exactly and in constant time (hmac.compare_digest, against every secret).
"""

import hmac

import grpc

from specsplit.services.rpc.auth_throttle import FailureThrottle, peer_address

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class SecretCheck:
    """The secrets a caller may present, and the throttle of the callers that present something else. One instance
    can guard several front doors (the gRPC and HTTP APIs of one coordinator), so that they share the throttle."""

    def __init__(self, secrets: list[str | bytes], throttle: FailureThrottle | None = None):
        self._secrets = [s.encode() if isinstance(s, str) else bytes(s) for s in secrets]
        self.throttle = throttle or FailureThrottle()

    def valid(self, presented: bytes) -> bool:
        ok = False
        for secret in self._secrets:  # every secret is compared: the time taken says nothing about which matched
            ok |= hmac.compare_digest(presented, secret)
        return ok and bool(presented)

    async def refuse(self, address: str) -> None:
        """A failure from `address`: wait as long as the throttle says (valid callers never come here)."""
        await self.throttle.slow_down(address)


class SecretCheckInterceptor(grpc.aio.ServerInterceptor):
    """Hand calls whose `presented(metadata)` is valid to their method; refuse the others with UNAUTHENTICATED."""

    def __init__(self, check: SecretCheck, presented, message: str):
        self.check = check
        self._presented = presented  # the call's metadata (a tuple of pairs) -> bytes (b"" when absent)
        self._message = message
        # One refusal per handler kind, built once: (request streaming, response streaming) -> handler.
        self._refusals = {
            (False, False): grpc.unary_unary_rpc_method_handler(self._refuse),
            (False, True): grpc.unary_stream_rpc_method_handler(self._refuse_streaming),
            (True, False): grpc.stream_unary_rpc_method_handler(self._refuse),
            (True, True): grpc.stream_stream_rpc_method_handler(self._refuse_streaming),
        }

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_SERVICES):
            return handler
        if self.check.valid(self._presented(handler_call_details.invocation_metadata or ())):
            return handler
        return self._refusals[(bool(handler.request_streaming), bool(handler.response_streaming))]

    async def _refuse(self, request_or_requests, context):
        # It never iterates a request stream: an unauthenticated caller cannot make the server read its messages.
        await self.check.refuse(peer_address(context.peer()))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._message)

    async def _refuse_streaming(self, request_or_requests, context):
        # An async generator, as the streaming methods it stands for are (for any interceptor outside this one).
        await self._refuse(request_or_requests, context)
        yield  # never reached: the refusal aborts the call


def metadata_value(metadata, key: str) -> str:
    """The first value of `key` in a call's metadata ("" when absent)."""
    for k, v in metadata:
        if k == key:
            return v if isinstance(v, str) else ""
    return ""


def bearer_token(metadata) -> bytes:
    """The token of a gRPC call's `authorization` metadata (bearer_header)."""
    return bearer_header(metadata_value(metadata, "authorization"))


def bearer_header(header: str) -> bytes:
    """`Bearer TOKEN`, the scheme written exactly so (as every client sends it), for the gRPC and HTTP APIs alike;
    anything else presents no token."""
    return header[7:].encode() if header.startswith("Bearer ") else b""
