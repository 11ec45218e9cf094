"""The batch-invariant mode's engine checks, shared by the CPU test (tests/services/test_batch_invariant_engine.py)
and the GPU test (tests/services/test_gpu_engine.py): every request's tokens must be the ones it gets alone,
target-only, whatever runs beside it.

A "flat" model pair has small weights, so next-token distributions are close to uniform and greedy decoding meets
near-ties: where a kernel's rounding depends on the batch, some argmax flips (in bf16 on a GPU it does, without the
mode), which is what these checks must catch.
"""

import asyncio

from specsplit.services.sampling_params import SamplingParams
from tiny_models import build_model, byte_tokenizer, perturbed_copy, save_model

PROMPTS = [f"{i} {text}" for i in range(16) for text in
           ("def add(a, b):", "The quick brown fox", "1, 2, 3, 5, 8,", "lorem ipsum dolor")]


def save_flat_pair(root, scale: float = 0.05) -> dict:
    """A flat target, a close draft (its weights plus noise) and an unrelated one, saved as float32 folders."""
    target = build_model("qwen2", seed=0, scale=scale)
    return {"target": save_model(target, root / "target"),
            "close": save_model(perturbed_copy(target, noise=scale / 20), root / "close"),
            "unrelated": save_model(build_model("qwen2", seed=7, scale=scale), root / "unrelated")}


def greedy(max_tokens: int, k: int | None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k)


def run(engine, requests: list[tuple[str, SamplingParams]], late: list[tuple[str, SamplingParams]] = ()) -> list:
    """Token ids of `requests` run at once; `late` ones join when the first request has committed 3 tokens (the
    others are then mid-generation). Results in order, `late` after."""
    tok = byte_tokenizer()

    async def one(prompt, params, started: asyncio.Event | None = None):
        committed, result = 0, None
        async for event in engine.coordinator.stream(engine.request(tok.encode(prompt), params)):
            if hasattr(event, "finish_reason"):
                result = event
            else:
                committed += len(event.token_ids)
                if started is not None and committed >= 3:
                    started.set()
        if started is not None:
            started.set()
        return result.token_ids

    async def main():
        started = asyncio.Event()
        first = [asyncio.create_task(one(p, s, started if i == 0 else None)) for i, (p, s) in enumerate(requests)]
        joined = []
        if late:
            await started.wait()
            joined = [asyncio.create_task(one(p, s)) for p, s in late]
        results = await asyncio.gather(*first, *joined)
        await engine.coordinator.wait_idle()
        return list(results)

    return asyncio.run(main())


def alone(engine, requests: list[tuple[str, SamplingParams]]) -> list:
    return [run(engine, [request])[0] for request in requests]


class DeltaSpy:
    """Records the longest catch-up (committed tokens a propose call carries) the draft was sent."""

    def __init__(self, proposer):
        self.longest = 0
        self.proposer = proposer
        self.propose = proposer.propose

    def __enter__(self):
        def propose(items, *args, **kwargs):
            self.longest = max([self.longest] + [len(item.delta) for item in items])
            return self.propose(items, *args, **kwargs)

        self.proposer.propose = propose
        return self

    def __exit__(self, *exc):
        del self.proposer.propose


def check_greedy(engine, reference: list[list[int]], batches: tuple[int, ...], max_tokens: int) -> dict:
    """Target-only, speculative with k = 4, and with mixed k (1..4 in one batch) at each batch size, and a batch
    that others join mid-generation: every sequence equals `reference` (target-only, alone). Returns what it saw."""
    seen = {"longest_catch_up": 0, "accepted": 0}
    prompts = PROMPTS[: max(batches)]
    with DeltaSpy(engine.proposer) as spy:
        for b in batches:
            for name, ks in (("target-only", [0] * b), ("k=4", [4] * b), ("mixed k", [1 + i % 4 for i in range(b)])):
                got = run(engine, [(p, greedy(max_tokens, k)) for p, k in zip(prompts[:b], ks)])
                mismatched = [i for i in range(b) if got[i] != reference[i]]
                assert not mismatched, f"batch {b}, {name}: sequences {mismatched} differ from target-only alone"
        half = max(batches) // 2
        got = run(engine, [(p, greedy(max_tokens, 4)) for p in prompts[:half]],
                  late=[(p, greedy(max_tokens, 1 + i % 4)) for i, p in enumerate(prompts[half:2 * half])])
        mismatched = [i for i in range(2 * half) if got[i] != reference[i]]
        assert not mismatched, f"joining mid-batch: sequences {mismatched} differ from target-only alone"
        seen["longest_catch_up"] = spy.longest
    return seen


def sampled(i: int, max_tokens: int, k: int) -> SamplingParams:
    """A seeded sampled request; every other one with top-p, every third with top-k."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=100 + i,
                          top_p=0.9 if i % 2 else 1.0, top_k=20 if i % 3 == 0 else 0, num_speculative_tokens=k)


def check_seeded(engine, batch: int, max_tokens: int) -> None:
    """Seeded sampled requests give their tokens alone at any batch: target-only, and speculative (k = 3) beside
    greedy and other sampled requests. (Speculative sampled tokens are distributed as the target's but need not
    be its target-only tokens: rejection sampling draws differently; what the mode makes exact is that a request's
    tokens do not depend on its batch.)"""
    for k in (0, 3):
        requests = [(PROMPTS[i], sampled(i, max_tokens, k) if i % 4 else greedy(max_tokens, k)) for i in range(batch)]
        want = alone(engine, requests[:4])
        got = run(engine, requests)
        assert got[:4] == want, f"k={k}: a seeded request's tokens depend on its batch"


def check_prefix_cache_hit(engine, max_tokens: int) -> None:
    """A prompt whose first blocks come from the prefix cache gets the tokens it got computed from scratch: alone
    target-only before anything of it was cached, then again (its prefill now starting past the cached blocks),
    target-only and speculative, beside other requests."""
    prompt = "A prompt met twice, the second time from the prefix cache: " + "abc " * 8  # 92 bytes, 5 full blocks
    cache = engine.target_runner.block_manager.prefix_cache
    hits = cache.hit_tokens
    cold = run(engine, [(prompt, greedy(max_tokens, 0))])[0]
    assert cache.hit_tokens == hits, "the prompt must not have been cached before"
    for k in (0, 4):
        warm = run(engine, [(prompt, greedy(max_tokens, k))] + [(p, greedy(max_tokens, k)) for p in PROMPTS[:3]])
        assert warm[0] == cold, f"k={k}: a prefix-cache hit changed the prompt's tokens"
    assert cache.hit_tokens - hits >= 2 * 64, "both runs after the first must find its full blocks cached"
