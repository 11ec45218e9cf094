"""The n-gram proposer as a draft service of its own (`specsplit draft --proposer ngram`, no model) between real
processes over loopback gRPC, as an in-coordinator canary beside a model draft (the draft-variants file), and through
`specsplit generate --local` and `specsplit serve`: greedy output identical to the target alone everywhere, and
metrics that tell the proposer kinds apart."""

import json
import subprocess
import sys

import pytest

from cluster import Cluster, scrape
from specsplit.client import Client

# Prompts that repeat themselves, so lookups find matches (a random-weight target repeats itself too).
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "abcabcabcabc", "the cat saw the dog and the cat"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def lookup_cluster(tiny_pair, tmp_path_factory):
    variants = tmp_path_factory.mktemp("variants") / "variants.json"
    c = Cluster()
    model = ["--dtype", "float64", "--num-kv-blocks", "256", "--host", "127.0.0.1", "--port", "0"]
    try:
        c.start({
            "target": ["target", "--model", str(tiny_pair["target"]), *model, "--metrics-port", "-1"],
            "draft_ngram": ["draft", "--proposer", "ngram", "--ngram-max", "3", "--ngram-min", "1", "--host", "127.0.0.1",
                            "--port", "0", "--metrics-port", "0"],
            "draft_model": ["draft", "--model", str(tiny_pair["close"]), *model, "--metrics-port", "-1"],
        })
        a = c.addresses
        variants.write_text(json.dumps({"variants": [
            {"name": "model", "weight": 1, "addresses": [a["draft_model"]]},
            {"name": "lookup", "weight": 1, "proposer": "ngram", "ngram_max": 3},  # in the coordinator itself
        ]}))
        common = ["--target", a["target"], "--host", "127.0.0.1", "--port", "0", "-k", "5", "--speculation", "fixed",
                  "--metrics-port", "0"]
        c.start({
            "ngram": ["coordinator", "--draft", a["draft_ngram"], *common],
            "canary": ["coordinator", "--draft-variants-file", str(variants), *common],
        })
        yield c
    finally:
        c.stop()


def test_ngram_draft_service_is_lossless_over_grpc(lookup_cluster, target_alone):
    info = lookup_cluster.worker_info("draft_ngram")
    assert (info.role, info.proposer, info.vocab_size) == ("draft", "ngram", 0)  # no model: any vocabulary
    with Client(lookup_cluster.addresses["ngram"], timeout=60) as client:
        results = [client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
        sampled = client.generate(PROMPTS[1], max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=5)
        again = client.generate(PROMPTS[1], max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=5)
    assert [r.token_ids for r in results] == [target_alone(p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in PROMPTS]
    drafted = sum(r.stats.draft_tokens for r in results)
    assert drafted > 0 and 0 < sum(r.stats.accepted_tokens for r in results) <= drafted
    assert sampled.token_ids == again.token_ids and sampled.stats.draft_tokens > 0  # a seed reproduces its output
    infos = lookup_cluster.wait_kv_free(["target", "draft_ngram"])
    assert infos["draft_ngram"].sequences == 0 and infos["draft_ngram"].sequences_prefilled >= 5

    coordinator = scrape(lookup_cluster.metrics_url("ngram"))
    assert coordinator[("specsplit_draft_variant_proposer", (("proposer", "ngram"), ("variant", "default")))] == 1
    draft = scrape(lookup_cluster.metrics_url("draft_ngram"))
    assert draft[("specsplit_draft_proposer", (("proposer", "ngram"), ("role", "draft")))] == 1


def test_ngram_canary_beside_a_model_draft(lookup_cluster, target_alone):
    # Each request picks a variant by weight, 1:1 and unseeded: twelve requests all went to one variant once in
    # 2,048 runs. Go on until both have served some; past 200 requests that is a broken split, not chance.
    prompts, results = [], []
    with Client(lookup_cluster.addresses["canary"], timeout=60) as client:
        while len(results) < 12 or len({r.draft_variant for r in results}) < 2:
            if len(results) == 200:
                pytest.fail(f"200 requests, every one to variant {results[0].draft_variant}")
            prompts.append(PROMPTS[len(prompts) % len(PROMPTS)])
            results.append(client.generate(prompts[-1], max_tokens=MAX_TOKENS, ignore_eos=True))
    expected = {p: target_alone(p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in PROMPTS}
    assert [r.token_ids for r in results] == [expected[p] for p in prompts]
    assert {r.draft_variant for r in results} == {"model", "lookup"}
    assert all(r.stats.draft_tokens > 0 for r in results if r.draft_variant == "model")
    metrics = scrape(lookup_cluster.metrics_url("canary"))
    assert metrics[("specsplit_draft_variant_proposer", (("proposer", "ngram"), ("variant", "lookup")))] == 1
    assert metrics[("specsplit_draft_variant_proposer", (("proposer", "model"), ("variant", "model")))] == 1
    for variant in ("model", "lookup"):  # per-variant acceptance counts, what a canary is judged by
        drafted = sum(r.stats.draft_tokens for r in results if r.draft_variant == variant)
        assert metrics[("specsplit_drafted_tokens_total", (("method", "rejection"), ("variant", variant)))] == drafted


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specsplit", *argv], capture_output=True, text=True, timeout=180)


def test_generate_local_and_serve_with_the_ngram_proposer(tiny_pair, target_alone):
    common = ["--prompt", PROMPTS[0], "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--dtype", "float64", "--json",
              "--num-kv-blocks", "128"]
    local = run_cli("generate", "--local", "--target", str(tiny_pair["target"]), "--proposer", "ngram",
                    "--ngram-max", "3", *common)
    assert local.returncode == 0, local.stderr
    served = run_cli("serve", "--target", str(tiny_pair["target"]), "--proposer", "ngram", "--port", "0",
                     "--metrics-port", "-1", *common)
    assert served.returncode == 0, served.stderr
    expected = target_alone(PROMPTS[0], max_tokens=MAX_TOKENS, ignore_eos=True).token_ids
    for output in (local, served):
        result = json.loads(output.stdout.strip().splitlines()[-1])
        assert result["token_ids"] == expected and result["stats"]["draft_tokens"] > 0


def test_bad_proposer_flags_are_refused_before_anything_starts(tiny_pair, capsys):
    from specsplit.cli import main

    # A draft model and the n-gram proposer are two different things: asking for both is refused.
    with pytest.raises(SystemExit, match="--proposer ngram uses no draft model"):
        main(["generate", "--local", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["close"]),
              "--proposer", "ngram", "--prompt", "x"])
    with pytest.raises(SystemExit, match="--proposer ngram uses no draft model"):
        main(["serve", "--draft", str(tiny_pair["close"]), "--proposer", "ngram"])
    with pytest.raises(SystemExit, match="n-gram sizes"):
        main(["draft", "--proposer", "ngram", "--ngram-max", "1", "--ngram-min", "2", "--port", "0"])
    with pytest.raises(SystemExit, match="uses no model"):
        main(["draft", "--proposer", "ngram", "--model", str(tiny_pair["close"]), "--port", "0"])
    with pytest.raises(SystemExit, match="needs --model"):
        main(["draft", "--port", "0"])
