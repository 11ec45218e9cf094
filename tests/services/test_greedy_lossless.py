"""Greedy speculative decoding is token-for-token identical to the target alone and to transformers' generate."""

import asyncio

import pytest
import torch

from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from tiny_models import build_model, byte_tokenizer, save_model

PROMPTS = [
    "def add(a, b):",
    "x",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import torch\nclass Model(torch.nn.Module):\n    def __init__(self):",
    "1, 2, 3, 5, 8, 13,",
    "Once upon a time",
]
MAX_TOKENS = 24


def hf_greedy(model, ids, max_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


async def run_batch(engine, prompts_ids, k):
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, num_speculative_tokens=k) for _ in prompts_ids]
    results = await asyncio.gather(*(engine.coordinator.generate(engine.request(ids, p)) for ids, p in zip(prompts_ids, params)))
    await engine.coordinator.wait_idle()
    return results


@pytest.fixture(scope="module")
def reference(tiny_pair):
    tok = byte_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    return ids, [hf_greedy(tiny_pair["hf_target"], i, MAX_TOKENS) for i in ids]


@pytest.mark.parametrize("draft_kind", ["target", "close", "unrelated"])
def test_greedy_matches_target_alone_and_transformers(tiny_pair, reference, draft_kind):
    ids, expected = reference
    engine = LocalEngine(tiny_pair["target"], tiny_pair[draft_kind], num_speculative_tokens=8, dtype="float64",
                         speculation="fixed")

    async def main():
        target_only = await run_batch(engine, ids, 0)
        outputs = {k: await run_batch(engine, ids, k) for k in (1, 2, 4, 8)}
        return target_only, outputs

    target_only, outputs = asyncio.run(main())
    assert [r.token_ids for r in target_only] == expected
    for k, results in outputs.items():
        assert [r.token_ids for r in results] == expected, f"k={k}"
    rates = [r.stats.acceptance_rate for results in outputs.values() for r in results]
    mean_rate = sum(rates) / len(rates)
    if draft_kind == "target":
        assert mean_rate == 1.0  # a draft identical to the target is always accepted
    elif draft_kind == "unrelated":
        assert mean_rate < 0.3
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


@pytest.mark.parametrize("batch_size", [1, 3, 6])
def test_greedy_identical_at_every_batch_size(tiny_pair, reference, batch_size):
    ids, expected = reference
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64")
    results = asyncio.run(run_batch(engine, ids[:batch_size], 4))
    assert [r.token_ids for r in results] == expected[:batch_size]


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        ("llama", {"attention_bias": True, "num_key_value_heads": 1, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("mistral", {"sliding_window": 256, "num_key_value_heads": 4}),
        ("qwen2", {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}),
    ],
)
def test_architectures_match_transformers(tmp_path, arch, overrides):
    target = build_model(arch, seed=3, **overrides).to(torch.float64)
    draft = build_model(arch, seed=4, **overrides).to(torch.float64)
    save_model(target, tmp_path / "t")
    save_model(draft, tmp_path / "d")
    tok = byte_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    expected = [hf_greedy(target, i, MAX_TOKENS) for i in ids]
    engine = LocalEngine(tmp_path / "t", tmp_path / "d", num_speculative_tokens=3, dtype="float64")
    results = asyncio.run(run_batch(engine, ids, 3))
    assert [r.token_ids for r in results] == expected
