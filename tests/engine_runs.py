"""Runs the engine and runner tests share: tiny-model prompts through an in-process engine, and one prompt's logits
through a model runner."""

import asyncio

from specsplit.services.kv.block_manager import BlockTable
from specsplit.services.runtime.model_runner import ForwardItem
from specsplit.services.sampling_params import SamplingParams
from tiny_models import byte_tokenizer


def generate_tokens(engine, prompts: list[str], k: int, max_tokens: int, temperature: float = 0.0,
                    seeds: list[int] | None = None) -> list[list[int]]:
    """Every prompt as a concurrent request (byte tokenizer, EOS ignored); each request's seed from `seeds`."""
    tok = byte_tokenizer()

    async def main():
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k,
                                 temperature=temperature, seed=seeds[i] if seeds else None)
                  for i in range(len(prompts))]
        results = await asyncio.gather(*(engine.generate(tok.encode(p), sp) for p, sp in zip(prompts, params)))
        await engine.coordinator.wait_idle()
        return [r.token_ids for r in results]

    return asyncio.run(main())


def run_prompt(runner, tokens: list[int]):
    """All logits of a prompt; its KV is freed again."""
    table = BlockTable()
    runner.reserve_tokens(table, len(tokens))
    try:
        return runner.forward([ForwardItem(table, tokens, len(tokens))])[0]
    finally:
        runner.release(table)
