"""A worker's round call (Propose on a draft, Verify on a target) and its prefill, whatever carries them: a unary
gRPC call, one message of a long-lived gRPC stream, or a frame of the round channel (round_channel.py). Each is
`unpack -> one step (inline for a lone caller: a round call always, a prefill when short; rpc/step_batcher.py)
-> pack`, with the round timeline's marks on the way."""

import grpc

from specsplit.services.errors import InvalidArgument
from specsplit.services.rpc.worker_credentials import bind_handles, caller_owner
from specsplit.services.telemetry import round_timeline


class RoundCalls:
    def __init__(self, role: str, kind: str, request_type, unpack, pack, batcher, telemetry, marks: str | None = None):
        """`unpack(request)` -> items (InvalidArgument per bad item, raised for a malformed request); `pack(results)`
        -> the response message. `marks`: the round timeline's prefix for this call's stages (default: the role's,
        which the round's call uses; a prefill names its own)."""
        self.role, self.kind, self.request_type = role, kind, request_type
        self._unpack, self._pack = unpack, pack
        self._batcher, self._telemetry = batcher, telemetry
        self._marks = tuple(f"{marks or role}.{stage}" for stage in ("received", "unpacked", "resumed", "answered"))

    async def call(self, request, owner: str | None):
        """One round's call from coordinator `owner`. Raises InvalidArgument when its columns do not line up."""
        received, unpacked, resumed, answered = self._marks
        round_timeline.mark(received)
        items = bind_handles(self._unpack(request), owner)
        self._telemetry.received(items, request.traceparents)
        round_timeline.mark(unpacked)
        results = await self._batcher.submit(self.kind, items, caller=owner)
        round_timeline.mark(resumed)
        response = self._pack(results)
        round_timeline.mark(answered)
        return response

    async def unary(self, request, context):
        return await self._over_grpc(self.call(request, caller_owner(context)), context)

    async def stream(self, requests, context):
        """Each request of a long-lived stream answered in order."""
        owner = caller_owner(context)
        async for request in requests:
            yield await self._over_grpc(self.call(request, owner), context)

    async def frame(self, payload: bytes, owner: str | None) -> bytes:
        """The round channel's call: a serialized request in, the serialized answer out."""
        try:
            request = self.request_type.FromString(payload)
        except Exception as error:  # protobuf's DecodeError and friends: bytes that are no such message
            name = self.request_type.DESCRIPTOR.name
            raise InvalidArgument(f"the frame is not a valid {name} message ({type(error).__name__})") from None
        return (await self.call(request, owner)).SerializeToString()

    @staticmethod
    async def _over_grpc(call, context):
        try:
            return await call
        except InvalidArgument as error:  # columns that do not line up: the caller's bug, this call alone fails
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
