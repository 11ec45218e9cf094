"""A small Python client for the public Generation API.

    from specsplit.client import Client
    with Client("localhost:50051") as client:
        print(client.generate("def fib(n):", max_tokens=64).text)
        print(client.chat([{"role": "system", "content": "Answer in one line."},
                           {"role": "user", "content": "What does fib(10) return?"}]).text)
        for chunk in client.generate_stream("def fib(n):", temperature=0.7, seed=1):
            print(chunk.text, end="")
"""

import grpc

from specsplit.proto.v1 import generation_pb2, generation_pb2_grpc
from specsplit.services.coordinator import public_messages as pm
from specsplit.services.sampling_params import SamplingParams


class Client:
    """`token` sends `authorization: Bearer TOKEN`; `tls_ca` (and `tls_cert`/`tls_key` for mutual TLS) use TLS."""

    def __init__(self, address: str, timeout: float | None = None, token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, server_name: str | None = None):
        from specsplit.services.rpc.security import ChannelSecurity

        self.address = address
        security = ChannelSecurity(tls_ca, tls_cert, tls_key, server_name)
        if security.enabled:
            self.channel = grpc.secure_channel(address, security.credentials(), options=security.options())
        else:
            self.channel = grpc.insecure_channel(address)
        if token:
            self.channel = grpc.intercept_channel(self.channel, _BearerToken(token))
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

    def chat(self, messages: list[dict], request_id: str = "", **params):
        """A conversation ([{"role": "system"|"user"|"assistant", "content": TEXT}]) through the model's chat
        template; returns the assistant's next turn as a GenerationResult."""
        sampling = SamplingParams(**params)
        request = pm.request_pb(None, sampling, True, request_id, messages=messages)
        return pm.result_from_pb(self.stub.Generate(request, timeout=self.timeout), wants_logprobs=sampling.logprobs is not None)

    def chat_stream(self, messages: list[dict], request_id: str = "", **params):
        """Like `chat`, streamed: GenerateStreamResponse messages as in `generate_stream`."""
        request = pm.request_pb(None, SamplingParams(**params), True, request_id, messages=messages)
        yield from self.stub.GenerateStream(request, timeout=self.timeout)

    def generate_stream(self, prompt, chat: bool = False, request_id: str = "", **params):
        """Yield GenerateStreamResponse messages; the last one carries finish_reason, usage, stats and timings."""
        request = pm.request_pb(prompt, SamplingParams(**params), chat, request_id)
        yield from self.stub.GenerateStream(request, timeout=self.timeout)

    def draft_variant_stats(self) -> generation_pb2.DraftVariantStatsResponse:
        return self.stub.GetDraftVariantStats(generation_pb2.DraftVariantStatsRequest(), timeout=self.timeout)


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        metadata = list(details.metadata or []) + [self._header]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _CallDetails(details, metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


def generate_from_cli(args, params: SamplingParams, prompt, print_result) -> int:
    """`specsplit generate --server`: stream text as it arrives, or print one JSON object with --json."""
    import sys

    messages = getattr(args, "messages_list", None)
    request = pm.request_pb(None if messages else prompt, params, args.chat, messages=messages)
    import os

    token = getattr(args, "token", None) or os.environ.get("SPECSPLIT_TOKEN")
    tls = dict(tls_ca=getattr(args, "tls_ca", None), tls_cert=getattr(args, "tls_cert", None), tls_key=getattr(args, "tls_key", None),
               server_name=getattr(args, "tls_server_name", None))
    with Client(args.server, timeout=args.timeout, token=token, **tls) as client:
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
