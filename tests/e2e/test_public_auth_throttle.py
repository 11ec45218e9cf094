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
    """Ten failures lock the address out: a guess and then the right token, each from a new connection, are refused
    unchecked; once the lock-out is over the right token works. A call is judged only when its answer came back
    before the lock-out could have ended (it began after the tenth call was sent); a machine too loaded to fit a
    call into it tries again with the next lock-out, twice as long."""
    for lockout in (1.0, 2.0, 4.0, 8.0):  # the first lock-out lasts 1 s and each next one twice as long
        codes = [_generate(guarded_coordinator, f"Bearer guess-{i}") for i in range(9)]
        tenth_sent = time.monotonic()
        codes.append(_generate(guarded_coordinator, "Bearer guess-9"))
        locked_by = time.monotonic()  # the lock-out began between tenth_sent and now
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 10
        judged = []
        for header in ("Bearer guess-10", f"Bearer {TOKEN}"):
            code = _generate(guarded_coordinator, header)
            if time.monotonic() < tenth_sent + lockout:
                judged.append(code)
        assert judged == [grpc.StatusCode.RESOURCE_EXHAUSTED] * len(judged)
        time.sleep(max(0.0, locked_by + lockout - time.monotonic()) + 0.05)
        if len(judged) == 2:
            break
        # Answered after the lock-out: the guess counted as a failure, the right token cleared the count again.
    else:
        pytest.fail("no call was answered within a lock-out of up to 8 s")
    print(f"the guess and the right token refused unchecked within a {lockout:.0f} s lock-out")
    assert _generate(guarded_coordinator, f"Bearer {TOKEN}") == grpc.StatusCode.OK  # the lock-out is over
