"""The worker API trusts no one by default, with real processes: a worker given a secret refuses every method
without it, unary and streaming, before reading a request (UNAUTHENTICATED, health stays open; the methods are
walked from the generated descriptors, so a method added later is tried too), `specsplit serve` generates one and
passes it through the environment (never argv), a worker with no credentials listens on loopback only and says so,
sequence handles are bound to the coordinator that created them, bad secrets are slowed without ever refusing the
right one, and bytes that are no message end any method, streams included, with INVALID_ARGUMENT and one log line."""

import asyncio
import importlib
import os
import pkgutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import specsplit.proto.v1
from specsplit.client import Client
from specsplit.proto.v1 import worker_pb2, worker_pb2_grpc
from specsplit.services.draft.proposer import DraftPrefill, ProposeItem
from specsplit.services.errors import InvalidArgument, Unavailable
from specsplit.services.rpc import worker_messages as msg
from specsplit.services.rpc.round_channel import ERROR, HEADER, HELLO, MAX_HELLO_BYTES, PREFILL, REQUEST, RoundChannelClient, \
    encode_frame, error_from_frame, read_frame
from specsplit.services.runtime.worker_sequences import WorkerSampling
from specsplit.services.service_commands import spawn_service
from specsplit.services.target.verifier import VerifyItem

from cluster import child_pids, item_codes, item_tokens

# The contract, spelled out (services/rpc/worker_credentials.py holds the same names).
WORKER_SECRET_ENV = "SPECSPLIT_WORKER_SECRET"
WORKER_SECRET_HEADER = "x-specsplit-worker-secret"
COORDINATOR_ID_HEADER = "x-specsplit-coordinator"

SECRET = "worker-secret-for-tests-0c4e9a7d"
# Every gRPC service in the protos, and which process of the `guarded` fixture serves it behind the workers' secret.
# The public API has bearer tokens of its own (test_security.py, test_public_auth_throttle.py).
WORKER_SERVICES = {"specsplit.v1.DraftWorker": "draft", "specsplit.v1.TargetWorker": "target"}
PUBLIC_SERVICES = {"specsplit.v1.Generation"}
GARBAGE = b"\xff\xff\xff\xff\x0f\x12\x99" + b"\x00" * 64


@pytest.fixture(scope="module")
def guarded(tiny_pair, tmp_path_factory):
    env = {**os.environ, WORKER_SECRET_ENV: SECRET}
    model = ["--dtype", "float64", "--metrics-port", "-1", "--num-kv-blocks", "128", "--host", "127.0.0.1", "--port", "0"]
    logs = tmp_path_factory.mktemp("worker-auth")
    processes = []
    try:
        with open(logs / "target.log", "w") as target_log, open(logs / "draft.log", "w") as draft_log:
            target, target_addr = spawn_service(["target", "--model", str(tiny_pair["target"]), *model], env, target_log)
            processes.append(target)
            draft, draft_addr = spawn_service(["draft", "--model", str(tiny_pair["close"]), *model], env, draft_log)
            processes.append(draft)
        coordinator, address = spawn_service(["coordinator", "--target", target_addr, "--draft", draft_addr, "--host",
                                              "127.0.0.1", "--port", "0", "--metrics-port", "-1"], env)
        processes.append(coordinator)
        yield {"coordinator": address, "target": target_addr, "draft": draft_addr, "tiny": tiny_pair,
               "logs": {"target": logs / "target.log", "draft": logs / "draft.log"}}
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            p.wait(timeout=20)


def _describe(address, metadata=(), stub=worker_pb2_grpc.TargetWorkerStub):
    with grpc.insecure_channel(address) as channel:
        return stub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10, metadata=metadata)


def _code(call):
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_the_coordinator_with_the_secret_is_served(guarded):
    with Client(guarded["coordinator"], timeout=60) as client:
        result = client.generate("hello", max_tokens=6, ignore_eos=True)
    assert len(result.token_ids) == 6 and result.stats.draft_tokens > 0


def test_calls_without_the_secret_are_unauthenticated(guarded):
    target = guarded["target"]
    assert _code(lambda: _describe(target)) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: _describe(target, ((WORKER_SECRET_HEADER, SECRET.upper()),))) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: _describe(target, ((WORKER_SECRET_HEADER, SECRET[:-1]),))) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(target) as channel:
        verify = worker_pb2_grpc.TargetWorkerStub(channel).Verify
        request = msg.verify_request([VerifyItem("x", 0, [1], logprobs=5)])
        assert _code(lambda: verify(request, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no secret
    assert _describe(target, ((WORKER_SECRET_HEADER, SECRET),)).role == "target"


def test_a_coordinator_without_the_secret_is_refused_at_once(guarded):
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != WORKER_SECRET_ENV}
    try:
        process, _ = spawn_service(["coordinator", "--target", guarded["target"], "--host", "127.0.0.1", "--port", "0",
                                    "--metrics-port", "-1"], env, stderr=subprocess.DEVNULL)
    except RuntimeError as error:
        assert "before listening" in str(error)
    else:
        process.terminate()
        process.wait(timeout=20)
        pytest.fail("a coordinator without the workers' secret must not start")
    assert time.monotonic() - started < 60  # not the 300 s connect timeout


def test_handles_are_bound_to_the_coordinator_that_created_them(guarded):
    def as_coordinator(name):
        return ((WORKER_SECRET_HEADER, SECRET), (COORDINATOR_ID_HEADER, name))

    greedy = worker_pb2.WorkerSampling(temperature=0.0, top_p=1.0, seed=1)
    with grpc.insecure_channel(guarded["target"]) as channel:
        stub = worker_pb2_grpc.TargetWorkerStub(channel)
        prefill = stub.Prefill(worker_pb2.TargetPrefillRequest(items=[
            worker_pb2.TargetPrefillItem(handle="shared-name", token_ids=[1, 2, 3], sampling=greedy)]),
            timeout=30, metadata=as_coordinator("alice"))
        first = item_tokens(prefill)[0]
        other = stub.Verify(msg.verify_request([VerifyItem("shared-name", 3, first, logprobs=5)]),
                            timeout=30, metadata=as_coordinator("mallory"))
        assert item_codes(other) == [grpc.StatusCode.NOT_FOUND.value[0]]
        assert stub.Release(worker_pb2.ReleaseRequest(handles=["shared-name"]), timeout=30, metadata=as_coordinator("mallory")).released == 0
        own = stub.Verify(msg.verify_request([VerifyItem("shared-name", 3, first)]),
                          timeout=30, metadata=as_coordinator("alice"))
        assert item_codes(own) == [0]
        assert stub.Release(worker_pb2.ReleaseRequest(handles=["shared-name"]), timeout=30, metadata=as_coordinator("alice")).released == 1


def _all_services() -> dict:
    """Every service of every generated proto module: full name -> ServiceDescriptor."""
    services = {}
    for module in pkgutil.iter_modules(specsplit.proto.v1.__path__):
        if module.name.endswith("_pb2"):
            descriptor = importlib.import_module(f"specsplit.proto.v1.{module.name}").DESCRIPTOR
            services.update({s.full_name: s for s in descriptor.services_by_name.values()})
    return services


def _raw_call(channel, method, messages, metadata):
    """Call `method` (a MethodDescriptor) with raw `messages` (an iterable for a streaming request, else its one
    message); returns the status code."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    call = kind[(method.client_streaming, method.server_streaming)](path, request_serializer=None, response_deserializer=None)
    try:
        answer = call(messages, timeout=60, metadata=metadata)
        if method.server_streaming:
            list(answer)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_every_method_of_every_worker_service_checks_the_secret(guarded):
    """Walked from the descriptors: each method of each worker service, unary or streaming, refuses a call without
    the secret and one with a wrong secret (a stream before its first message: the test's stream never sends one),
    serves the right secret, and refuses bytes that are no message with INVALID_ARGUMENT and one log line."""
    services = _all_services()
    assert set(services) == set(WORKER_SERVICES) | PUBLIC_SERVICES, "a new service: say above who serves it and how it is guarded"
    methods = [(m, guarded[WORKER_SERVICES[name]]) for name in WORKER_SERVICES for m in services[name].methods]
    assert {m.name for m, _ in methods} >= {"Propose", "ProposeStream", "Verify", "VerifyStream", "Describe"}
    assert any(m.client_streaming for m, _ in methods)
    released = threading.Event()  # holds the refused streams' first messages back until every refusal is in

    def held_back():
        released.wait(60)
        yield b""

    def refused(method, address, metadata):
        with grpc.insecure_channel(address) as channel:
            return _raw_call(channel, method, held_back() if method.client_streaming else b"", metadata)

    attempts = [(m, a, md) for m, a in methods for md in ((), ((WORKER_SECRET_HEADER, "wrong-secret-0123456789abc"),))]
    with ThreadPoolExecutor(len(attempts)) as pool:  # side by side: the failures' delays overlap
        codes = list(pool.map(lambda attempt: refused(*attempt), attempts))
    released.set()
    assert [(m.full_name, c) for (m, _, _), c in zip(attempts, codes)] == \
           [(m.full_name, grpc.StatusCode.UNAUTHENTICATED) for m, _, _ in attempts]

    right = ((WORKER_SECRET_HEADER, SECRET),)
    lines_before = {role: _refusal_lines(guarded["logs"][role]) for role in WORKER_SERVICES.values()}
    for method, address in methods:
        with grpc.insecure_channel(address) as channel:
            # An empty message is a valid request of every type; on a stream, one and then the end of the stream.
            served = _raw_call(channel, method, iter([b""]) if method.client_streaming else b"", right)
            assert served == grpc.StatusCode.OK, method.full_name
            bad = iter([b"", GARBAGE, b""]) if method.client_streaming else GARBAGE
            assert _raw_call(channel, method, bad, right) == grpc.StatusCode.INVALID_ARGUMENT, method.full_name
    time.sleep(0.5)  # the workers' last log lines
    for role in WORKER_SERVICES.values():
        lines = _refusal_lines(guarded["logs"][role])[len(lines_before[role]):]
        served_here = [m for m, a in methods if a == guarded[role]]
        assert len(lines) == len(served_here), lines  # one line per refused call
        assert "Traceback" not in guarded["logs"][role].read_text()


def _refusal_lines(log) -> list[str]:
    return [line for line in log.read_text().splitlines() if "not a valid request message" in line]


def test_bad_secrets_are_slowed_and_never_lock_out_the_right_one(guarded):
    """The address that keeps sending wrong secrets is this one, and so is the right caller's: the wrong ones wait
    (0.1 s doubling to 2 s after 3, at most 20 answers a second), the right one is served at once throughout."""
    draft = guarded["draft"]

    def describe(secret):
        started = time.monotonic()
        with grpc.insecure_channel(draft) as channel:
            stub = worker_pb2_grpc.DraftWorkerStub(channel)
            code = _code(lambda: stub.Describe(worker_pb2.DescribeRequest(), timeout=60,
                                               metadata=((WORKER_SECRET_HEADER, secret),)))
        return code, time.monotonic() - started

    with ThreadPoolExecutor(12) as pool:
        wrong = [pool.submit(describe, f"guess-{i:04d}-padding-to-16") for i in range(12)]
        right = []
        for _ in range(6):  # while the wrong ones wait
            right.append(describe(SECRET))
            time.sleep(0.1)
        wrong = [w.result() for w in wrong]
    assert [code for code, _ in wrong] == [grpc.StatusCode.UNAUTHENTICATED] * 12
    assert max(seconds for _, seconds in wrong) >= 1.5  # the 12th failure in a row waits 2 s
    assert [code for code, _ in right] == [grpc.StatusCode.OK] * 6
    assert max(seconds for _, seconds in right) < 1.0, right  # far below the wait of the failures beside it


def test_a_worker_without_credentials_listens_on_loopback_only(guarded, tmp_path, other_host):
    log = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if k != WORKER_SECRET_ENV}
    with open(log, "w") as err:
        worker, address = spawn_service(["target", "--model", str(guarded["tiny"]["target"]), "--dtype", "float64",
                                         "--host", "0.0.0.0", "--port", "0", "--metrics-port", "-1",
                                         "--num-kv-blocks", "64"], env, stderr=err)
    try:
        assert address.startswith("127.0.0.1:")
        assert "listening on 127.0.0.1 only" in log.read_text()
        assert other_host.reach(int(address.rsplit(":", 1)[1])) == "refused"  # from another host: nothing there
        assert _describe(address).role == "target"
    finally:
        worker.terminate()
        worker.wait(timeout=20)


def test_serve_generates_a_secret_and_keeps_it_off_the_command_line(tiny_pair):
    env = {k: v for k, v in os.environ.items() if k != WORKER_SECRET_ENV}
    serve = subprocess.Popen([sys.executable, "-m", "specsplit", "serve", "--target", str(tiny_pair["target"]), "--draft",
                              str(tiny_pair["close"]), "--dtype", "float64", "--num-kv-blocks", "64", "--port", "0",
                              "--metrics-port", "-1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(180, serve.kill)  # a serve that never names its workers must not hang the test
    watchdog.start()
    try:
        workers = []
        for line in serve.stderr:
            if " listening on " in line:
                workers.append(line.strip().rsplit(" ", 1)[-1])
            if len(workers) == 2:
                break
        assert len(workers) == 2, "serve names its workers' addresses"
        children = child_pids(serve.pid)
        assert len(children) == 3
        secrets = set()
        for pid in children:
            assert WORKER_SECRET_ENV.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
            environ = dict(v.split(b"=", 1) for v in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in v)
            secrets.add(environ[WORKER_SECRET_ENV.encode()].decode())
        assert len(secrets) == 1 and len(next(iter(secrets))) >= 32
        secret = secrets.pop()
        assert all(secret not in open(f"/proc/{pid}/cmdline").read() for pid in children + [serve.pid])
        stubs = [worker_pb2_grpc.TargetWorkerStub, worker_pb2_grpc.DraftWorkerStub]
        for address, stub in zip(workers, stubs):
            assert _code(lambda: _describe(address, stub=stub)) == grpc.StatusCode.UNAUTHENTICATED
            assert _describe(address, ((WORKER_SECRET_HEADER, secret),), stub).role in ("target", "draft")
    finally:
        watchdog.cancel()
        serve.terminate()
        serve.wait(timeout=30)


def _round_channel(guarded, role: str, secret: str | None):
    """A round-channel client to the guarded `role` worker (its port from Describe, which needs the secret)."""
    address = guarded[role]
    stub = worker_pb2_grpc.DraftWorkerStub if role == "draft" else worker_pb2_grpc.TargetWorkerStub
    port = _describe(address, ((WORKER_SECRET_HEADER, SECRET),), stub).round_port
    assert port > 0  # a worker serves its round channel by default
    return RoundChannelClient(address.rpartition(":")[0], port, "channel-test", secret)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_the_round_channel_checks_the_secret_too(guarded, role):
    """The round's fast path (rpc/round_channel.py) is guarded like the gRPC methods: no secret or a wrong one is
    refused before any request is read; the right one is served."""
    request, response = ((msg.verify_request([VerifyItem("nobody", 0, [1])]), worker_pb2.VerifyResponse) if role == "target"
                         else (msg.propose_request([ProposeItem("nobody", 0, [1], 2)]), worker_pb2.ProposeResponse))

    async def ask(secret):
        client = _round_channel(guarded, role, secret)
        try:
            return await client.request(request, response)
        finally:
            client.close()

    for wrong in (None, SECRET.upper(), SECRET[:-1]):
        with pytest.raises(Unavailable, match="refused the round channel"):
            asyncio.run(ask(wrong))
    served = asyncio.run(ask(SECRET))
    assert item_codes(served) == [grpc.StatusCode.NOT_FOUND.value[0]]  # served: the handle is simply unknown


def test_bytes_that_are_no_message_end_the_round_channel_alone(guarded):
    async def main():
        client = _round_channel(guarded, "target", SECRET)
        try:
            with pytest.raises(InvalidArgument, match="not a valid VerifyRequest"):
                await client.request(_Garbage(), worker_pb2.VerifyResponse)
            # A new connection is served as before: the worker went on.
            return await client.request(msg.verify_request([VerifyItem("nobody", 0, [1])]), worker_pb2.VerifyResponse)
        finally:
            client.close()

    assert item_codes(asyncio.run(main())) == [grpc.StatusCode.NOT_FOUND.value[0]]
    with Client(guarded["coordinator"], timeout=60) as client:
        assert len(client.generate([1, 2, 3], max_tokens=4, ignore_eos=True).token_ids) == 4


def test_prefills_over_the_round_channel_are_served_and_bound_to_its_coordinator(guarded):
    """A request's prefill takes the round channel too (PREFILL frames): what it creates belongs to the coordinator
    id of the channel's hello, as a gRPC prefill's belongs to its metadata's, and bytes that are no prefill request
    end the connection alone. Both workers say they take prefills there."""
    greedy = worker_pb2.WorkerSampling(temperature=0.0, top_p=1.0, seed=1)
    for role, stub in (("target", worker_pb2_grpc.TargetWorkerStub), ("draft", worker_pb2_grpc.DraftWorkerStub)):
        assert _describe(guarded[role], ((WORKER_SECRET_HEADER, SECRET),), stub).round_channel_prefills

    async def main():
        target, draft = _round_channel(guarded, "target", SECRET), _round_channel(guarded, "draft", SECRET)
        try:
            prefilled = await target.request(worker_pb2.TargetPrefillRequest(items=[worker_pb2.TargetPrefillItem(
                handle="over-the-channel", token_ids=[1, 2, 3], sampling=greedy)]), worker_pb2.VerifyResponse, PREFILL)
            first = item_tokens(prefilled)[0]
            verified = await target.request(msg.verify_request([VerifyItem("over-the-channel", 3, first)]),
                                            worker_pb2.VerifyResponse)
            drafted = await draft.request(msg.draft_prefill_request([DraftPrefill(
                "over-the-channel", [1, 2, 3], WorkerSampling(0.0, 0, 1.0, 1))]), worker_pb2.DraftPrefillResponse, PREFILL)
            with pytest.raises(InvalidArgument, match="not a valid TargetPrefillRequest"):
                await target.request(_Garbage(), worker_pb2.VerifyResponse, PREFILL)
            return first, verified, drafted
        finally:
            target.close()
            draft.close()

    first, verified, drafted = asyncio.run(main())
    assert len(first) == 1 and item_codes(verified) == [0]
    assert [r.status.code for r in drafted.results] == [0]
    with grpc.insecure_channel(guarded["target"]) as channel:
        stub = worker_pb2_grpc.TargetWorkerStub(channel)

        def release(coordinator):
            return stub.Release(worker_pb2.ReleaseRequest(handles=["over-the-channel"]), timeout=30, metadata=(
                (WORKER_SECRET_HEADER, SECRET), (COORDINATOR_ID_HEADER, coordinator))).released

        assert release("mallory") == 0 and release("channel-test") == 1
    with grpc.insecure_channel(guarded["draft"]) as channel:  # the draft's sequence too: nothing left to the lease
        released = worker_pb2_grpc.DraftWorkerStub(channel).Release(worker_pb2.ReleaseRequest(
            handles=["over-the-channel"]), timeout=30, metadata=((WORKER_SECRET_HEADER, SECRET),
                                                                  (COORDINATOR_ID_HEADER, "channel-test")))
        assert released.released == 1


@pytest.mark.parametrize("kind, hello, refusal", [
    (HELLO, b"x" * (MAX_HELLO_BYTES + 1), Unavailable),          # over the hello's limit: refused from its header
    (REQUEST, b"\n" + SECRET.encode(), Unavailable),             # no hello first, even one holding the secret
    (HELLO, b"c" * 65 + b"\nwrong-secret", Unavailable),         # a bad id with a wrong secret: the secret speaks
    (HELLO, b"c" * 65 + b"\n" + SECRET.encode(), InvalidArgument),   # a bad id with the right one: the id does
    (HELLO, "é".encode() * 33 + b"\n" + SECRET.encode(), InvalidArgument),  # 33 characters, 66 bytes
], ids=["oversized", "not-a-hello", "long-id-wrong-secret", "long-id", "long-id-in-bytes"])
def test_the_hello_is_checked_secret_first_and_within_bounds(guarded, kind, hello, refusal):
    """The hello is read before the caller is authenticated, so it is small (a larger one is refused from its
    header, nothing buffered), and as on gRPC the secret is checked first: without it every refusal is the
    throttled UNAUTHENTICATED; with it, a coordinator id over the gRPC calls' bound is INVALID_ARGUMENT."""
    async def say():
        port = _describe(guarded["target"], ((WORKER_SECRET_HEADER, SECRET),), worker_pb2_grpc.TargetWorkerStub).round_port
        reader, writer = await asyncio.open_connection(guarded["target"].rpartition(":")[0], port)
        try:
            frame = encode_frame(kind, hello)
            writer.write(frame[:HEADER.size] if len(hello) > MAX_HELLO_BYTES else frame)
            return await asyncio.wait_for(read_frame(reader), 30)
        finally:
            writer.close()

    answer_kind, payload = asyncio.run(say())
    assert answer_kind == ERROR
    error = error_from_frame(payload)
    assert isinstance(error, refusal), error
    assert ("refused the round channel" if refusal is Unavailable else "coordinator id") in str(error)


class _Garbage:
    def SerializeToString(self):
        return GARBAGE
