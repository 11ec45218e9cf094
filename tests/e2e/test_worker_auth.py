"""The worker API trusts no one by default, with real processes: a worker given a secret refuses calls without it
(UNAUTHENTICATED, health stays open), `specsplit serve` generates one and passes it through the environment (never
argv), a worker with no credentials listens on loopback only and says so, sequence handles are bound to the
coordinator that created them, and repeated bad secrets are throttled."""

import os
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.client import Client
from specsplit.proto.v1 import worker_pb2, worker_pb2_grpc
from specsplit.services.service_commands import spawn_service

# The contract, spelled out (services/rpc/worker_credentials.py holds the same names).
WORKER_SECRET_ENV = "SPECSPLIT_WORKER_SECRET"
WORKER_SECRET_HEADER = "x-specsplit-worker-secret"
COORDINATOR_ID_HEADER = "x-specsplit-coordinator"

SECRET = "worker-secret-for-tests-0c4e9a7d"


@pytest.fixture(scope="module")
def guarded(tiny_pair, tmp_path_factory):
    env = {**os.environ, WORKER_SECRET_ENV: SECRET}
    model = ["--dtype", "float64", "--metrics-port", "-1", "--num-kv-blocks", "128", "--host", "127.0.0.1", "--port", "0"]
    processes = []
    try:
        target, target_addr = spawn_service(["target", "--model", str(tiny_pair["target"]), *model], env)
        processes.append(target)
        draft, draft_addr = spawn_service(["draft", "--model", str(tiny_pair["close"]), *model], env)
        processes.append(draft)
        coordinator, address = spawn_service(["coordinator", "--target", target_addr, "--draft", draft_addr, "--host",
                                              "127.0.0.1", "--port", "0", "--metrics-port", "-1"], env)
        processes.append(coordinator)
        yield {"coordinator": address, "target": target_addr, "draft": draft_addr, "tiny": tiny_pair}
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
        request = worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(handle="x", cached_len=0, delta=[1], logprobs=5)])
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
        first = list(prefill.results[0].token_ids)
        other = stub.Verify(worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(handle="shared-name", cached_len=3, delta=first, logprobs=5)]),
                            timeout=30, metadata=as_coordinator("mallory"))
        assert other.results[0].status.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert stub.Release(worker_pb2.ReleaseRequest(handles=["shared-name"]), timeout=30, metadata=as_coordinator("mallory")).released == 0
        own = stub.Verify(worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(handle="shared-name", cached_len=3, delta=first)]),
                          timeout=30, metadata=as_coordinator("alice"))
        assert own.results[0].status.code == 0
        assert stub.Release(worker_pb2.ReleaseRequest(handles=["shared-name"]), timeout=30, metadata=as_coordinator("alice")).released == 1


def test_repeated_bad_secrets_are_throttled(guarded):
    draft = guarded["draft"]

    def describe(secret):
        with grpc.insecure_channel(draft) as channel:
            stub = worker_pb2_grpc.DraftWorkerStub(channel)
            return stub.Describe(worker_pb2.DescribeRequest(), timeout=10, metadata=((WORKER_SECRET_HEADER, secret),))

    codes = [_code(lambda: describe(f"guess-{i:04d}-padding-to-16")) for i in range(12)]
    assert codes[:10] == [grpc.StatusCode.UNAUTHENTICATED] * 10
    assert codes[10:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2  # locked out: guesses are not even checked
    assert _code(lambda: describe(SECRET)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    time.sleep(1.2)  # the first lock-out lasts 1 s
    assert describe(SECRET).role == "draft"


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


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


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
        children = _children(serve.pid)
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
