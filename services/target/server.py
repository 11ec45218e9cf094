"""The target service: TargetWorker RPCs over the verifier, each `from_pb -> batched step -> to_pb`."""

from specsplit.proto.v1 import worker_pb2, worker_pb2_grpc
from specsplit.services.rpc import worker_messages as msg
from specsplit.services.rpc.invalid_items import valid_items_only
from specsplit.services.rpc.round_calls import RoundCalls
from specsplit.services.rpc.worker_credentials import caller_owner, owned_handles
from specsplit.services.rpc.step_batcher import StepBatcher
from specsplit.services.rpc.worker_info import worker_info
from specsplit.services.target.verifier import TargetVerifier
from specsplit.services.telemetry.worker_telemetry import WorkerTelemetry


class TargetService(worker_pb2_grpc.TargetWorkerServicer):
    def __init__(self, verifier: TargetVerifier, model_name: str):
        self.verifier = verifier
        self.model_name = model_name
        self.describe_model_path = True  # False on a worker open to unauthenticated callers (worker_process.py)
        self.round_port = 0  # where its round channel listens, once it does (rpc/round_channel.py)
        self.telemetry = WorkerTelemetry("target", verifier.runner, verifier.sequences,
                                         decode_ahead=verifier.decode_ahead)
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
        self.round = RoundCalls("target", "verify", worker_pb2.VerifyRequest, msg.verify_items, msg.verify_response,
                                self.batcher, self.telemetry)
        self.prefills = RoundCalls("target", "prefill", worker_pb2.TargetPrefillRequest, msg.target_prefill_items,
                                   msg.verify_response, self.batcher, self.telemetry, marks="target.prefill")

    def _verify(self, items: list) -> list:
        """Items that failed to decode stay errors; the rest verify as one batch."""
        valid = [i for i in items if not isinstance(i, Exception)]
        verdicts = iter(self.verifier.verify(valid))
        return [i if isinstance(i, Exception) else next(verdicts) for i in items]

    async def Prefill(self, request, context):
        return await self.prefills.unary(request, context)

    async def Verify(self, request, context):
        return await self.round.unary(request, context)

    async def VerifyStream(self, requests, context):
        """The round's calls over one long-lived stream; each request answered in order."""
        async for response in self.round.stream(requests, context):
            yield response

    async def Release(self, request, context):
        released = await self.batcher.submit("release", owned_handles(request.handles, caller_owner(context)))
        return worker_pb2.ReleaseResponse(released=sum(bool(r) for r in released))

    async def Describe(self, request, context):
        return worker_info("target", self.model_name, self.verifier.runner, self.verifier.sequences, self.batcher,
                           with_path=self.describe_model_path, round_port=self.round_port,
                           synthetic_acceptance=self.verifier.synthetic_acceptance)

    def add_to(self, server) -> None:
        worker_pb2_grpc.add_TargetWorkerServicer_to_server(self, server)
