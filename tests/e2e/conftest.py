import pytest

from cluster import Cluster
from other_host import connected_host


@pytest.fixture(scope="session")
def cluster(tiny_pair):
    """Two targets, two drafts (float64 tiny models) and two coordinators, each its own process:
    `one_target` routes to draft_a and draft_b over target_a; `two_targets` routes to target_a and target_b with
    draft_a."""
    c = Cluster()
    model = ["--dtype", "float64", "--metrics-port", "-1", "--num-kv-blocks", "512"]
    try:
        c.start({
            "target_a": ["target", "--model", str(tiny_pair["target"]), "--host", "127.0.0.1", "--port", "0", *model],
            "target_b": ["target", "--model", str(tiny_pair["target"]), "--host", "127.0.0.1", "--port", "0", *model],
            "draft_a": ["draft", "--model", str(tiny_pair["close"]), "--host", "127.0.0.1", "--port", "0", *model],
            "draft_b": ["draft", "--model", str(tiny_pair["close"]), "--host", "127.0.0.1", "--port", "0", *model],
        })
        a = c.addresses
        c.start({
            "one_target": ["coordinator", "--target", a["target_a"], "--draft", f"{a['draft_a']},{a['draft_b']}", "--host", "127.0.0.1", "--port", "0", "-k", "4", "--speculation", "fixed", "--metrics-port", "-1"],
            "two_targets": ["coordinator", "--target", f"{a['target_a']},{a['target_b']}", "--draft", a["draft_a"], "--host", "127.0.0.1", "--port", "0", "-k", "4", "--speculation", "fixed", "--metrics-port", "-1"],
        })
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def target_alone(tiny_pair):
    """The float64 tiny target alone, in process: target_alone(prompt, **sampling params) -> its GenerationResult,
    the reference the services' output is compared with."""
    import asyncio

    from specsplit.services.local_engine import LocalEngine
    from specsplit.services.sampling_params import SamplingParams

    engine = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype="float64")

    def run(prompt, **params):
        async def main():
            result = await engine.generate(prompt, SamplingParams(**params))
            await engine.coordinator.wait_idle()
            return result

        return asyncio.run(main())

    return run


@pytest.fixture(scope="session")
def other_host():
    """Another host on a link with this one (other_host.py): `.address` is this machine's non-loopback address,
    `.reach(port, path)` what a client there gets; skips, saying why, where there can be none."""
    with connected_host() as host:
        yield host
