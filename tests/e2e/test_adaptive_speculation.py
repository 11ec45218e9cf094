"""Adaptive speculation (the coordinator's default) over real processes, with a draft that never agrees with the
target: the policy turns speculation off after measuring it (probing now and then), output stays the target's, the
draft is no longer even prefilled for new requests, a request's num_speculative_tokens (gRPC and the OpenAI API)
is the most it proposes, not a fixed k, unless the request asks for fixed mode; the chosen k is on /metrics; no KV is
left behind. Events are counted (proposals, draft prefills), not timed."""

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from cluster import Cluster
from specsplit.client import Client

PROMPTS = [[3 + i, 17, 42, 99 - i] for i in range(6)]


@pytest.fixture(scope="module")
def unrelated_cluster(tiny_pair):
    c = Cluster()
    model = ["--dtype", "float64", "--metrics-port", "0", "--num-kv-blocks", "512", "--host", "127.0.0.1",
             "--port", "0"]
    try:
        c.start({"target": ["target", "--model", str(tiny_pair["target"]), *model],
                 "draft": ["draft", "--model", str(tiny_pair["unrelated"]), *model]})
        c.start({"coordinator": ["coordinator", "--target", c.addresses["target"], "--draft", c.addresses["draft"],
                                 "--host", "127.0.0.1", "--port", "0", "-k", "4", "--metrics-port", "0",
                                 "--http-port", "0",
                                 # Serial rounds: `auto` overlaps where the measured costs say it pays, and an
                                 # overlapped round lets a sequence decode alone while its draft catches up, so a
                                 # fixed k's proposals a round would follow this machine's timings.
                                 "--overlap", "off"]})
        yield c
    finally:
        c.stop()


def metric(c: Cluster, name: str, pattern: str) -> float:
    with urllib.request.urlopen(c.metrics_url(name) + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return float(re.search(pattern, text).group(1))


def draft_prefills(c: Cluster) -> float:
    return metric(c, "draft", r'specsplit_stage_latency_seconds_count\{stage="prefill"\} (\S+)')


def test_an_unrelated_draft_is_switched_off_and_no_longer_prefilled(unrelated_cluster):
    c = unrelated_cluster
    with Client(c.addresses["coordinator"], timeout=60) as client:
        want = [client.generate(p, max_tokens=48, ignore_eos=True, num_speculative_tokens=0).token_ids for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            for _ in range(2):  # the policy explores at first, then settles
                got = list(pool.map(lambda p: client.generate(p, max_tokens=48, ignore_eos=True), PROMPTS))
                assert [r.token_ids for r in got] == want
            prefills = draft_prefills(c)
            got = list(pool.map(lambda p: client.generate(p, max_tokens=48, ignore_eos=True), PROMPTS))
            assert [r.token_ids for r in got] == want
    # The last pass: no draft KV built for its requests but to probe (one sequence now and then), and proposals
    # only in probes: far less than one per round.
    assert draft_prefills(c) - prefills <= 1
    assert sum(r.stats.draft_tokens for r in got) <= 2 and sum(r.stats.rounds for r in got) >= 6 * 47
    zero = metric(c, "coordinator", r'specsplit_speculation_length_bucket\{le="0\.0"\} (\S+)')
    total = metric(c, "coordinator", r"specsplit_speculation_length_count (\S+)")
    assert 0 < zero < total  # some rounds plain, some speculating (the first measurements and the probes)


def test_a_requests_k_is_the_most_it_proposes_unless_it_asks_for_fixed(unrelated_cluster):
    """gRPC (SPECULATION_MODE_CUSTOM / _FIXED) and the OpenAI API (num_speculative_tokens, speculation)."""
    c = unrelated_cluster
    with Client(c.addresses["coordinator"], timeout=60) as client:
        bounded = client.generate(PROMPTS[0], max_tokens=24, ignore_eos=True, num_speculative_tokens=4)
        fixed = client.generate(PROMPTS[0], max_tokens=24, ignore_eos=True, num_speculative_tokens=3,
                                speculation="fixed")
    assert bounded.token_ids == fixed.token_ids
    assert bounded.stats.draft_tokens <= 1  # the policy knows this draft by now
    assert fixed.stats.draft_tokens >= 3 * (fixed.stats.rounds - 3)  # 3 a round, less only in its last rounds
    http = openai.OpenAI(base_url=c.http_url("coordinator"), api_key="unused", max_retries=0, timeout=60)
    model = http.models.list().data[0].id

    def drafted(**extension):
        got = http.completions.create(model=model, prompt="def f(x):", max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True, **extension})
        return got.model_extra["specsplit"]["speculation"]

    assert drafted(num_speculative_tokens=4)["drafted_tokens"] <= 1
    fixed_http = drafted(num_speculative_tokens=2, speculation="fixed")
    assert fixed_http["drafted_tokens"] >= 2 * (fixed_http["rounds"] - 3)
    with pytest.raises(openai.BadRequestError, match="speculation"):
        drafted(speculation="sometimes")
    infos = c.wait_kv_free(["target", "draft"])
    assert all(i.kv_blocks_used == 0 for i in infos.values())
