"""The engine on a CUDA GPU (Triton kernels) against the CPU torch path, on tiny models. Skipped without CUDA.

fp32: greedy output must be token-for-token the CPU's. bf16: rounding differs from fp32, so greedy paths may part
at near-ties from the CPU's; the match rate is printed (run with -s) and recorded. In the default mode bf16
speculation may part from bf16 target-only decoding too (a verification's k+1 rows and a decode's one row round
differently); in the batch-invariant mode it must not: those tests assert bit-exact identity.
"""

import asyncio

import pytest
import torch

from invariance_scenarios import PROMPTS as INVARIANCE_PROMPTS
from invariance_scenarios import alone, check_greedy, check_seeded, greedy, run, save_flat_pair
from specsplit.kernels import dispatch
from specsplit.kernels.dispatch import use_triton
from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from engine_runs import generate_tokens
from tiny_models import byte_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = ["def add(a, b):", "x", "The quick brown fox jumps over the lazy dog. " * 3, "1, 2, 3, 5, 8, 13,"]
MAX_TOKENS = 32


def generate(engine: LocalEngine, k: int, temperature: float = 0.0) -> list[list[int]]:
    return generate_tokens(engine, PROMPTS, k, MAX_TOKENS, temperature, seeds=list(range(len(PROMPTS))))


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


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_bf16_greedy_match_rate_is_reported(tiny_pair, cpu_reference, record_property, monkeypatch, invariant):
    """Both modes record the match rates; the batch-invariant mode asserts speculative == target-only."""
    monkeypatch.setattr(dispatch, "_MODE", invariant)
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="bfloat16",
                         device="cuda")
    target_only, speculative = generate(engine, 0), generate(engine, 4)
    rate_target_only = match_rate(target_only, cpu_reference)
    rate_speculative = match_rate(speculative, cpu_reference)
    self_rate = match_rate(speculative, target_only)
    mode = "batch_invariant" if invariant else "default"
    record_property(f"bf16_{mode}_greedy_match_rate_target_only_vs_cpu_fp32", rate_target_only)
    record_property(f"bf16_{mode}_greedy_match_rate_speculative_vs_cpu_fp32", rate_speculative)
    record_property(f"bf16_{mode}_greedy_match_rate_speculative_vs_bf16_target_only", self_rate)
    print(f"\nbf16 ({mode}) greedy match rate vs CPU fp32: target-only {rate_target_only:.3f}, speculative "
          f"{rate_speculative:.3f}; speculative vs bf16 target-only {self_rate:.3f}")
    assert all(len(t) == MAX_TOKENS for t in target_only + speculative)
    if invariant:
        assert speculative == target_only


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_ahead_gives_the_same_tokens_on_gpu(tiny_pair, dtype):
    """Target-only, greedy and seeded sampling: the steps run ahead (on by default on a GPU) give exactly the tokens
    of the steps run when asked, in bf16 too (the same graph on the same rows)."""
    runs = {}
    for mode in ("off", "auto"):
        engine = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype=dtype, device="cuda",
                             decode_ahead=mode)
        runs[mode] = (generate(engine, 0), generate(engine, 0, temperature=1.0), engine.verifier.decode_ahead)
    assert runs["auto"][:2] == runs["off"][:2]
    ahead = runs["auto"][2]
    assert ahead.enabled and ahead.taken >= 2 * len(PROMPTS) * (MAX_TOKENS - 2) and ahead.missed == 0
    assert runs["off"][2].launched == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_prefills_replay_a_graph_and_give_the_eager_tokens(tiny_pair, monkeypatch, dtype):
    """Short prompts prefill as a graph replay of the verification program (SPECSPLIT_PREFILL_STEPS=on, opt-in):
    greedy and seeded sampled tokens equal those of the eager prefill (off, the default), bit for bit in float32."""
    outputs = {}
    for mode in ("on", "off"):
        monkeypatch.setenv("SPECSPLIT_PREFILL_STEPS", mode)
        engine = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype=dtype, device="cuda")
        short = [p for p in PROMPTS if len(p) <= 64]
        outputs[mode] = tuple(generate_tokens(engine, short, 0, MAX_TOKENS, t, seeds=list(range(len(short))))
                              for t in (0.0, 1.0))
        widths = {shape.width for _, shape, _ in graph_keys(engine.target_runner, "verify")}
        assert (max(widths) > 1) == (mode == "on")  # prefills of the short prompts were graphs
    if dtype == "float32":
        assert outputs["on"] == outputs["off"]
    else:  # bf16: a prompt's rows are reduced in another order padded into a step: near-ties may part
        print(f"\nbf16 prefill steps vs eager: {match_rate(outputs['on'][0], outputs['off'][0]):.3f} greedy match")


def graph_keys(runner, name: str) -> list:
    return [key for key in runner.graphs.steps if key[0] == name]


def test_cuda_graphs_are_used_and_match_eager(tiny_pair, cpu_reference, monkeypatch):
    """Graphs (the default on CUDA) and eager give the CPU's fp32 greedy tokens, also for a batch that does not fill
    its bucket (3 of 4: one padding row), and leave no KV behind."""
    graphed = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float32", device="cuda")
    assert graphed.target_runner.graphs is not None and graphed.draft_runner.graphs is not None
    for k in (0, 1, 4):
        assert generate(graphed, k) == cpu_reference, f"k={k}"
    # A whole draft call of 4 steps for 4 sequences is one graph; so is a verification of k = 4.
    assert any(shape.steps == 4 and bucket == 4 for _, shape, bucket in graph_keys(graphed.draft_runner, "draft"))
    assert any(shape.steps == 4 and bucket == 4 for _, shape, bucket in graph_keys(graphed.target_runner, "verify"))
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


def test_seeded_sampling_is_the_same_graphed_and_eager(tiny_pair, monkeypatch):
    graphed = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float32",
                          device="cuda")
    monkeypatch.setenv("SPECSPLIT_CUDA_GRAPHS", "0")
    eager = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float32",
                        device="cuda")
    for temperature in (0.8, 1.0):
        sampled = generate(graphed, 4, temperature=temperature)
        assert sampled == generate(eager, 4, temperature=temperature)
        assert generate(graphed, 0, temperature=temperature) == generate(eager, 0, temperature=temperature)


def test_graphs_cover_mixed_batches_like_the_cpu(tiny_pair):
    """Five sequences (between buckets 4 and 8) with different lengths: they finish mid-batch, carry fewer
    proposals near their end (mixed k in one verification), catch up on 1 or 2 tokens (bonus rounds); greedy output
    equals the CPU's target-only output, with no KV left behind."""
    tok = byte_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode("lorem ipsum")]
    lengths = [5, 17, 32, 9, 23]

    def run(engine, k):
        async def main():
            results = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=n, ignore_eos=True,
                                                                               num_speculative_tokens=k))
                                             for p, n in zip(prompts, lengths)))
            await engine.coordinator.wait_idle()
            return [r.token_ids for r in results]
        return asyncio.run(main())

    cpu = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype="float32", target_weights="dense")
    want = run(cpu, 0)
    for draft in ("close", "unrelated"):
        gpu = LocalEngine(tiny_pair["target"], tiny_pair[draft], num_speculative_tokens=4, dtype="float32",
                          device="cuda")
        for k in (4, 3, 1):
            assert run(gpu, k) == want, (draft, k)
        assert gpu.kv_blocks_used() == {"target": 0, "draft": 0}
        shapes = [shape for _, shape, _ in graph_keys(gpu.draft_runner, "draft")]
        if draft == "close":
            assert any(shape.catch_up == 2 for shape in shapes)  # a bonus round's catch-up of two tokens
        assert any(bucket == 8 for _, _, bucket in graph_keys(gpu.target_runner, "verify"))


def test_warm_up_captures_what_rounds_then_use(tiny_pair):
    """After the engine's warm-up, rounds at any batch size with up to k proposals, greedy or sampled, capture
    no graph of their own (no request waits for a capture)."""
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float32",
                         device="cuda", speculation="fixed")
    captured = (len(engine.draft_runner.graphs.steps), len(engine.target_runner.graphs.steps))
    assert captured[0] > 0 and captured[1] > 0
    tok = byte_tokenizer()

    async def main():
        for batch in (1, 3, 8, 21):
            params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=t, seed=i)
                      for i, t in zip(range(batch), [0.0, 1.0] * batch)]
            await asyncio.gather(*(engine.generate(tok.encode(PROMPTS[i % 4]), p) for i, p in enumerate(params)))
        await engine.coordinator.wait_idle()

    asyncio.run(main())
    assert (len(engine.draft_runner.graphs.steps), len(engine.target_runner.graphs.steps)) == captured


def _host_waits(call) -> int:
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return len([w for w in caught if "synchroniz" in str(w.message)])


def test_each_round_call_waits_for_the_gpu_once(tiny_pair):
    """A draft call of k steps and a verification each replay one graph and wait once, for the result."""
    from specsplit.services.draft.proposer import DraftPrefill, ProposeItem
    from specsplit.services.runtime.worker_sequences import WorkerSampling
    from specsplit.services.target.verifier import TargetPrefill, VerifyItem

    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float32", device="cuda")
    proposer, verifier = engine.proposer, engine.verifier
    ids = byte_tokenizer().encode(PROMPTS[0])
    greedy = WorkerSampling(0.0, 0, 1.0, 0)
    proposer.prefill([DraftPrefill("s", ids[:-1], greedy)])
    verifier.prefill([TargetPrefill("s", ids[:-1], greedy)])
    proposal = proposer.propose([ProposeItem("s", len(ids) - 1, ids[-1:], 8)])[0]  # warm-up: captures the graph
    verify = lambda: verifier.verify([VerifyItem("s", len(ids) - 1, ids[-1:], proposal.token_ids,  # noqa: E731
                                                 proposal.q_token_ids, proposal.q_probs)])
    verify()
    waits = _host_waits(lambda: proposer.propose([ProposeItem("s", len(ids) - 1, ids[-1:], 8)]))
    print(f"\nhost waits in one propose call of k=8: {waits}")
    assert waits == 1  # the read-back after the replay (which also shows the debug mode sees this path's waits)
    assert _host_waits(verify) == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_graphs_on_a_second_gpu(tiny_pair, cpu_reference):
    """Graphs capture and replay on the model's own device, not the current one (a draft on cuda:1), also after
    graphs were captured on cuda:0 in the same process (the other tests here)."""
    from specsplit.services.models.loader import load_model

    target = load_model(str(tiny_pair["target"]), "float32", "cuda:1")
    draft = load_model(str(tiny_pair["close"]), "float32", "cuda:1")
    engine = LocalEngine(target, draft, num_speculative_tokens=4)
    assert generate(engine, 4) == cpu_reference
    assert engine.draft_runner.graphs.steps and engine.target_runner.graphs.steps


# -- the batch-invariant mode at serving batch sizes (tests/invariance_scenarios.py) ----------------------------

INVARIANT_MAX_TOKENS = 32
INVARIANT_BATCHES = (1, 8, 32, 64)


@pytest.fixture(scope="module")
def flat_pair(tmp_path_factory):
    return save_flat_pair(tmp_path_factory.mktemp("flat"))


@pytest.fixture(scope="module")
def invariant_reference(flat_pair):
    """bf16 target-only greedy tokens of every prompt alone, in the batch-invariant mode (graphs on)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dispatch, "_MODE", True)
        engine = LocalEngine(flat_pair["target"], None, num_speculative_tokens=0, dtype="bfloat16", device="cuda")
        prompts = INVARIANCE_PROMPTS[:max(INVARIANT_BATCHES)]
        return alone(engine, [(p, greedy(INVARIANT_MAX_TOKENS, 0)) for p in prompts])


@pytest.mark.parametrize("draft", ["close", "unrelated"])
def test_batch_invariant_bf16_greedy_speculation_equals_target_only_alone(flat_pair, invariant_reference, draft,
                                                                          monkeypatch):
    monkeypatch.setattr(dispatch, "_MODE", True)
    engine = LocalEngine(flat_pair["target"], flat_pair[draft], num_speculative_tokens=4, dtype="bfloat16",
                         device="cuda", speculation="fixed")
    assert engine.target_runner.graphs is not None
    seen = check_greedy(engine, invariant_reference, INVARIANT_BATCHES, INVARIANT_MAX_TOKENS)
    if draft == "close":
        assert seen["longest_catch_up"] == 2
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}
    adaptive = LocalEngine(flat_pair["target"], flat_pair[draft], num_speculative_tokens=4, dtype="bfloat16",
                           device="cuda")
    batch = [(p, greedy(INVARIANT_MAX_TOKENS, None)) for p in INVARIANCE_PROMPTS[:32]]
    assert run(adaptive, batch) == invariant_reference[:32]


def test_batch_invariant_bf16_seeded_sampling_does_not_depend_on_the_batch(flat_pair, monkeypatch):
    monkeypatch.setattr(dispatch, "_MODE", True)
    engine = LocalEngine(flat_pair["target"], flat_pair["close"], num_speculative_tokens=4, dtype="bfloat16",
                         device="cuda", speculation="fixed")
    check_seeded(engine, batch=32, max_tokens=INVARIANT_MAX_TOKENS)


def test_default_mode_bf16_match_rate_on_flat_models_is_reported(flat_pair, record_property, monkeypatch):
    """The contrast (recorded, not asserted): the same flat models in the default mode, batch 32, k = 4."""
    monkeypatch.setattr(dispatch, "_MODE", False)
    engine = LocalEngine(flat_pair["target"], flat_pair["unrelated"], num_speculative_tokens=4, dtype="bfloat16",
                         device="cuda", speculation="fixed")
    got = run(engine, [(p, greedy(INVARIANT_MAX_TOKENS, 4)) for p in INVARIANCE_PROMPTS[:32]])
    reference = alone(engine, [(p, greedy(INVARIANT_MAX_TOKENS, 0)) for p in INVARIANCE_PROMPTS[:32]])
    same = sum(a == b for a, b in zip(got, reference))
    record_property("bf16_default_flat_batch32_sequences_equal_to_target_only_alone", same)
    print(f"\ndefault mode, bf16, flat models, batch 32, k=4: {same}/32 sequences equal target-only alone")
