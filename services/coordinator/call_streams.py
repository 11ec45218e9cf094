"""A batched worker call (Propose, Verify) carried over one long-lived bidirectional gRPC stream.

A unary call pays its setup every round (a new HTTP/2 stream, headers, a call object and its completion queue
tag on both sides); a stream opened once pays it once, and each round is one message each way. Requests go one
at a time (a lock): each is answered by the stream's next response, so no ids are needed. The stream is reopened
after any failure; the call that saw the failure gets the same errors a unary call would (UNAVAILABLE when the
worker is gone), so the coordinator's fault handling is unchanged. A worker without the streaming method
(UNIMPLEMENTED) makes the client fall back to unary calls for good.
"""

import asyncio

import grpc

from specsplit.services.errors import Unavailable


class CallStream:
    def __init__(self, open_stream):
        self._open_stream = open_stream  # () -> a grpc.aio StreamStreamCall
        self._call = None
        self._lock = asyncio.Lock()
        self.unsupported = False

    async def request(self, message):
        """Send `message`, return the stream's next response. No deadline of its own: the caller bounds the exchange
        (a cancelled exchange resets the stream), so a round pays one timer, not one per await."""
        async with self._lock:
            if self._call is None or self._call.done():  # never opened, or ended since the last round
                self._call = self._open_stream()
            call = self._call
            try:
                await call.write(message)
                response = await call.read()
            except BaseException as error:  # a broken or abandoned exchange: the next request opens a new stream
                self._reset(call)
                if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.unsupported = True
                if isinstance(error, (asyncio.InvalidStateError, grpc.aio.UsageError)):
                    raise Unavailable(f"the worker stream ended: {error}") from None
                raise
            if response is grpc.aio.EOF:
                self._reset(call)
                code = await call.code()
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    self.unsupported = True
                raise Unavailable(f"the worker closed the stream ({code.name if code else 'no status'})")
            return response

    def _reset(self, call) -> None:
        if self._call is call:
            self._call = None
        call.cancel()

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
