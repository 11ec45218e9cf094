"""`--no-logprobs-while-speculating`: logprob requests are refused while they would speculate, and served by the
target alone when they turn speculation off; other requests are untouched."""

import asyncio

import pytest

from specsplit.services.coordinator.coordinator import CoordinatorConfig
from specsplit.services.errors import InvalidArgument
from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8]


def generate(engine, **params):
    async def main():
        result = await engine.coordinator.generate(engine.request(PROMPT, SamplingParams(**params)))
        await engine.coordinator.wait_idle()
        return result

    return asyncio.run(main())


def test_switch_refuses_speculative_logprobs_and_keeps_the_rest(tiny_pair):
    off = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64",
                      coordinator_config=CoordinatorConfig(logprobs_while_speculating=False))
    on = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64")
    with pytest.raises(InvalidArgument, match="no logprobs while speculating.*num_speculative_tokens 0"):
        generate(off, max_tokens=12, logprobs=3)
    assert off.kv_blocks_used() == {"target": 0, "draft": 0}  # refused at admission: nothing was prefilled

    speculative = generate(on, max_tokens=12, ignore_eos=True, logprobs=3)
    target_only = generate(off, max_tokens=12, ignore_eos=True, logprobs=3, num_speculative_tokens=0)
    plain = generate(off, max_tokens=12, ignore_eos=True)
    assert speculative.stats.draft_tokens > 0 and target_only.stats.draft_tokens == 0 and plain.stats.draft_tokens > 0
    # Greedy is lossless, so all three emit the same tokens, and the logprobs are the target's either way.
    assert target_only.token_ids == speculative.token_ids == plain.token_ids
    assert [lp.logprob for lp in target_only.logprobs] == pytest.approx([lp.logprob for lp in speculative.logprobs])
    assert [[t for t, _ in lp.top] for lp in target_only.logprobs] == [[t for t, _ in lp.top] for lp in speculative.logprobs]
    assert plain.logprobs is None


def test_a_deployment_without_a_draft_serves_logprobs(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype="float64",
                         coordinator_config=CoordinatorConfig(logprobs_while_speculating=False))
    assert len(generate(engine, max_tokens=4, ignore_eos=True, logprobs=0).logprobs) == 4
