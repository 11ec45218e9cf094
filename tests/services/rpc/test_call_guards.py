"""The secret check and the malformed-request check on every kind of gRPC method (unary-unary, unary-stream,
stream-unary, stream-stream), over real gRPC on loopback: a server started by the services' own bootstrap
(`start_server`) with one method of each kind, guarded as the workers and the coordinator guard theirs."""

import asyncio
import logging
import threading
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specsplit.proto.v1 import worker_pb2
from specsplit.services.rpc.auth_throttle import FailureThrottle
from specsplit.services.rpc.caller_auth import SecretCheck, SecretCheckInterceptor, metadata_value
from specsplit.services.rpc.server import start_server

SERVICE = "test.Guarded"
HEADER = "x-test-secret"
SECRET = "the-right-secret-0123456789abcdef"
KINDS = {"UnaryUnary": (False, False), "UnaryStream": (False, True), "StreamUnary": (True, False), "StreamStream": (True, True)}
GARBAGE = b"\xff\xff\xff\xff\x0f\x12\x99" + b"\x00" * 16
Request, Response = worker_pb2.ReleaseRequest, worker_pb2.ReleaseResponse


def presented(metadata) -> bytes:
    return metadata_value(metadata, HEADER).encode()


class CountingThrottle(FailureThrottle):
    """The real throttle, counting the failures it is told of."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.failures = 0

    def failed(self, address):
        self.failures += 1
        return super().failed(address)


class Recorder:
    """One method of each kind; notes what each method was handed and how often a request was parsed."""

    def __init__(self):
        self.seen: dict[str, list] = {name: [] for name in KINDS}
        self.parsed = 0

    def parse(self, data: bytes):
        self.parsed += 1
        return Request.FromString(data)

    async def unary_unary(self, request, context):
        self.seen["UnaryUnary"].append(list(request.handles))
        return Response(released=len(request.handles))

    async def unary_stream(self, request, context):
        self.seen["UnaryStream"].append(list(request.handles))
        for handle in request.handles:
            yield Response(released=len(handle))

    async def stream_unary(self, requests, context):
        total = 0
        async for request in requests:
            self.seen["StreamUnary"].append(list(request.handles))
            total += len(request.handles)
        return Response(released=total)

    async def stream_stream(self, requests, context):
        async for request in requests:
            self.seen["StreamStream"].append(list(request.handles))
            yield Response(released=len(request.handles))

    def add_to(self, server):
        make = {"UnaryUnary": (grpc.unary_unary_rpc_method_handler, self.unary_unary),
                "UnaryStream": (grpc.unary_stream_rpc_method_handler, self.unary_stream),
                "StreamUnary": (grpc.stream_unary_rpc_method_handler, self.stream_unary),
                "StreamStream": (grpc.stream_stream_rpc_method_handler, self.stream_stream)}
        handlers = {name: kind(behaviour, request_deserializer=self.parse, response_serializer=Response.SerializeToString)
                    for name, (kind, behaviour) in make.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest.fixture(scope="module")
def served():
    """The guarded server on its own event loop thread; a throttle that answers at once (its delays are tested in
    test_auth_throttle.py and below)."""
    recorder = Recorder()
    throttle = CountingThrottle(free_failures=10_000, max_answers_per_second=1e9)
    check = SecretCheck([SECRET], throttle)
    interceptor = SecretCheckInterceptor(check, presented, "no entry")
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box = {}

    async def main():
        server, port, _ = await start_server(recorder.add_to, [SERVICE], "127.0.0.1", 0, [interceptor])
        box["server"], box["port"], box["stop"] = server, port, asyncio.Event()
        started.set()
        await box["stop"].wait()
        await server.stop(grace=0.5)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{box['port']}")
    yield {"recorder": recorder, "throttle": throttle, "channel": channel, "interceptor": interceptor}
    channel.close()
    loop.call_soon_threadsafe(box["stop"].set)
    thread.join(timeout=10)


def _call(channel, name, requests, metadata=(), raw=False):
    """Call the method `name` with `requests` (a list; for a streaming request any iterable); returns
    (status code, list of `released` values answered)."""
    streaming_in, streaming_out = KINDS[name]
    path = f"/{SERVICE}/{name}"
    serialize = None if raw else Request.SerializeToString
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[(streaming_in, streaming_out)]
    call = kind(path, request_serializer=serialize, response_deserializer=Response.FromString)
    try:
        answer = call(iter(requests) if streaming_in else requests[0], timeout=30, metadata=metadata)
        answers = list(answer) if streaming_out else [answer]
    except grpc.RpcError as error:
        return error.code(), []
    return grpc.StatusCode.OK, [a.released for a in answers]


@pytest.mark.parametrize("name", KINDS)
def test_every_kind_refuses_a_call_without_the_secret_before_reading_a_message(served, name):
    recorder = served["recorder"]
    for metadata in ((), ((HEADER, "wrong-secret-0123456789abcdef"),), ((HEADER, SECRET.upper()),)):
        parsed_before = recorder.parsed
        if KINDS[name][0]:
            # A stream whose first message never comes: refused all the same, so nothing was waited for or read.
            release = threading.Event()

            def never_sends():
                release.wait(30)
                yield Request(handles=["late"])

            try:
                code, answers = _call(served["channel"], name, never_sends(), metadata)
            finally:
                release.set()
        else:
            code, answers = _call(served["channel"], name, [Request(handles=["a"])], metadata)
        assert (code, answers) == (grpc.StatusCode.UNAUTHENTICATED, []), metadata
        assert recorder.parsed == parsed_before  # the unary request's bytes were not even parsed
    assert recorder.seen[name] == []


@pytest.mark.parametrize("name", KINDS)
def test_every_kind_serves_the_right_secret(served, name):
    metadata = ((HEADER, SECRET),)
    requests = [Request(handles=["a", "bb"]), Request(handles=["ccc"])]
    code, answers = _call(served["channel"], name, requests if KINDS[name][0] else requests[:1], metadata)
    expected = {"UnaryUnary": [2], "UnaryStream": [1, 2], "StreamUnary": [3], "StreamStream": [2, 1]}[name]
    assert (code, answers) == (grpc.StatusCode.OK, expected)


def test_a_valid_call_gets_the_methods_own_handler_so_streams_pay_nothing_per_message(served):
    """The check happens once, when the call opens: a valid call is handed the very handler it would have had
    without the check (no wrapper around its messages); an invalid one a refusal of the same kind."""
    interceptor = served["interceptor"]
    for name, (streaming_in, streaming_out) in KINDS.items():
        handler = SimpleNamespace(request_streaming=streaming_in, response_streaming=streaming_out)

        async def continuation(details, handler=handler):
            return handler

        class Details:
            method = f"/{SERVICE}/{name}"
            invocation_metadata = (("other", "x"), (HEADER, SECRET))

        assert asyncio.run(interceptor.intercept_service(continuation, Details)) is handler
        Details.invocation_metadata = ((HEADER, SECRET + "x"),)
        refusal = asyncio.run(interceptor.intercept_service(continuation, Details))
        assert refusal is not handler
        assert (refusal.request_streaming, refusal.response_streaming) == (streaming_in, streaming_out)


@pytest.mark.parametrize("name", KINDS)
def test_malformed_bytes_end_each_kind_with_invalid_argument_and_one_log_line(served, name, caplog):
    recorder = served["recorder"]
    seen_before = len(recorder.seen[name])
    metadata = ((HEADER, SECRET),)
    good = Request(handles=["ok"]).SerializeToString()
    # On a stream, a good message first: it reaches the method; the bad one after it ends the call.
    requests = [good, GARBAGE, good] if KINDS[name][0] else [GARBAGE]
    with caplog.at_level(logging.WARNING):
        code, _ = _call(served["channel"], name, requests, metadata, raw=True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    refusals = [r for r in caplog.records if "not a valid request message" in r.getMessage()]
    assert len(refusals) == 1 and f"/{SERVICE}/{name}" in refusals[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]  # no traceback
    assert recorder.seen[name][seen_before:] == ([["ok"]] if KINDS[name][0] else [])
    assert _call(served["channel"], name, [Request(handles=["x"])] * (2 if KINDS[name][0] else 1), metadata)[0] == grpc.StatusCode.OK


def test_health_and_reflection_stay_open(served):
    channel = served["channel"]
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30))
    assert SERVICE in [s.name for s in answers[0].list_services_response.service]


def test_a_valid_secret_is_served_at_once_beside_slowed_failures_from_the_same_address(served):
    """A real throttle this time (3 free failures, then 0.1 s doubling): 20 wrong secrets sent side by side from
    this address are slowed, and the right secret, sent from the same address meanwhile, never reaches the
    throttle (the only thing that waits) and is served each time."""
    throttle = CountingThrottle()
    interceptor = SecretCheckInterceptor(SecretCheck([SECRET], throttle), presented, "no entry")
    loop = asyncio.new_event_loop()
    try:
        async def main():
            recorder = Recorder()
            server, port, _ = await start_server(recorder.add_to, [SERVICE], "127.0.0.1", 0, [interceptor])
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary(f"/{SERVICE}/UnaryUnary", request_serializer=Request.SerializeToString,
                                           response_deserializer=Response.FromString)

                async def timed(secret):
                    started = loop.time()
                    try:
                        await call(Request(handles=["h"]), timeout=60, metadata=((HEADER, secret),))
                        code = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as error:
                        code = error.code()
                    return code, loop.time() - started

                wrong = [asyncio.ensure_future(timed(f"guess-{i:03d}-0123456789")) for i in range(20)]
                right = []
                for _ in range(10):  # spread over the second the failures are kept waiting
                    right.append(await timed(SECRET))
                    await asyncio.sleep(0.1)
                wrong = await asyncio.gather(*wrong)
            await server.stop(grace=0.5)
            return wrong, right, recorder

        wrong, right, recorder = loop.run_until_complete(main())
    finally:
        loop.close()
    assert [code for code, _ in right] == [grpc.StatusCode.OK] * 10 and len(recorder.seen["UnaryUnary"]) == 10
    assert throttle.failures == 20  # the right secret never went near the throttle
    assert {code for code, _ in wrong} == {grpc.StatusCode.UNAUTHENTICATED}
    # Side by side, the failures were answered one answer slot (1/20 s) apart at least, after their back-off.
    assert max(seconds for _, seconds in wrong) >= 19 * throttle.answer_spacing
    assert sum(seconds >= throttle.first_delay for _, seconds in wrong) >= 20 - throttle.free_failures - 1
