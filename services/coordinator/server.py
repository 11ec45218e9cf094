"""The public Generation service: each RPC is `from_pb -> coordinator -> to_pb`; errors become status codes.

A client that cancels, or whose deadline passes, cancels the handler; the coordinator's stream then aborts the
request, which releases its KV on the draft and target replicas.
"""

import logging

from specsplit.proto.v1 import generation_pb2, generation_pb2_grpc
from specsplit.services.coordinator import public_messages as pm
from specsplit.services.coordinator.coordinator import Coordinator
from specsplit.services.coordinator.generation import GenerationRequest
from specsplit.services.errors import SpecsplitError
from specsplit.services.telemetry import round_timeline
from specsplit.services.rpc.status_codes import status_code_for
from specsplit.services.tokenization import encode_for_request

log = logging.getLogger(__name__)



class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, coordinator: Coordinator, variant_stats=None):
        self.coordinator = coordinator
        self.variant_stats = variant_stats  # callable -> DraftVariantStatsResponse

    async def _request(self, m: generation_pb2.GenerateRequest) -> GenerationRequest:
        request_id = pm.request_id_from_pb(m)
        params = pm.params_from_pb(m)
        messages = pm.messages_from_pb(m)
        ids = await encode_for_request(self.coordinator.tokenizer, None if messages else pm.prompt_from_pb(m), messages,
                                       m.chat)
        return GenerationRequest(ids, params, request_id)

    async def Generate(self, request, context):
        try:
            result = await self.coordinator.generate(await self._request(request))
        except SpecsplitError as error:
            await context.abort(status_code_for(error), str(error))
        return pm.response_pb(result)

    async def GenerateStream(self, request, context):
        round_timeline.mark("request.received")
        try:
            generation = await self._request(request)
            async for event in self.coordinator.stream(generation):
                yield pm.stream_event_pb(event, generation.request_id)
                round_timeline.mark("client.streamed")
        except SpecsplitError as error:
            await context.abort(status_code_for(error), str(error))

    async def GetDraftVariantStats(self, request, context):
        if self.variant_stats is None:
            return generation_pb2.DraftVariantStatsResponse()
        return self.variant_stats()

    def add_to(self, server) -> None:
        generation_pb2_grpc.add_GenerationServicer_to_server(self, server)
