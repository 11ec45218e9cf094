"""The public API's bearer token, with real processes: compared exactly (case and scheme), and an address that keeps
failing is locked out (RESOURCE_EXHAUSTED, its tokens not even checked) with a doubling back-off, instead of
answering thousands of guesses a second."""

import time

import grpc
import pytest

from specsplit.proto.v1 import generation_pb2, generation_pb2_grpc
from specsplit.services.service_commands import spawn_service

TOKEN = "Public-Token-For-Tests-5b2d"


@pytest.fixture(scope="module")
def guarded_coordinator(cluster, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(TOKEN + "\n")
    process, address = spawn_service(["coordinator", "--target", cluster.addresses["target_a"], "--host", "127.0.0.1",
                                      "--port", "0", "-k", "0", "--metrics-port", "-1", "--auth-token-file", str(tokens)])
    try:
        yield address
    finally:
        process.terminate()
        process.wait(timeout=20)


def _generate(address, header):
    request = generation_pb2.GenerateRequest(text="hi")
    request.stopping.max_tokens = 2
    metadata = (("authorization", header),) if header is not None else ()
    with grpc.insecure_channel(address) as channel:
        try:
            generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30, metadata=metadata)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_the_token_is_compared_exactly(guarded_coordinator):
    for header in (f"Bearer {TOKEN.lower()}", f"Bearer {TOKEN.upper()}", f"bearer {TOKEN}", f"BEARER {TOKEN}",
                   f"Bearer {TOKEN} ", f"Bearer  {TOKEN}", f"Bearer {TOKEN[:-1]}", None):
        assert _generate(guarded_coordinator, header) == grpc.StatusCode.UNAUTHENTICATED, header
    assert _generate(guarded_coordinator, f"Bearer {TOKEN}") == grpc.StatusCode.OK  # a success clears the count


def test_repeated_failures_are_throttled(guarded_coordinator):
    started = time.monotonic()
    codes = [_generate(guarded_coordinator, f"Bearer guess-{i}") for i in range(40)]
    elapsed = time.monotonic() - started
    assert codes[:10] == [grpc.StatusCode.UNAUTHENTICATED] * 10
    assert set(codes[10:]) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert _generate(guarded_coordinator, f"Bearer {TOKEN}") == grpc.StatusCode.RESOURCE_EXHAUSTED
    print(f"40 guesses in {elapsed:.2f} s: 10 checked, 30 refused unchecked")
    time.sleep(1.2)  # the first lock-out lasts 1 s; the right token then works again
    assert _generate(guarded_coordinator, f"Bearer {TOKEN}") == grpc.StatusCode.OK
