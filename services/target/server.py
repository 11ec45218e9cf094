"""The target service: TargetWorker RPCs over the verifier, each `from_pb -> batched step -> to_pb`."""

import grpc

from specsplit.proto.v1 import worker_pb2, worker_pb2_grpc
from specsplit.services.errors import InvalidArgument
from specsplit.services.rpc import worker_messages as msg
from specsplit.services.rpc.invalid_items import valid_items_only
from specsplit.services.rpc.worker_credentials import bind_handles, caller_owner, owned_handles
from specsplit.services.rpc.step_batcher import StepBatcher
from specsplit.services.rpc.worker_info import worker_info
from specsplit.services.target.verifier import TargetVerifier
from specsplit.services.telemetry import round_timeline
from specsplit.services.telemetry.worker_telemetry import WorkerTelemetry


class TargetService(worker_pb2_grpc.TargetWorkerServicer):
    def __init__(self, verifier: TargetVerifier, model_name: str):
        self.verifier = verifier
        self.model_name = model_name
        self.describe_model_path = True  # False on a worker open to unauthenticated callers (worker_process.py)
        self.round_port = 0  # where its round channel listens, once it does (rpc/round_channel.py)
        self.telemetry = WorkerTelemetry("target", verifier.runner, verifier.sequences)
        self.batcher = StepBatcher(
            self.telemetry.instrument({
                "prefill": valid_items_only(verifier.prefill),
                "verify": self._verify,
                "release": lambda handles: [verifier.sequences.release(h) for h in handles],
                "expire": lambda ages: [verifier.sequences.release_idle(a) for a in ages],
            }),
            name="target",
        )
        self.telemetry.watch(self.batcher)

    def _verify(self, items: list) -> list:
        """Items that failed to decode stay errors; the rest verify as one batch."""
        valid = [i for i in items if not isinstance(i, Exception)]
        verdicts = iter(self.verifier.verify(valid))
        return [i if isinstance(i, Exception) else next(verdicts) for i in items]

    async def Prefill(self, request, context):
        items = bind_handles(msg.target_prefill_items(request), caller_owner(context))
        self.telemetry.received(items, request.traceparents)
        return msg.verify_response(await self.batcher.submit("prefill", items))

    async def Verify(self, request, context):
        return await self._over_grpc(self.round_call(request, caller_owner(context)), context)

    async def VerifyStream(self, requests, context):
        """The round's calls over one long-lived stream; each request answered in order."""
        owner = caller_owner(context)
        async for request in requests:
            yield await self._over_grpc(self.round_call(request, owner), context)

    async def round_call(self, request, owner: str | None):
        """One round's verify call from coordinator `owner`, whatever carried it (gRPC or the round channel,
        rpc/round_channel.py). Raises InvalidArgument when its columns do not line up."""
        round_timeline.mark("target.received")
        items = bind_handles(msg.verify_items(request), owner)
        self.telemetry.received(items, request.traceparents)
        round_timeline.mark("target.unpacked")
        results = await self.batcher.submit("verify", items, caller=owner)
        round_timeline.mark("target.resumed")
        response = msg.verify_response(results)
        round_timeline.mark("target.answered")
        return response

    async def round_frame(self, payload: bytes, owner: str | None) -> bytes:
        """The round channel's call: a serialized VerifyRequest in, the serialized answer out."""
        try:
            request = worker_pb2.VerifyRequest.FromString(payload)
        except Exception as error:  # protobuf's DecodeError and friends: bytes that are no such message
            raise InvalidArgument(f"the frame is not a valid VerifyRequest message ({type(error).__name__})") from None
        return (await self.round_call(request, owner)).SerializeToString()

    @staticmethod
    async def _over_grpc(call, context):
        try:
            return await call
        except InvalidArgument as error:  # columns that do not line up: the caller's bug, this call alone fails
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    async def Release(self, request, context):
        released = await self.batcher.submit("release", owned_handles(request.handles, caller_owner(context)))
        return worker_pb2.ReleaseResponse(released=sum(bool(r) for r in released))

    async def Describe(self, request, context):
        return worker_info("target", self.model_name, self.verifier.runner, self.verifier.sequences, self.batcher,
                           with_path=self.describe_model_path, round_port=self.round_port)

    def add_to(self, server) -> None:
        worker_pb2_grpc.add_TargetWorkerServicer_to_server(self, server)
