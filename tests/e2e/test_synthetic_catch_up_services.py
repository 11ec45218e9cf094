"""The synthetic-acceptance benchmark mode (NOT lossless) across real processes, with overlapped rounds: the target
reports its alpha in Describe, and the coordinator flips the coin for a catch-up's guess of a token decoded alone.
With an unrelated draft, whose guesses are (almost) never the target's token for real, only that coin makes the
proposals drawn while catching up usable: so a large share of rounds verifying proposals made ahead shows the rate
travelled from the target's flag through Describe to the coordinator's rounds."""

import asyncio

import pytest

from specsplit.services.coordinator.grpc_clients import GrpcTargetClient
from cluster import Cluster, generate_concurrently

ALPHA = 0.9


@pytest.fixture(scope="module")
def synthetic(tiny_pair):
    c = Cluster()
    model = ["--dtype", "float64", "--metrics-port", "-1", "--num-kv-blocks", "128", "--host", "127.0.0.1", "--port", "0"]
    try:
        c.start({
            "target": ["target", "--model", str(tiny_pair["target"]), *model, "--synthetic-acceptance", str(ALPHA)],
            "plain": ["target", "--model", str(tiny_pair["target"]), *model],
            "draft": ["draft", "--model", str(tiny_pair["unrelated"]), *model],
        })
        a = c.addresses
        c.start({"on": ["coordinator", "--target", a["target"], "--draft", a["draft"], "--host", "127.0.0.1",
                        "--port", "0", "-k", "4", "--speculation", "fixed", "--metrics-port", "-1", "--overlap", "on"]})
        yield c
    finally:
        c.stop()


def test_the_target_reports_its_synthetic_rate_and_only_then(synthetic):
    async def rate(address):
        client = GrpcTargetClient(address)
        await client.connect(timeout=30)
        try:
            return client.synthetic_acceptance
        finally:
            await client.close()

    assert asyncio.run(rate(synthetic.addresses["target"])) == pytest.approx(ALPHA)
    assert asyncio.run(rate(synthetic.addresses["plain"])) is None  # serving: unset


def test_catch_up_guesses_come_true_at_the_reported_rate(synthetic):
    results = generate_concurrently(synthetic.addresses["on"], ["def add(a, b):", "hello world"], 48)
    rounds = sum(r.stats.rounds for r in results)
    share = sum(r.stats.pre_proposed_rounds for r in results) / rounds
    assert 0.5 < share < 0.9, share  # about g / (g + 1 - a^k g) = 0.69 at alpha 0.9, k = 4
