"""A small Python client for the public Generation API.

    from specsplit.client import Client
    with Client("localhost:50051") as client:
        print(client.generate("def fib(n):", max_tokens=64).text)
        for chunk in client.generate_stream("def fib(n):", temperature=0.7, seed=1):
            print(chunk.text, end="")
"""

import grpc

from specsplit.proto.v1 import generation_pb2, generation_pb2_grpc
from specsplit.services.coordinator import public_messages as pm
from specsplit.services.sampling_params import SamplingParams


class Client:
    def __init__(self, address: str, timeout: float | None = None):
        self.channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.timeout = timeout

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(self, prompt, chat: bool = False, request_id: str = "", **params):
        """Prompt text or token ids; params are SamplingParams fields. Returns a GenerationResult."""
        sampling = SamplingParams(**params)
        response = self.stub.Generate(pm.request_pb(prompt, sampling, chat, request_id), timeout=self.timeout)
        return pm.result_from_pb(response, wants_logprobs=sampling.logprobs is not None)

    def generate_stream(self, prompt, chat: bool = False, request_id: str = "", **params):
        """Yield GenerateStreamResponse messages; the last one carries finish_reason, usage, stats and timings."""
        request = pm.request_pb(prompt, SamplingParams(**params), chat, request_id)
        yield from self.stub.GenerateStream(request, timeout=self.timeout)

    def draft_variant_stats(self) -> generation_pb2.DraftVariantStatsResponse:
        return self.stub.GetDraftVariantStats(generation_pb2.DraftVariantStatsRequest(), timeout=self.timeout)


def generate_from_cli(args, params: SamplingParams, prompt, print_result) -> int:
    """`specsplit generate --server`: stream text as it arrives, or print one JSON object with --json."""
    import sys

    request = pm.request_pb(prompt, params, args.chat)
    with Client(args.server, timeout=args.timeout) as client:
        try:
            token_ids, text, logprobs, last = [], [], [], None
            for chunk in client.stub.GenerateStream(request, timeout=client.timeout):
                token_ids.extend(chunk.token_ids)
                text.append(chunk.text)
                logprobs.extend(chunk.logprobs)
                if not args.json and chunk.text:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                last = chunk
        except grpc.RpcError as error:
            print(f"specsplit: error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 2
    whole = generation_pb2.GenerateResponse(
        request_id=last.request_id, token_ids=token_ids, text="".join(text), finish_reason=last.finish_reason,
        usage=last.usage, speculation=last.speculation, timings=last.timings, logprobs=logprobs,
    )
    print_result(args, pm.result_from_pb(whole, wants_logprobs=params.logprobs is not None))
    return 0
