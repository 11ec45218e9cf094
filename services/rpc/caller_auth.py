"""Checking a secret every call must carry: the public API's bearer tokens and the workers' shared secret.

Both compare the presented bytes exactly and in constant time (hmac.compare_digest) and throttle peers that keep
failing (auth_throttle.py). Health checking and reflection stay open, for probes. The check runs inside the
method's handler, where the caller's address is known.
"""

import hmac
import logging

import grpc

from specsplit.services.rpc.auth_throttle import FailureThrottle, peer_address

log = logging.getLogger(__name__)

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class SecretCheckInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls whose `presented(metadata)` matches none of `secrets` with UNAUTHENTICATED; a peer past its
    failure budget gets RESOURCE_EXHAUSTED until its lock-out ends."""

    def __init__(self, secrets: list[bytes], presented, message: str, throttle: FailureThrottle | None = None):
        self._secrets = list(secrets)
        self._presented = presented  # metadata dict -> bytes (b"" when absent)
        self._message = message
        self.throttle = throttle or FailureThrottle()

    def _valid(self, metadata) -> bool:
        presented = self._presented(dict(metadata or ()))
        ok = False
        for secret in self._secrets:  # every secret is compared: the time taken says nothing about which matched
            ok |= hmac.compare_digest(presented, secret)
        return ok and bool(presented)

    async def _admit(self, context) -> None:
        peer = peer_address(context.peer())
        wait = self.throttle.locked_for(peer)
        if wait > 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many failed authentication attempts from this address; retry in {wait:.0f} s")
        if self._valid(context.invocation_metadata()):
            self.throttle.succeeded(peer)
            return
        self.throttle.failed(peer)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._message)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_SERVICES) or handler.request_streaming:
            return handler
        admit = self._admit
        if handler.response_streaming:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                await admit(context)
                async for response in inner(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)
        inner = handler.unary_unary

        async def unary_unary(request, context):
            await admit(context)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def bearer_token(metadata: dict) -> bytes:
    """`authorization: Bearer TOKEN`, the scheme written exactly so (as every client sends it)."""
    header = metadata.get("authorization", "")
    return header[7:].encode() if isinstance(header, str) and header.startswith("Bearer ") else b""
