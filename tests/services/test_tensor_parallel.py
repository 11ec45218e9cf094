"""Tensor parallelism on the CPU (gloo), in-process engine: a sharded target (degree 2 and 4) and a sharded draft
give exactly the degree-1 output, greedy and seeded sampling, target-only and speculative; bad degrees get clear
errors; a rank that dies takes its replica down (UNAVAILABLE, no hang).

Float64 tiny models: the all-reduces sum partial products in another order than one matmul does, which moves the
last bits (~1e-16 here); the tests check the logits agree to 1e-9 and the tokens are identical. A float32 check
shows the same token identity at that precision (logits within 1e-5)."""

import asyncio
import os
import signal
import time

import pytest
import torch

from specsplit.services.errors import InvalidArgument, Unavailable
from specsplit.services.local_engine import LocalEngine
from specsplit.services.models.loader import load_model
from specsplit.services.models.tensor_parallel import ReducingRMSNorm
from specsplit.services.runtime.model_runner import ModelRunner
from specsplit.services.runtime.tensor_parallel_group import check_tensor_parallel_degree
from specsplit.services.runtime.tensor_parallel_launch import start_tensor_parallel_runner
from engine_runs import generate_tokens, run_prompt
from tiny_models import build_model, save_model

PROMPTS = ["def add(a, b):", "x", "The quick brown fox jumps over the lazy dog.", "1, 2, 3, 5, 8, 13,"]
MAX_TOKENS = 20


def generate(engine, k: int, temperature: float = 0.0):
    seeds = [1000 + i for i in range(len(PROMPTS))] if temperature else None
    return generate_tokens(engine, PROMPTS, k, MAX_TOKENS, temperature, seeds)


def engine(tiny_pair, target_degree=1, draft_degree=1):
    return LocalEngine(str(tiny_pair["target"]), str(tiny_pair["close"]), num_speculative_tokens=4, dtype="float64",
                       speculation="fixed", num_kv_blocks=128, target_tensor_parallel_size=target_degree,
                       draft_tensor_parallel_size=draft_degree)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """Degree 1 everywhere: target-only greedy, speculative greedy, target-only and speculative sampled."""
    e = engine(tiny_pair)
    out = {"greedy": generate(e, 0), "spec_greedy": generate(e, 4), "sampled": generate(e, 0, 0.8),
           "spec_sampled": generate(e, 4, 0.8)}
    asyncio.run(e.close())
    return out


@pytest.fixture(scope="module")
def sharded_target(tiny_pair):
    """Target at degree 2, draft at degree 1."""
    e = engine(tiny_pair, target_degree=2)
    yield e
    asyncio.run(e.close())


def test_sharded_logits_match_degree_one(sharded_target, tiny_pair):
    """Four heads over two KV heads at degree 2: each rank holds one KV head and two query heads."""
    tokens = [3, 99, 17, 250, 4, 8, 15, 16, 23, 42]
    whole = ModelRunner(load_model(str(tiny_pair["target"]), "float64"), num_blocks=16)
    expected = run_prompt(whole, tokens)
    runner = sharded_target.target_runner
    assert runner.cache.layers[0][0].shape[2] == 1  # this rank's KV heads only
    logits = run_prompt(runner, tokens)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-9)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_target_degree_two_greedy_and_sampled_identical(sharded_target, reference):
    assert generate(sharded_target, 0) == reference["greedy"]
    assert generate(sharded_target, 4) == reference["spec_greedy"] == reference["greedy"]
    assert generate(sharded_target, 0, 0.8) == reference["sampled"]
    assert generate(sharded_target, 4, 0.8) == reference["spec_sampled"]


def test_decode_ahead_on_a_sharded_target(sharded_target, reference):
    """The steps run ahead (forced on: its auto is on only on a GPU) go to every rank like any step and give the
    same tokens."""
    ahead = sharded_target.verifier.decode_ahead
    ahead.enabled = True
    try:
        assert generate(sharded_target, 0) == reference["greedy"]
        assert generate(sharded_target, 0, 0.8) == reference["sampled"]
    finally:
        ahead.enabled = False
    assert ahead.taken >= 2 * len(PROMPTS) * (MAX_TOKENS - 2) and ahead.missed == 0


def test_eager_decode_keeps_no_step_definitions(sharded_target):
    """On the CPU (no graphs) every decode step has a new exact-context shape: rank 0 keeps none of them."""
    generate_tokens(sharded_target, PROMPTS[:2], 0, 12, 0.0, None)
    assert len(sharded_target.target_runner.group.commands._defined) == 0


def test_target_degree_four_with_sharded_draft(tiny_pair, reference):
    """Target over 4 ranks (KV heads replicated), the draft over 2 (its k-step programs in lockstep)."""
    e = engine(tiny_pair, target_degree=4, draft_degree=2)
    try:
        assert e.target_runner.cache.layers[0][0].shape[2] == 1  # each KV head replicated on two ranks
        assert generate(e, 4) == reference["greedy"]
        assert generate(e, 4, 0.8) == reference["spec_sampled"]
        assert generate(e, 0, 0.8) == reference["sampled"]
        assert e.kv_blocks_used() == {"target": 0, "draft": 0}
    finally:
        asyncio.run(e.close())


@pytest.mark.parametrize("attention_bias", [False, True])
def test_float32_shards_pick_the_same_tokens(tmp_path, attention_bias):
    """Without biases the row-parallel sums are reduced inside the norms after them; with o_proj's bias (a Llama
    with attention_bias) each is reduced on its own, before its bias is added."""
    model = build_model("llama", seed=3, attention_bias=attention_bias)  # float32, four heads over two KV heads
    path = str(save_model(model, tmp_path / "llama32"))
    tokens = list(range(5, 60, 3))
    expected = run_prompt(ModelRunner(load_model(path, "float32"), num_blocks=16), tokens)
    runner = start_tensor_parallel_runner(path, 2, "target", "float32", num_blocks=16, weight_format="dense")
    try:
        logits = run_prompt(runner, tokens)
    finally:
        runner.close()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_row_parallel_sums_are_reduced_by_the_norms_that_read_them(sharded_target, reference):
    """Every post-attention norm, every later layer's input norm and the final norm reduce the partial sums they
    read, in alternating slots; the first input norm reads the embedding (already whole). On the CPU every
    all-reduce mode comes down to gloo's, and switching modes (every rank drops its graphs) changes no token."""
    runner = sharded_target.target_runner
    model = runner.model
    layers = model.model.layers
    reading = [n for i, layer in enumerate(layers)
               for n in (layer.post_attention_layernorm, layers[i + 1].input_layernorm if i + 1 < len(layers)
                         else model.model.norm)]
    assert all(isinstance(n, ReducingRMSNorm) for n in reading)
    assert [n.slot for n in reading] == [0, 1] * len(layers)
    assert not isinstance(layers[0].input_layernorm, ReducingRMSNorm)
    assert not any(layer.self_attn.o_proj.reduce or layer.mlp.down_proj.reduce for layer in layers)
    assert runner.group.all_reduce.mode == "nccl"
    for mode in ("fused", "symm", "auto", "nccl"):
        assert runner.use_all_reduce(mode) == "nccl"
    assert generate(sharded_target, 4) == reference["greedy"]


def test_bad_degrees_are_refused_before_anything_starts(tiny_pair):
    with pytest.raises(InvalidArgument, match="does not divide the model's 4 attention heads"):
        start_tensor_parallel_runner(str(tiny_pair["target"]), 3, "target", "float64")
    present = torch.cuda.device_count()
    with pytest.raises(InvalidArgument, match=f"exceeds the {present} GPUs present"):
        check_tensor_parallel_degree(max(2, present + 1), 8, 8, "cuda")
    with pytest.raises(InvalidArgument, match="KV heads"):
        check_tensor_parallel_degree(4, 12, 6, "cpu")
    check_tensor_parallel_degree(4, 8, 2, "cpu")  # two KV heads, each replicated on two ranks


def test_a_dead_rank_takes_the_replica_down(tiny_pair):
    lost = []
    runner = start_tensor_parallel_runner(str(tiny_pair["target"]), 2, "target", "float64", num_blocks=16,
                                          on_rank_lost=lost.append)
    try:
        run_prompt(runner, [1, 2, 3])
        (pid,) = runner.followers.pids
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while not lost and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lost and "rank 1" in lost[0]
        with pytest.raises(Unavailable, match="tensor-parallel replica is down"):
            run_prompt(runner, [4, 5, 6])
    finally:
        runner.close()
