"""Property-based fuzzing of the public API over real gRPC: whatever the fields hold, every request is answered
with a proper status (OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED, never INTERNAL or UNKNOWN), the services stay
up, and every KV block comes back."""

import grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specsplit.proto.v1 import generation_pb2, generation_pb2_grpc

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def requests(draw):
    m = generation_pb2.GenerateRequest(request_id=draw(st.text(max_size=20)), chat=draw(st.booleans()))
    prompt = draw(st.sampled_from(["text", "ids", "none"]))
    if prompt == "text":
        m.text = draw(st.text(max_size=200))
    elif prompt == "ids":
        m.token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, 300), INT32), max_size=60)))
    m.sampling.temperature = draw(st.one_of(st.floats(0, 2, width=32), FLOATS))
    if draw(st.booleans()):
        m.sampling.top_p = draw(st.one_of(st.floats(0, 1, width=32), FLOATS))
    m.sampling.top_k = draw(st.one_of(st.integers(0, 50), st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        m.sampling.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        m.stopping.max_tokens = draw(st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1)))
    m.stopping.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    m.stopping.stop_token_ids.extend(draw(st.lists(INT32, max_size=5)))
    m.stopping.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        m.logprobs = draw(st.one_of(st.integers(0, 25), st.integers(0, 2**32 - 1)))
    m.speculation.mode = draw(st.integers(0, 5))
    m.speculation.num_speculative_tokens = draw(st.one_of(st.integers(0, 20), st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):  # the cluster's targets run lossless only: typical requests must be refused cleanly
        m.acceptance.method = draw(st.integers(0, 5))
        if draw(st.booleans()):
            m.acceptance.posterior_threshold = draw(st.one_of(st.floats(0, 1, width=32), FLOATS))
        if draw(st.booleans()):
            m.acceptance.posterior_alpha = draw(st.one_of(st.floats(0, 2, width=32), FLOATS))
    return m


def test_fuzzed_requests_get_proper_codes_and_nothing_leaks(cluster):
    channel = grpc.insecure_channel(cluster.addresses["one_target"])
    stub = generation_pb2_grpc.GenerationStub(channel)
    seen = {}

    valid = generation_pb2.GenerateRequest(text="def f(x):")
    valid.stopping.max_tokens = 6
    valid.sampling.temperature = 0.7
    valid.sampling.seed = 3

    # Derandomized: CI draws the same 60 requests every run, and the explicit examples make sure well-formed
    # requests (unary and streamed) are among them, whatever the draw holds.
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(requests(), st.booleans())
    @example(valid, False)
    @example(valid, True)
    def check(request, streaming):
        try:
            if streaming:
                list(stub.GenerateStream(request, timeout=60))
            else:
                stub.Generate(request, timeout=60)
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
            assert error.details(), "an error must say what went wrong"
        seen[code] = seen.get(code, 0) + 1
        assert code in ALLOWED, f"{code} for {request}"

    check()
    assert seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 0 and seen.get(grpc.StatusCode.OK, 0) > 0
    infos = cluster.wait_kv_free(["target_a", "target_b", "draft_a", "draft_b"])
    assert {n: (i.kv_blocks_used, i.sequences) for n, i in infos.items()} == {n: (0, 0) for n in infos}
    channel.close()
