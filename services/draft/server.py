"""The draft service: DraftWorker RPCs over the proposer, each `from_pb -> batched step -> to_pb`.

The proposer is a draft model (proposer.py) or the n-gram proposer (ngram_proposer.py, no model); both answer the
same calls, and Describe says which kind serves (`proposer`), so the coordinator's metrics can tell them apart.
"""

from specsplit.proto.v1 import worker_pb2, worker_pb2_grpc
from specsplit.services.draft.proposer import DraftProposer
from specsplit.services.rpc import worker_messages as msg
from specsplit.services.rpc.invalid_items import valid_items_only
from specsplit.services.rpc.round_calls import RoundCalls
from specsplit.services.rpc.worker_credentials import caller_owner, owned_handles
from specsplit.services.rpc.step_batcher import StepBatcher
from specsplit.services.rpc.worker_info import worker_info
from specsplit.services.telemetry.worker_telemetry import WorkerTelemetry


class DraftService(worker_pb2_grpc.DraftWorkerServicer):
    def __init__(self, proposer: DraftProposer, model_name: str):
        self.proposer = proposer
        self.model_name = model_name
        self.describe_model_path = True  # False on a worker open to unauthenticated callers (worker_process.py)
        self.round_port = 0  # where its round channel listens, once it does (rpc/round_channel.py)
        self.telemetry = WorkerTelemetry("draft", proposer.runner, proposer.sequences, proposer=proposer.kind)
        self.batcher = StepBatcher(
            self.telemetry.instrument({
                "prefill": valid_items_only(proposer.prefill),
                "propose": valid_items_only(proposer.propose),
                "release": lambda handles: [proposer.sequences.release(h) for h in handles],
                "expire": lambda ages: [proposer.sequences.release_idle(a) for a in ages],
            }),
            name="draft",
        )
        self.telemetry.watch(self.batcher)
        self.round = RoundCalls("draft", "propose", worker_pb2.ProposeRequest, msg.propose_items, msg.propose_response,
                                self.batcher, self.telemetry)
        self.prefills = RoundCalls("draft", "prefill", worker_pb2.DraftPrefillRequest, msg.draft_prefill_items,
                                   msg.draft_prefill_response, self.batcher, self.telemetry, marks="draft.prefill")

    async def Prefill(self, request, context):
        return await self.prefills.unary(request, context)

    async def Propose(self, request, context):
        return await self.round.unary(request, context)

    async def ProposeStream(self, requests, context):
        """The round's calls over one long-lived stream; each request answered in order."""
        async for response in self.round.stream(requests, context):
            yield response

    async def Release(self, request, context):
        released = await self.batcher.submit("release", owned_handles(request.handles, caller_owner(context)))
        return worker_pb2.ReleaseResponse(released=sum(bool(r) for r in released))

    async def Describe(self, request, context):
        return worker_info("draft", self.model_name, self.proposer.runner, self.proposer.sequences, self.batcher,
                           proposer=self.proposer.kind, max_model_len=self.proposer.max_model_len,
                           with_path=self.describe_model_path, round_port=self.round_port)

    def add_to(self, server) -> None:
        worker_pb2_grpc.add_DraftWorkerServicer_to_server(self, server)
