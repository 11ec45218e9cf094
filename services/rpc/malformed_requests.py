"""Bytes that do not parse as the method's request message are the caller's mistake: INVALID_ARGUMENT and one log
line, not UNKNOWN and a traceback per call (gRPC's own handling when a deserializer raises).

Every asyncio method is covered, whatever its kind (every servicer here is asyncio; a synchronous handler would be
left as it is, see guarded_handler): the interceptor swaps its deserializer for one that returns a marker
instead of raising. A unary request that is a marker is refused before the servicer sees it. A streaming method
reads its requests through an iterator that ends the call with INVALID_ARGUMENT at the first marker; it reads each
message as gRPC's own iterator does (no extra step per message). The wrapped handlers are built once per method,
not per call.
"""

import inspect
import logging

import grpc

log = logging.getLogger(__name__)


class _Malformed:
    __slots__ = ("size", "reason")

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


class _Requests:
    """A streaming method's requests; the first that did not parse ends the call with INVALID_ARGUMENT."""

    __slots__ = ("_context", "_method")

    def __init__(self, context, method: str):
        self._context, self._method = context, method

    def __aiter__(self):
        return self

    async def __anext__(self):
        request = await self._context.read()
        if request is grpc.aio.EOF:
            raise StopAsyncIteration
        if type(request) is _Malformed:
            await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(self._method, request))
        return request


def _is_async(behaviour) -> bool:
    return inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)


def guarded_handler(method: str, handler):
    """`handler` with requests that do not parse refused (INVALID_ARGUMENT); a synchronous one is left as it is
    (gRPC runs those on its thread pool; every servicer here is asyncio)."""
    streaming = (bool(handler.request_streaming), bool(handler.response_streaming))
    behaviour = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
                 (True, False): handler.stream_unary, (True, True): handler.stream_stream}[streaming]
    if not _is_async(behaviour):
        return handler
    deserializer, serializer = _safe(handler.request_deserializer), handler.response_serializer

    async def unary_unary(request, context):
        if type(request) is _Malformed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(method, request))
        return await behaviour(request, context)

    # A streaming response keeps the method's own form (an async generator, or a coroutine that writes), so that
    # interceptors outside this one see what the servicer wrote.
    if inspect.isasyncgenfunction(behaviour):
        async def unary_stream(request, context):
            if type(request) is _Malformed:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(method, request))
            async for response in behaviour(request, context):
                yield response

        async def stream_stream(requests, context):
            async for response in behaviour(_Requests(context, method), context):
                yield response
    else:
        async def unary_stream(request, context):
            if type(request) is _Malformed:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(method, request))
            await behaviour(request, context)

        async def stream_stream(requests, context):
            await behaviour(_Requests(context, method), context)

    async def stream_unary(requests, context):
        return await behaviour(_Requests(context, method), context)

    make, wrapper = {
        (False, False): (grpc.unary_unary_rpc_method_handler, unary_unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, unary_stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, stream_unary),
        (True, True): (grpc.stream_stream_rpc_method_handler, stream_stream),
    }[streaming]
    return make(wrapper, request_deserializer=deserializer, response_serializer=serializer)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self):
        self._guarded: dict[str, tuple] = {}  # method -> (the handler it wraps, the wrapped handler)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        known = self._guarded.get(method)
        if known is None or known[0] is not handler:
            known = self._guarded[method] = (handler, guarded_handler(method, handler))
        return known[1]
