"""Deployment switches through real processes: a target started with `--acceptance-method typical` (NOT lossless)
and a coordinator started with `--no-logprobs-while-speculating`; what responses, errors and metrics say."""


import grpc
import pytest

from cluster import Cluster, scrape
from specsplit.client import Client
from specsplit.proto.v1 import common_pb2

PROMPTS = ["def add(a, b):", "hello world", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def switched(tiny_pair):
    c = Cluster()
    model = ["--dtype", "float64", "--metrics-port", "-1", "--num-kv-blocks", "256", "--host", "127.0.0.1", "--port", "0"]
    try:
        c.start({
            "target": ["target", "--model", str(tiny_pair["target"]), *model, "--acceptance-method", "typical",
                       "--posterior-threshold", "0.2", "--posterior-alpha", "0.5"],
            "draft": ["draft", "--model", str(tiny_pair["close"]), *model],
        })
        c.start({"coordinator": ["coordinator", "--target", c.addresses["target"], "--draft", c.addresses["draft"],
                                 "--host", "127.0.0.1", "--port", "0", "-k", "4", "--metrics-port", "0",
                                 "--speculation", "fixed", "--no-logprobs-while-speculating"]})
        yield c
    finally:
        c.stop()


def test_typical_target_labels_its_responses_and_metrics(switched, target_alone):
    with Client(switched.addresses["coordinator"], timeout=60) as client:
        results = [client.generate(p, max_tokens=20, ignore_eos=True) for p in PROMPTS]
        chunks = list(client.generate_stream(PROMPTS[0], max_tokens=10, ignore_eos=True, temperature=0.9, seed=3))
        lossless = client.generate(PROMPTS[0], max_tokens=10, ignore_eos=True, acceptance_method="rejection")
    # Greedy requests are unaffected: still the target's own output.
    assert [r.token_ids for r in results] == [target_alone(p, max_tokens=20, ignore_eos=True).token_ids for p in PROMPTS]
    assert all(r.acceptance_method == "typical" and r.stats.draft_tokens > 0 for r in results)
    assert chunks[-1].speculation.acceptance_method == common_pb2.ACCEPTANCE_METHOD_TYPICAL
    assert lossless.acceptance_method == "rejection"  # a request may always ask to stay lossless
    metrics = scrape(switched.metrics_url("coordinator"))
    typical = (("method", "typical"), ("variant", "default"))
    drafted = sum(r.stats.draft_tokens for r in results) + chunks[-1].speculation.drafted_tokens
    assert metrics[("specsplit_drafted_tokens_total", typical)] == drafted
    assert metrics[("specsplit_drafted_tokens_total", (("method", "rejection"), ("variant", "default")))] == lossless.stats.draft_tokens


def test_a_lossless_target_refuses_typical_requests(cluster):
    """The session cluster's targets run with the defaults: per-request typical acceptance is not allowed there."""
    with Client(cluster.addresses["one_target"], timeout=60) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(PROMPTS[0], max_tokens=5, acceptance_method="typical")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "NOT lossless" in refused.value.details()
        assert client.generate(PROMPTS[0], max_tokens=5).acceptance_method == "rejection"
        assert client.generate(PROMPTS[0], max_tokens=5, logprobs=1).logprobs  # logprobs while speculating: on here
    infos = cluster.wait_kv_free(["target_a", "draft_a", "draft_b"])
    assert all(i.sequences == 0 for i in infos.values())


def test_logprobs_refused_while_speculating_served_without_speculation(switched, target_alone):
    with Client(switched.addresses["coordinator"], timeout=60) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(PROMPTS[1], max_tokens=8, logprobs=2)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no logprobs while speculating" in refused.value.details()
        alone = client.generate(PROMPTS[1], max_tokens=8, ignore_eos=True, logprobs=2, num_speculative_tokens=0)
    expected = target_alone(PROMPTS[1], max_tokens=8, ignore_eos=True, logprobs=2)
    assert alone.stats.draft_tokens == 0 and alone.token_ids == expected.token_ids
    assert [lp.token_id for lp in alone.logprobs] == alone.token_ids
    assert [lp.logprob for lp in alone.logprobs] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-5)
    assert all(len(lp.top) == 2 for lp in alone.logprobs)
