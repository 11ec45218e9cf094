"""A short prompt's draft prefill as a catch-up-only step program (what the GPU replays as one graph) leaves the
draft exactly where an eager prefill does: same KV length, same proposals, and the target's output unchanged.
On the CPU the step program runs eagerly; the switch is forced here to test the path itself."""

import asyncio

import pytest

from specsplit.services.draft import proposer as proposer_module
from specsplit.services.draft.proposer import DraftPrefill, DraftProposer, ProposeItem
from specsplit.services.local_engine import LocalEngine
from specsplit.services.models.loader import load_model
from specsplit.services.runtime.model_runner import ModelRunner
from specsplit.services.runtime.worker_sequences import WorkerSampling
from specsplit.services.sampling_params import SamplingParams
from tiny_models import byte_tokenizer

GREEDY = WorkerSampling(0.0, 0, 1.0, 0)


def proposals_after_prefill(model, prompts, monkeypatch, as_catch_up: bool):
    monkeypatch.setattr(proposer_module, "prefill_as_catch_up", lambda runner: as_catch_up)
    proposer = DraftProposer(ModelRunner(model, num_blocks=64, prefix_caching=True))
    cached = proposer.prefill([DraftPrefill(f"s{i}", p[:-1], GREEDY) for i, p in enumerate(prompts)])
    proposals = proposer.propose([ProposeItem(f"s{i}", c, p[-1:], 4) for i, (p, c) in enumerate(zip(prompts, cached))])
    return cached, [p.token_ids for p in proposals], proposer.runner.block_manager.num_used_blocks


def test_catch_up_prefill_matches_the_eager_one(tiny_pair, monkeypatch):
    model = load_model(tiny_pair["close"], "float32", "cpu")
    tok = byte_tokenizer()
    # 1-2 tokens stay eager; 3 to 64 go in as a catch-up; longer stays eager; the last repeats the first (prefix hit).
    prompts = [tok.encode(t) for t in ("ab", "def f(x):", "x" * 40, "y = 1\n" * 20, "def f(x): return x")]
    eager = proposals_after_prefill(model, prompts, monkeypatch, False)
    caught_up = proposals_after_prefill(model, prompts, monkeypatch, True)
    assert caught_up == eager


def test_engine_output_is_unchanged(tiny_pair, monkeypatch):
    monkeypatch.setattr(proposer_module, "prefill_as_catch_up", lambda runner: True)
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, speculation="fixed")
    reference = LocalEngine(tiny_pair["target"], None)
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    async def main(e):
        return [r.token_ids for r in await asyncio.gather(*(e.generate(p, params) for p in ("def f(x):", "hello world")))]

    assert asyncio.run(main(engine)) == asyncio.run(main(reference))
    assert engine.kv_blocks_used()["draft"] == 0
