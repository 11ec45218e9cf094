"""The batch-invariant mode on the CPU (the torch references), bf16, tiny models: greedy speculative output equals
target-only output alone at batch 1, 8 and 32 with a close and an unrelated draft, with mixed k, catch-ups and
sequences joining mid-batch, and under adaptive speculation; seeded sampled requests get their tokens alone at any
batch; a prompt found in the prefix cache gets the tokens it got computed from scratch. The same checks (but the
prefix-cache one) run on a GPU in tests/services/test_gpu_engine.py.

On this CPU the default mode passes these scenarios too (the tiny flat models meet no near-tie that the default's
batch-dependent rounding flips), so here they guard the mode's own kernels and scheduling only: that the mode runs
end to end and keeps its promise. What shows the mode is needed and switched on is the kernel-level contrast in
tests/kernels/test_batch_invariance.py (the default linear, RMSNorm and SiLU differ alone vs batched at its shapes,
the mode's do not); the engine-level evidence is the GPU tests, where the default does break."""

import pytest

from invariance_scenarios import (PROMPTS, alone, check_greedy, check_prefix_cache_hit, check_seeded, greedy, run,
                                 save_flat_pair)
from specsplit.kernels import dispatch
from specsplit.services.errors import InvalidArgument
from specsplit.services.local_engine import LocalEngine
from specsplit.services.models.loader import load_model
from specsplit.services.models.weight_formats import use_weight_format

MAX_TOKENS = 8
BATCHES = (1, 8, 32)


@pytest.fixture(scope="module", autouse=True)
def batch_invariant_mode():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dispatch, "_MODE", True)
        yield


@pytest.fixture(scope="module")
def flat_pair(tmp_path_factory):
    return save_flat_pair(tmp_path_factory.mktemp("flat"))


@pytest.fixture(scope="module")
def reference(flat_pair):
    """Target-only greedy tokens of every prompt, each run alone."""
    engine = LocalEngine(flat_pair["target"], None, num_speculative_tokens=0, dtype="bfloat16")
    return alone(engine, [(p, greedy(MAX_TOKENS, 0)) for p in PROMPTS[:max(BATCHES)]])


@pytest.mark.parametrize("draft", ["close", "unrelated"])
def test_greedy_speculation_equals_target_only_alone(flat_pair, reference, draft):
    engine = LocalEngine(flat_pair["target"], flat_pair[draft], num_speculative_tokens=4, dtype="bfloat16",
                         speculation="fixed")
    seen = check_greedy(engine, reference, BATCHES, MAX_TOKENS)
    if draft == "close":
        assert seen["longest_catch_up"] == 2  # bonus rounds happened: the draft caught up on two tokens
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_adaptive_speculation_equals_target_only_alone(flat_pair, reference):
    engine = LocalEngine(flat_pair["target"], flat_pair["close"], num_speculative_tokens=4, dtype="bfloat16")
    assert run(engine, [(p, greedy(MAX_TOKENS, None)) for p in PROMPTS[:8]]) == reference[:8]


def test_seeded_sampling_does_not_depend_on_the_batch(flat_pair):
    engine = LocalEngine(flat_pair["target"], flat_pair["close"], num_speculative_tokens=4, dtype="bfloat16",
                         speculation="fixed")
    check_seeded(engine, batch=8, max_tokens=MAX_TOKENS)


def test_a_prefix_cache_hit_gives_the_tokens_computed_from_scratch(flat_pair):
    engine = LocalEngine(flat_pair["target"], flat_pair["close"], num_speculative_tokens=4, dtype="bfloat16",
                         speculation="fixed")
    check_prefix_cache_hit(engine, MAX_TOKENS)


def test_the_mode_refuses_what_it_cannot_make_invariant(flat_pair):
    with pytest.raises(InvalidArgument, match="tensor-parallel size 1"):
        LocalEngine(flat_pair["target"], None, target_tensor_parallel_size=2)
    loaded = load_model(str(flat_pair["target"]), "float32")
    with pytest.raises(InvalidArgument, match="not batch-invariant"):
        use_weight_format(loaded, "packed", "target")
    assert use_weight_format(loaded, "auto", "target") == "dense"
