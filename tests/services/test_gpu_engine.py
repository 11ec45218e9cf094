"""The engine on a CUDA GPU (Triton kernels) against the CPU torch path, on tiny models. Skipped without CUDA.

fp32: greedy output must be token-for-token the CPU's. bf16: rounding differs from fp32, so greedy paths may part
at near-ties; the match rate is printed (run with -s) and recorded, not asserted exact.
"""

import asyncio

import pytest
import torch

from specsplit.kernels.dispatch import use_triton
from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from tiny_models import byte_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = ["def add(a, b):", "x", "The quick brown fox jumps over the lazy dog. " * 3, "1, 2, 3, 5, 8, 13,"]
MAX_TOKENS = 32


def generate(engine: LocalEngine, k: int, temperature: float = 0.0) -> list[list[int]]:
    tok = byte_tokenizer()

    async def main():
        params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, num_speculative_tokens=k,
                                 temperature=temperature, seed=i) for i in range(len(PROMPTS))]
        results = await asyncio.gather(*(engine.generate(tok.encode(p), sp) for p, sp in zip(PROMPTS, params)))
        await engine.coordinator.wait_idle()
        return [r.token_ids for r in results]

    return asyncio.run(main())


def match_rate(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of reference tokens reproduced before each output first departs from it."""
    same = 0
    for out, ref in zip(outputs, reference):
        for a, b in zip(out, ref):
            if a != b:
                break
            same += 1
    return same / sum(len(r) for r in reference)


@pytest.fixture(scope="module")
def cpu_reference(tiny_pair):
    # Dense weights: the CPU reference is torch's own layout, as on the GPU.
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float32",
                         target_weights="dense", draft_weights="dense")
    return generate(engine, 0)


def test_triton_path_is_selected_on_cuda():
    assert use_triton(torch.zeros(1, device="cuda"))
    assert not use_triton(torch.zeros(1))


@pytest.mark.parametrize("draft_kind", ["close", "unrelated"])
def test_fp32_greedy_on_gpu_equals_cpu(tiny_pair, cpu_reference, draft_kind):
    engine = LocalEngine(tiny_pair["target"], tiny_pair[draft_kind], num_speculative_tokens=4, dtype="float32",
                         device="cuda")
    assert generate(engine, 0) == cpu_reference  # target-only
    for k in (1, 4):
        assert generate(engine, k) == cpu_reference, f"k={k}"


def test_sampling_on_gpu_is_seeded_and_runs(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float32",
                         device="cuda")
    first, second = generate(engine, 4, temperature=1.0), generate(engine, 4, temperature=1.0)
    assert first == second  # counter-based randomness: same seeds, same tokens
    assert all(len(t) == MAX_TOKENS for t in first)


def test_bf16_greedy_match_rate_is_reported(tiny_pair, cpu_reference, record_property):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="bfloat16",
                         device="cuda")
    target_only, speculative = generate(engine, 0), generate(engine, 4)
    rate_target_only = match_rate(target_only, cpu_reference)
    rate_speculative = match_rate(speculative, cpu_reference)
    self_rate = match_rate(speculative, target_only)
    record_property("bf16_greedy_match_rate_target_only_vs_cpu_fp32", rate_target_only)
    record_property("bf16_greedy_match_rate_speculative_vs_cpu_fp32", rate_speculative)
    record_property("bf16_greedy_match_rate_speculative_vs_bf16_target_only", self_rate)
    print(f"\nbf16 greedy match rate vs CPU fp32: target-only {rate_target_only:.3f}, speculative "
          f"{rate_speculative:.3f}; speculative vs bf16 target-only {self_rate:.3f}")
    assert all(len(t) == MAX_TOKENS for t in target_only + speculative)


def test_cuda_graphs_are_used_and_match_eager(tiny_pair, cpu_reference, monkeypatch):
    """Graphs (the default on CUDA) and eager give the CPU's fp32 greedy tokens, also for a batch that does not fill
    its bucket (3 of 4: one padding row), and leave no KV behind."""
    graphed = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float32", device="cuda")
    assert graphed.target_runner.graphs is not None and graphed.draft_runner.graphs is not None
    for k in (0, 1, 4):
        assert generate(graphed, k) == cpu_reference, f"k={k}"
    assert (1, 4) in graphed.draft_runner.graphs.graphs  # draft steps of 4 sequences
    assert (5, 4) in graphed.target_runner.graphs.graphs  # verifications of k+1 = 5 tokens
    # The second and third passes found the long prompt's 8 full blocks in the prefix cache (the prefill ran only
    # its last tokens, on top of cached KV) and still gave the CPU's tokens.
    assert graphed.target_runner.block_manager.prefix_cache.hit_tokens >= 2 * 128
    tok = byte_tokenizer()

    async def three():
        results = await asyncio.gather(*(graphed.generate(tok.encode(p), SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, num_speculative_tokens=4)) for p in PROMPTS[:3]))
        await graphed.coordinator.wait_idle()
        return [r.token_ids for r in results]

    assert asyncio.run(three()) == cpu_reference[:3]
    assert graphed.kv_blocks_used() == {"target": 0, "draft": 0}

    monkeypatch.setenv("SPECSPLIT_CUDA_GRAPHS", "0")
    eager = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float32", device="cuda")
    assert eager.target_runner.graphs is None
    assert generate(eager, 4) == cpu_reference


def test_draft_rounds_wait_for_the_gpu_once(tiny_pair):
    """The k-step draft loop feeds samples to the next step on the device: one host wait per propose call."""
    from specsplit.services.draft.proposer import DraftPrefill, ProposeItem
    from specsplit.services.runtime.worker_sequences import WorkerSampling

    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float32", device="cuda")
    proposer = engine.proposer
    ids = byte_tokenizer().encode(PROMPTS[0])
    proposer.prefill([DraftPrefill("s", ids[:-1], WorkerSampling(0.0, 0, 1.0, 0))])
    proposer.propose([ProposeItem("s", len(ids) - 1, ids[-1:], 4)])  # warm-up: captures the graphs
    syncs = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            proposer.propose([ProposeItem("s", len(ids) - 1, ids[-1:], 8)])
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"\nhost waits in one propose call of k=8: {len(syncs)}")
    # Exactly one: the read-back after the loop (which also shows the debug mode does see this path's waits).
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_graphs_on_a_second_gpu(tiny_pair, cpu_reference):
    """Graphs capture and replay on the model's own device, not the current one (a draft on cuda:1), also after
    graphs were captured on cuda:0 in the same process (the other tests here)."""
    from specsplit.services.models.loader import load_model

    target = load_model(str(tiny_pair["target"]), "float32", "cuda:1")
    draft = load_model(str(tiny_pair["close"]), "float32", "cuda:1")
    engine = LocalEngine(target, draft, num_speculative_tokens=4)
    assert generate(engine, 4) == cpu_reference
    assert engine.draft_runner.graphs.graphs and engine.target_runner.graphs.graphs


def test_graphs_run_ragged_batches_like_eager(tiny_pair):
    """Sequences adding different token counts (a verification with fewer proposals near max_tokens, a catch-up of 1
    or 2 tokens) run in one graph padded to the longest, with the eager path's logits, and leave no KV behind."""
    from specsplit.services.models.loader import load_model
    from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner

    loaded = load_model(str(tiny_pair["target"]), "float32", "cuda")
    results = {}
    for graphs in (True, False):
        runner = ModelRunner(loaded, num_blocks=64, cuda_graphs=graphs)
        tables = [runner.block_manager.allocate(0) for _ in range(3)]
        prompts = [ForwardItem(t, list(range(10 + 7 * i, 30 + 9 * i)), 1) for i, t in enumerate(tables)]
        runner.reserve(prompts)
        runner.forward(prompts)
        ragged = [ForwardItem(tables[0], [5, 6, 7, 8, 9], 5), ForwardItem(tables[1], [11, 12, 13], 3),
                  ForwardItem(tables[2], [14, 15], 1)]
        assert runner.reserve(ragged) == [None] * 3
        results[graphs] = runner.forward_flat(ragged)
        if graphs:
            assert list(runner.graphs.graphs) == [(5, 4)]  # one graph: q = the longest, bucket 4 for 3 sequences
        for table in tables:
            runner.block_manager.free(table)
        assert runner.block_manager.num_used_blocks == 0
    assert results[True].shape == (9, loaded.config.vocab_size)
    torch.testing.assert_close(results[True], results[False], rtol=1e-4, atol=1e-4)
