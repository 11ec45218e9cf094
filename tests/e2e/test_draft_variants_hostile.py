"""A live draft-variants file with absurd weights, with real processes: Infinity or 1e308 used to make every request
UNAVAILABLE and NaN was silently taken; now each such file is refused with one log line saying why, and the
coordinator keeps serving with the last good variants."""

import json
import os
import time

import grpc
import pytest

from specsplit.proto.v1 import generation_pb2, generation_pb2_grpc
from specsplit.services.service_commands import spawn_service

BAD_WEIGHTS = ["Infinity", "1e308", "NaN", "-1", "-Infinity", "1e7"]
REFUSED = "refused, keeping the last good variants"


@pytest.fixture(scope="module")
def variants(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    path, log_path = root / "variants.json", root / "coordinator.log"
    a = cluster.addresses
    write(path, f'{{"variants": [{{"name": "stable", "weight": 3, "addresses": ["{a["draft_a"]}"]}},'
                f' {{"name": "canary", "weight": 1, "addresses": ["{a["draft_b"]}"]}}]}}')
    with open(log_path, "w") as log:
        process, address = spawn_service(
            ["coordinator", "--target", a["target_a"], "--draft-variants-file", str(path), "--host", "127.0.0.1",
             "--port", "0", "-k", "4", "--speculation", "fixed", "--metrics-port", "-1"], stderr=log)
    try:
        yield {"path": path, "log": log_path, "address": address, "drafts": (a["draft_a"], a["draft_b"])}
    finally:
        process.terminate()
        process.wait(timeout=20)


def write(path, text: str) -> None:
    tmp = path.with_suffix(".tmp")  # swapped in, like a ConfigMap update
    tmp.write_text(text)
    os.replace(tmp, path)


def _log_since(path, offset: int) -> str:
    with open(path, "rb") as log:
        log.seek(offset)
        return log.read().decode()


def _weights(stub) -> dict:
    return {v.name: v.weight for v in stub.GetDraftVariantStats(generation_pb2.DraftVariantStatsRequest(), timeout=10).variants}


def _generate_ok(stub, n=6) -> None:
    for i in range(n):
        m = generation_pb2.GenerateRequest(text=f"def f{i}(x):")
        m.stopping.max_tokens = 6
        m.stopping.ignore_eos = True
        result = stub.Generate(m, timeout=60)
        assert len(result.token_ids) == 6 and result.speculation.drafted_tokens > 0


@pytest.mark.parametrize("weight", BAD_WEIGHTS)
def test_absurd_weights_are_refused_and_service_goes_on(variants, weight):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(variants["address"]))
    assert _weights(stub) == {"stable": 3, "canary": 1}
    log_before = variants["log"].stat().st_size  # the log is shared by every case: read only what this one adds
    draft_a, draft_b = variants["drafts"]
    write(variants["path"], f'{{"variants": [{{"name": "stable", "weight": {weight}, "addresses": ["{draft_a}"]}},'
                            f' {{"name": "canary", "weight": 1, "addresses": ["{draft_b}"]}}]}}')
    deadline = time.monotonic() + 15
    while REFUSED not in _log_since(variants["log"], log_before):
        assert time.monotonic() < deadline, "the bad file must be reported"
        time.sleep(0.2)
    _generate_ok(stub)
    assert _weights(stub) == {"stable": 3, "canary": 1}
    added = _log_since(variants["log"], log_before)
    assert "Traceback" not in added
    (refusal,) = [line for line in added.splitlines() if REFUSED in line]  # one line, saying why
    assert refusal.endswith(f"variant 'stable': weight must be a finite number in [0, 1e+06], got {json.loads(weight)!r}")


def test_a_good_file_after_bad_ones_applies(variants):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(variants["address"]))
    draft_a, draft_b = variants["drafts"]
    write(variants["path"], json.dumps({"variants": [{"name": "stable", "weight": 1, "addresses": [draft_a]},
                                                     {"name": "canary", "weight": 1, "addresses": [draft_b]}]}))
    deadline = time.monotonic() + 15
    while _weights(stub) != {"stable": 1, "canary": 1}:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    _generate_ok(stub)
