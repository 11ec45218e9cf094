"""Decoding ahead through the services (target --decode-ahead on, forced on the CPU: its auto is on only on a GPU),
real processes over loopback: target-only requests give the target alone's tokens, greedy and seeded, with the
next steps answered ahead (the target's /metrics counts them), and a cancelled stream frees the KV its step ahead
took."""

import time

import grpc
import pytest

from specsplit.client import Client
from specsplit.proto.v1 import generation_pb2_grpc
from specsplit.services.coordinator import public_messages
from specsplit.services.sampling_params import SamplingParams

from cluster import Cluster, generate_concurrently
from metrics_page import scrape

PROMPTS = ["def add(a, b):", "hello world", "import os\nimport sys\n", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def services(tiny_pair):
    c = Cluster()
    model = ["--dtype", "float64", "--num-kv-blocks", "256"]
    try:
        c.start({"target": ["target", "--model", str(tiny_pair["target"]), "--host", "127.0.0.1", "--port", "0",
                            "--metrics-port", "0", "--decode-ahead", "on", *model]})
        c.start({"coordinator": ["coordinator", "--target", c.addresses["target"], "--host", "127.0.0.1",
                                 "--port", "0", "--metrics-port", "-1", "-k", "0"]})
        yield c
    finally:
        c.stop()


def _rows(c) -> dict:
    page = scrape(c.metrics_url("target"))
    return {outcome: page[("specsplit_decode_ahead_rows_total", (("outcome", outcome), ("role", "target")))]
            for outcome in ("launched", "taken", "missed")}


def test_target_only_through_the_services_equals_the_target_alone(services, target_alone):
    before = _rows(services)
    got = generate_concurrently(services.addresses["coordinator"], PROMPTS, max_tokens=20)
    assert [r.token_ids for r in got] == [target_alone(p, max_tokens=20, ignore_eos=True).token_ids for p in PROMPTS]
    params = dict(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    with Client(services.addresses["coordinator"], timeout=60) as client:
        for prompt in PROMPTS[:2]:
            assert client.generate(prompt, **params).token_ids == target_alone(prompt, **params).token_ids
    after = _rows(services)
    assert after["taken"] - before["taken"] >= 2 * 14  # the seeded requests alone: rounds 2..15 of each
    assert after["launched"] - before["launched"] == after["taken"] - before["taken"]  # none wasted at the ends


def test_a_cancelled_stream_frees_the_kv_of_its_step_ahead(services):
    with grpc.insecure_channel(services.addresses["coordinator"]) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = public_messages.request_pb("def add(a, b):", SamplingParams(max_tokens=200, ignore_eos=True))
        stream = stub.GenerateStream(request, timeout=60)
        for received, _ in enumerate(stream):
            if received == 5:
                break
        stream.cancel()
    deadline = time.monotonic() + 15
    while (info := services.worker_info("target")).kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.1)
    assert info.kv_blocks_used == 0 and info.sequences == 0
    with Client(services.addresses["coordinator"], timeout=60) as client:  # and the target serves on
        assert len(client.generate("x", max_tokens=5, ignore_eos=True).token_ids) == 5
