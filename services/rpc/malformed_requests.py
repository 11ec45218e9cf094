"""Bytes that do not parse as the method's request message are the caller's mistake: INVALID_ARGUMENT and one log
line, not UNKNOWN and a traceback per call (gRPC's own handling when a deserializer raises).

The interceptor swaps each unary-request method's deserializer for one that returns a marker instead of raising;
the method's behaviour refuses the marker before the servicer ever sees it.
"""

import logging

import grpc

log = logging.getLogger(__name__)


class _Malformed:
    def __init__(self, size: int, reason: str):
        self.size, self.reason = size, reason


def _safe(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as error:
            return _Malformed(len(data), type(error).__name__)

    return deserialize


def _refuse(method: str, request: _Malformed):
    # One line, and nothing of the bytes themselves: they may be huge or hostile.
    log.warning("refused %s: %d bytes are not a valid request message (%s)", method, request.size, request.reason)
    return f"the request is not a valid {method.rsplit('/', 1)[-1]} message"


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        if handler.response_streaming:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(method, request))
                async for response in _as_async_iterator(inner(request, context)):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=_safe(handler.request_deserializer),
                                                        response_serializer=handler.response_serializer)
        inner = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(method, request))
            return await _maybe_await(inner(request, context))

        return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=_safe(handler.request_deserializer),
                                                   response_serializer=handler.response_serializer)


async def _maybe_await(value):
    return await value if hasattr(value, "__await__") else value


async def _as_async_iterator(value):
    if hasattr(value, "__aiter__"):
        async for item in value:
            yield item
    else:
        if hasattr(value, "__await__"):
            value = await value
        for item in value or ():
            yield item
