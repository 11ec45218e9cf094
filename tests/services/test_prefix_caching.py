"""Prefix caching in the engine: prompts that start alike reuse KV on both workers and change no output."""

import pytest

from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from test_engine_behaviour import run

SHARED = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    "  # 66 tokens: four full blocks
PROMPTS = [SHARED + "if n < 2:", SHARED + "a, b = 0, 1", SHARED + "if n < 2:", "unrelated prompt"]
PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True),
          SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=5),
          SamplingParams(max_tokens=24, ignore_eos=True),
          SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=9)]


@pytest.fixture(scope="module")
def reference(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=3, dtype="float64",
                         prefix_caching=False)
    return [r.token_ids for r in (run(engine, [p], [params])[0] for p, params in zip(PROMPTS, PARAMS))]


def hits(engine) -> dict[str, int]:
    return {"target": engine.target_runner.block_manager.prefix_cache.hit_tokens,
            "draft": engine.draft_runner.block_manager.prefix_cache.hit_tokens}


def test_prompts_after_the_first_reuse_its_blocks_and_outputs_do_not_change(tiny_pair, reference):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=3, dtype="float64")
    outputs = []
    for prompt, params in zip(PROMPTS, PARAMS):  # one at a time: each finds the blocks of those before it
        outputs.append(run(engine, [prompt], [params])[0].token_ids)
        assert engine.kv_blocks_used() == {"target": 0, "draft": 0}  # cached blocks are free to take back
    assert outputs == reference
    # Prompts 2 and 3 each find the shared part's four blocks on both workers; prompt 3 (75 tokens, the last one
    # always runs) has no fifth full block to find.
    assert hits(engine) == {"target": 2 * 64, "draft": 2 * 64}


def test_concurrent_requests_share_cached_blocks(tiny_pair, reference):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=3, dtype="float64")
    run(engine, PROMPTS[:1], PARAMS[:1])
    results = run(engine, PROMPTS, PARAMS)  # all at once, three of them on the same cached blocks
    assert [r.token_ids for r in results] == reference
    assert hits(engine)["target"] == 3 * 64
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_a_small_cache_evicts_instead_of_refusing(tiny_pair, reference):
    # 7 blocks of 16 tokens: one request at a time fits (~102 tokens at most), the cached blocks of earlier prompts
    # must make way.
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=3, dtype="float64",
                         num_kv_blocks=7)
    outputs = [run(engine, [p], [params])[0].token_ids for p, params in zip(PROMPTS * 2, PARAMS * 2)]
    assert outputs == reference * 2
    assert engine.target_runner.block_manager.prefix_cache.evicted_blocks > 0
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}
