"""Adaptive speculation (the coordinator's default) over real processes: with a draft that never agrees with the
target, the policy turns speculation off after measuring it (probing now and then), output stays the target's,
the chosen k is on /metrics, and no KV is left behind."""

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster import Cluster
from specsplit.client import Client


@pytest.fixture(scope="module")
def unrelated_cluster(tiny_pair):
    c = Cluster()
    model = ["--dtype", "float64", "--metrics-port", "-1", "--num-kv-blocks", "512", "--host", "127.0.0.1",
             "--port", "0"]
    try:
        c.start({"target": ["target", "--model", str(tiny_pair["target"]), *model],
                 "draft": ["draft", "--model", str(tiny_pair["unrelated"]), *model]})
        c.start({"coordinator": ["coordinator", "--target", c.addresses["target"], "--draft", c.addresses["draft"],
                                 "--host", "127.0.0.1", "--port", "0", "-k", "4", "--metrics-port", "0"]})
        yield c
    finally:
        c.stop()


def test_an_unrelated_draft_is_switched_off_and_output_is_exact(unrelated_cluster):
    c = unrelated_cluster
    prompts = [[3 + i, 17, 42, 99 - i] for i in range(6)]
    with Client(c.addresses["coordinator"], timeout=60) as client:
        want = [client.generate(p, max_tokens=48, ignore_eos=True, num_speculative_tokens=0).token_ids for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            for _ in range(3):  # the policy explores at first, then settles
                got = list(pool.map(lambda p: client.generate(p, max_tokens=48, ignore_eos=True), prompts))
                assert [r.token_ids for r in got] == want
    # The last pass proposed less than one token per round on average: mostly plain decoding.
    assert sum(r.stats.draft_tokens for r in got) < sum(r.stats.rounds for r in got)
    with urllib.request.urlopen(c.metrics_url("coordinator") + "/metrics", timeout=10) as response:
        text = response.read().decode()
    zero = float(re.search(r'specsplit_speculation_length_bucket\{le="0\.0"\} (\S+)', text).group(1))
    total = float(re.search(r"specsplit_speculation_length_count (\S+)", text).group(1))
    assert 0 < zero < total  # some rounds plain, some speculating (the first measurements and the probes)
    infos = c.wait_kv_free(["target", "draft"])
    assert all(i.kv_blocks_used == 0 for i in infos.values())
