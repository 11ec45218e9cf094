"""The co-located mode with real processes: a target that runs the coordinator in its own process
(`specsplit target --coordinate`) beside a draft of its own: greedy output is the target alone's, a seed gives the
same sample as through a separate coordinator over the same workers (the target still serves others), the
coordinator's metrics are its own, and a draft that dies leaves the requests decoding target-only. Each round path
has its greedy-identity check: co-located serial and overlapped (a second co-located target, `--overlap on`), and
the separate coordinator over the gRPC stream transport instead of the round channel."""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from specsplit.client import Client
from specsplit.services.service_commands import address_after

from cluster import Cluster, scrape

PROMPTS = ["def add(a, b):", "hello world", "import os\nimport sys\n", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def colocated(tiny_pair):
    c = Cluster()
    model = ["--dtype", "float64", "--num-kv-blocks", "512", "--host", "127.0.0.1", "--port", "0"]
    try:
        c.start({"draft": ["draft", "--model", str(tiny_pair["close"]), "--metrics-port", "-1", *model]})
        c.start({"target": ["target", "--model", str(tiny_pair["target"]), "--metrics-port", "-1", *model,
                            "--coordinate", "--draft", c.addresses["draft"], "--coordinator-port", "0",
                            "--coordinator-metrics-port", "0", "--http-port", "-1", "-k", "4", "--speculation", "fixed",
                            "--overlap", "off"]})
        c.addresses["coordinator"] = address_after(c.processes["target"], "coordinator")
        metrics = [line for line in c.processes["target"].startup_lines if "metrics" in line]
        c.coordinator_metrics = next((re.search(r"http://\S+(?=/metrics)", line).group(0) for line in metrics
                                      if "coordinator" in line), None)
        # A separate coordinator over the same target and draft: the co-located target still serves others (its
        # rounds over the gRPC stream, the transport every other test leaves aside); and a second co-located target
        # whose coordinator overlaps rounds (proposes the next while this one is verified) with the same draft.
        c.start({"separate": ["coordinator", "--target", c.addresses["target"], "--draft", c.addresses["draft"],
                              "--host", "127.0.0.1", "--port", "0", "-k", "4", "--speculation", "fixed",
                              "--metrics-port", "-1", "--http-port", "-1", "--worker-transport", "stream"],
                 "overlapped": ["target", "--model", str(tiny_pair["target"]), "--metrics-port", "-1", *model,
                                "--coordinate", "--draft", c.addresses["draft"], "--coordinator-port", "0",
                                "--coordinator-metrics-port", "-1", "--http-port", "-1", "-k", "4",
                                "--speculation", "fixed", "--overlap", "on"]})
        c.addresses["overlapped_coordinator"] = address_after(c.processes["overlapped"], "coordinator")
        yield c
    finally:
        c.stop()


def _greedy_batch(address: str) -> list:
    with Client(address, timeout=120) as client:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch of rounds
            return list(pool.map(lambda p: client.generate(p, max_tokens=24, ignore_eos=True, temperature=0.0),
                                 PROMPTS))


@pytest.mark.parametrize("coordinator", ["coordinator", "overlapped_coordinator", "separate"],
                         ids=["colocated", "colocated-overlapped", "separate-grpc-stream"])
def test_greedy_output_is_the_target_alones(colocated, target_alone, coordinator):
    results = _greedy_batch(colocated.addresses[coordinator])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == target_alone(prompt, max_tokens=24, ignore_eos=True, temperature=0.0).token_ids
    assert sum(r.stats.draft_tokens for r in results) > 0  # the draft proposed: the hop to it was used
    pre_proposed = sum(r.stats.pre_proposed_rounds for r in results)
    assert pre_proposed > 0 if coordinator == "overlapped_coordinator" else pre_proposed == 0


def test_a_seed_gives_the_same_sample_as_through_a_separate_coordinator(colocated):
    def sample(address):
        with Client(address, timeout=120) as client:
            return client.generate("def fib(n):", max_tokens=20, ignore_eos=True, temperature=0.9, seed=5).token_ids

    assert sample(colocated.addresses["coordinator"]) == sample(colocated.addresses["separate"])


def test_the_coordinator_serves_its_own_metrics_beside_the_targets(colocated):
    """Two metrics pages in one process: the coordinator's (rounds, proposals) and the target worker's (steps)."""
    assert colocated.coordinator_metrics is not None, "the co-located coordinator prints where its metrics are"
    with Client(colocated.addresses["coordinator"], timeout=120) as client:
        client.generate("metrics", max_tokens=12, ignore_eos=True, temperature=0.0)
    samples = scrape(colocated.coordinator_metrics)
    stage_calls = {labels: v for (name, labels), v in samples.items() if name == "specsplit_stage_latency_seconds_count"}
    assert stage_calls[(("stage", "propose"),)] > 0 and stage_calls[(("stage", "verify"),)] > 0
    assert colocated.worker_info("draft").round_port > 0  # the draft's round channel, which the proposals took


def test_a_lost_draft_leaves_the_requests_decoding_target_only(colocated, target_alone):
    with Client(colocated.addresses["coordinator"], timeout=120) as client:
        before = client.generate("still here", max_tokens=8, ignore_eos=True, temperature=0.0)
        assert before.stats.draft_tokens > 0
        colocated.processes["draft"].kill()
        colocated.processes["draft"].wait(timeout=20)
        after = client.generate("still here", max_tokens=16, ignore_eos=True, temperature=0.0)
    assert after.token_ids == target_alone("still here", max_tokens=16, ignore_eos=True, temperature=0.0).token_ids
