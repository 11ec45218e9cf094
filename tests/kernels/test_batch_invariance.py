"""The batch-invariant mode's kernels (kernels/dispatch.py): each Triton kernel against its torch reference, and the
property itself for both: a row's output is bit for bit the same computed alone, in batches of other sizes, at
other positions, in a k+1 verification or a prefill chunked another way."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from paged_batch_inputs import make_paged_batch, naive_attention, relative_error
from specsplit.kernels import dispatch, typical_acceptance
from specsplit.kernels.invariant_reductions import ordered_cumsum, ordered_sum, ordered_top_k
from specsplit.kernels.linear import linear_torch
from specsplit.kernels import linear_triton as linear_triton_module
from specsplit.kernels.linear_triton import (GemmConfig, config_for_rows, gemm_config, launch_rule, launch_variant,
                                             linear_triton, splits_side_by_side)
from specsplit.kernels.paged_attention import paged_attention_torch
from specsplit.kernels.paged_attention_triton import paged_attention_triton
from specsplit.kernels.rms_norm import add_rms_norm_torch
from specsplit.kernels.rms_norm_triton import add_rms_norm_triton
from specsplit.kernels.silu_mul import silu_mul_torch
from specsplit.kernels.typical_acceptance import typical_bound

DTYPES = [torch.float32, torch.bfloat16]


# -- row reductions -----------------------------------------------------------------------------------------------

def test_ordered_sum_is_unchanged_by_padding_and_neighbours(generator):
    rows = torch.randn(5, 37, generator=generator)
    alone = torch.stack([ordered_sum(row) for row in rows])
    assert torch.equal(ordered_sum(rows), alone)
    padded = torch.cat([rows, torch.full((5, 91), -0.0)], dim=-1)
    assert torch.equal(ordered_sum(padded), alone)
    assert torch.allclose(alone.double(), rows.double().sum(-1), atol=1e-5)
    # -0.0 padding keeps a negative zero negative (a +0.0 pad would not).
    assert torch.signbit(ordered_sum(torch.tensor([-0.0, -0.0, -0.0])))


def test_ordered_cumsum_matches_a_running_sum(generator):
    rows = torch.randn(3, 100, generator=generator).double()
    assert torch.allclose(ordered_cumsum(rows), rows.cumsum(-1), atol=1e-12)
    assert torch.equal(ordered_cumsum(rows[1:2]), ordered_cumsum(rows)[1:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ordered_top_k_breaks_ties_by_index(dtype):
    x = torch.tensor([[0.5, -1.0, 0.5, 2.0, -0.0, 0.0, -3.0, 2.0, 0.5]], dtype=dtype)
    values, indices = ordered_top_k(x, 6)
    assert indices.tolist() == [[3, 7, 0, 2, 8, 4]]
    assert torch.equal(values, x.gather(1, indices))
    many = torch.cat([torch.rand(4, 9, dtype=dtype), x, torch.zeros(3, 9, dtype=dtype)])
    assert torch.equal(ordered_top_k(many, 6)[1][4:5], indices)
    assert ordered_top_k(torch.zeros(1, 9, dtype=dtype), 3)[1].tolist() == [[0, 1, 2]]


# -- the switch and the linear entry point ---------------------------------------------------------------------

def test_the_setter_switches_the_mode_and_hands_it_to_child_processes(monkeypatch):
    monkeypatch.setattr(dispatch, "_MODE", False)  # both restored after the test
    monkeypatch.setenv(dispatch.BATCH_INVARIANT_ENV, "0")
    assert not dispatch.batch_invariant()
    dispatch.set_batch_invariant(True)
    assert dispatch.batch_invariant() and os.environ[dispatch.BATCH_INVARIANT_ENV] == "1"
    dispatch.set_batch_invariant(False)
    assert not dispatch.batch_invariant() and os.environ[dispatch.BATCH_INVARIANT_ENV] == "0"


def test_the_environment_is_read_at_import_and_a_bad_value_refused(monkeypatch):
    check = [sys.executable, "-c", "from specsplit.kernels.dispatch import batch_invariant; print(batch_invariant())"]
    on = subprocess.run(check, env={**os.environ, dispatch.BATCH_INVARIANT_ENV: "1"}, capture_output=True, text=True)
    assert on.stdout.strip() == "True", on.stderr
    bad = subprocess.run(check, env={**os.environ, dispatch.BATCH_INVARIANT_ENV: "yes"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "must be 0 or 1, not 'yes'" in bad.stderr
    for off in ("0", ""):
        monkeypatch.setenv(dispatch.BATCH_INVARIANT_ENV, off)
        assert dispatch._mode_from_environment() is False


def test_linear_is_torchs_own_by_default_and_the_fixed_order_one_in_the_mode(monkeypatch, generator):
    x, w, b = torch.randn(6, 40, generator=generator), torch.randn(24, 40, generator=generator), torch.randn(24)
    monkeypatch.setattr(dispatch, "_MODE", False)
    assert torch.equal(dispatch.linear(x, w, b), F.linear(x, w, b))
    monkeypatch.setattr(dispatch, "_MODE", True)
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert torch.equal(dispatch.linear(x, w, b), linear_torch(x, w, b))


# -- linear: the Triton GEMM and its reference ----------------------------------------------------------------

def _row_invariance(fn, x, rows=(0, 5, 69)):
    """fn(x[subset]) for batches of other sizes and positions must give each row of fn(x) bit for bit."""
    full = fn(x)
    for r in rows:
        assert torch.equal(fn(x[r:r + 1])[0], full[r]), f"row {r} alone"
        others = torch.cat([x[r:r + 1].roll(1, dims=-1), x[r:r + 1]])  # the row second, beside another
        assert torch.equal(fn(others)[1], full[r]), f"row {r} at position 1 of 2"
        tail = x[max(r - 16, 0):r + 1]  # a batch of up to 17 ending with the row
        assert torch.equal(fn(tail)[-1], full[r]), f"row {r} at the end of {tail.shape[0]}"
    return full


SPLIT_CONFIG = GemmConfig(block_m=64, block_n=64, block_k=32, split_k=3, k_per_split=96, num_warps=4, num_stages=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, SPLIT_CONFIG], ids=["chosen", "split-k"])
def test_linear_triton_matches_reference_and_is_row_invariant(dtype, config, device, generator):
    # 70 rows: two row-tiles of 64; K = 200 ends inside a K block; N = 100 inside a column tile.
    x = torch.randn(70, 200, generator=generator).to(dtype=dtype, device=device)
    w = (torch.randn(100, 200, generator=generator) / 10).to(dtype=dtype, device=device)
    b = torch.randn(100, generator=generator).to(dtype=dtype, device=device)
    got = _row_invariance(lambda rows: linear_triton(rows, w, b, config=config), x)
    want = linear_torch(x.cpu(), w.cpu(), b.cpu())
    exact = x.double().cpu() @ w.double().cpu().T + b.double().cpu()
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # one rounding to bf16 of outputs near 1-10
    assert relative_error(got, exact) < tolerance and relative_error(want, exact) < tolerance


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_triton_splits_side_by_side_or_in_one_program_give_the_same_bits(dtype, device, generator):
    # The placement of K's splits may follow the row count (splits_side_by_side): it must not change a bit.
    x = torch.randn(70, 200, generator=generator).to(dtype=dtype, device=device)
    w = (torch.randn(100, 200, generator=generator) / 10).to(dtype=dtype, device=device)
    b = torch.randn(100, generator=generator).to(dtype=dtype, device=device)
    side_by_side = linear_triton(x, w, b, config=SPLIT_CONFIG, side_by_side=True)
    in_program = linear_triton(x, w, b, config=SPLIT_CONFIG, side_by_side=False)
    assert torch.equal(side_by_side, in_program)
    assert torch.equal(linear_triton(x[3:4], w, b, config=SPLIT_CONFIG, side_by_side=True)[0], in_program[3])
    if dtype == torch.float32:  # the split is part of the arithmetic (bf16's rounding hides it at this K)
        unsplit = dataclasses.replace(SPLIT_CONFIG, split_k=1, k_per_split=224)
        assert not torch.equal(linear_triton(x, w, b, config=unsplit), in_program)


# The same K splits launched other ways: the MMA's operands swapped (the weight's rows on its M side), tiles loaded
# through tensor descriptors. Whether each gives the default launch's bits is the GPU's to say (tensor-core
# accumulation; bench_invariant_gemm.py --variants checks it there); here: each computes the GEMM, row-invariantly.
LAUNCH_VARIANTS = {"swapped": dict(swap_ab=True, block_m=16), "descriptors": dict(tma=True),
                   "swapped, descriptors": dict(swap_ab=True, tma=True, block_m=32, block_n=32)}


@pytest.mark.parametrize("variant", LAUNCH_VARIANTS)
@pytest.mark.parametrize("side_by_side", [True, False], ids=["splits-side-by-side", "splits-in-program"])
def test_linear_triton_launch_variants_compute_the_gemm_row_invariantly(variant, side_by_side, device, generator):
    x = torch.randn(70, 200, generator=generator).to(dtype=torch.bfloat16, device=device)
    w = (torch.randn(100, 200, generator=generator) / 10).to(dtype=torch.bfloat16, device=device)
    b = torch.randn(100, generator=generator).to(dtype=torch.bfloat16, device=device)
    config = dataclasses.replace(SPLIT_CONFIG, **LAUNCH_VARIANTS[variant])
    got = _row_invariance(lambda rows: linear_triton(rows, w, b, config=config, side_by_side=side_by_side), x)
    exact = x.double().cpu() @ w.double().cpu().T + b.double().cpu()
    assert relative_error(got, exact) < 8e-3
    # Rows that start off a 16-byte boundary cannot take a descriptor: loaded through pointers, the same bits.
    misaligned = torch.randn(70 * 200 + 1, generator=generator).to(dtype=torch.bfloat16, device=device)[1:]
    misaligned = misaligned.view(70, 200)
    assert misaligned.data_ptr() % 16 != 0
    assert torch.equal(linear_triton(misaligned, w, b, config=config, side_by_side=side_by_side),
                       linear_triton(misaligned.clone(), w, b, config=config, side_by_side=side_by_side))


def test_launch_variants_and_the_rule_that_takes_them_from_a_row_count():
    base = gemm_config(3584, 3584, torch.bfloat16, 132)
    swapped = launch_variant("swap-tma:32:128:4:4", base)
    assert (swapped.block_m, swapped.block_n, swapped.num_warps, swapped.num_stages) == (32, 128, 4, 4)
    assert swapped.swap_ab and swapped.tma and (swapped.split_k, swapped.k_per_split) == (base.split_k, base.k_per_split)
    assert launch_variant("plain:64:64:4:4", base) == base
    for bad in ("swap:32:128:4", "wide:32:128:4:4", "swap:32:128:4:x"):
        with pytest.raises(ValueError, match="BLOCK_M:BLOCK_N:warps:stages"):
            launch_variant(bad, base)
    assert launch_rule("") == [] and launch_rule(None) == []  # off unless set
    rule = launch_rule("swap:16:64:4:4@1,swap-tma:64:128:4:4@64")
    assert rule == [(64, "swap-tma:64:128:4:4"), (1, "swap:16:64:4:4")]
    assert config_for_rows(160, base, torch.bfloat16, rule).block_m == 64
    assert config_for_rows(63, base, torch.bfloat16, rule).block_m == 16
    assert config_for_rows(160, base, torch.float32, rule) == base  # float32 keeps its one launch
    with pytest.raises(ValueError, match="VARIANT@ROWS"):
        launch_rule("swap:16:64:4:4")


def test_linear_triton_takes_the_launch_rule_from_the_environment(monkeypatch, device, generator):
    x = torch.randn(70, 200, generator=generator).to(dtype=torch.bfloat16, device=device)
    w = (torch.randn(100, 200, generator=generator) / 10).to(dtype=torch.bfloat16, device=device)
    taken = []

    def recorded(m, cfg, dtype, rule):
        chosen = original(m, cfg, dtype, rule)
        taken.append((m, chosen.swap_ab, chosen.block_m))
        return chosen

    original = linear_triton_module.config_for_rows
    monkeypatch.setattr(linear_triton_module, "config_for_rows", recorded)
    monkeypatch.setenv(linear_triton_module.LAUNCH_ENV, "swap:16:64:4:4@8")
    linear_triton_module._launch_rule.cache_clear()
    try:
        few, many = linear_triton(x[:7], w), linear_triton(x, w)
    finally:
        monkeypatch.delenv(linear_triton_module.LAUNCH_ENV)
        linear_triton_module._launch_rule.cache_clear()
    assert taken == [(7, False, 64), (70, True, 16)]  # the 70-row call only
    exact = x.double().cpu() @ w.double().cpu().T
    assert relative_error(many, exact) < 8e-3 and relative_error(few, exact[:7]) < 8e-3


def test_splits_go_in_one_program_once_the_row_tiles_fill_the_device():
    o_proj = gemm_config(3584, 3584, torch.bfloat16, 132)  # 56 column tiles, split 7: 392 programs on 396 slots
    assert splits_side_by_side(1, 3584, o_proj, 132) and splits_side_by_side(64 * 2, 3584, o_proj, 132)
    assert not splits_side_by_side(64 * 3, 3584, o_proj, 132)  # 168 tiles: more than the SMs
    assert not splits_side_by_side(1, 37888, gemm_config(37888, 3584, torch.bfloat16, 132), 132)  # unsplit
    tiny = gemm_config(896, 896, torch.bfloat16, 132)  # 14 tiles, 14 K blocks: as many splits as allowed
    assert tiny.split_k == 3


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_linear_reference_is_row_invariant(dtype, generator):
    x = torch.randn(70, 130, generator=generator).to(dtype)
    w = torch.randn(33, 130, generator=generator).to(dtype)
    full = _row_invariance(lambda rows: linear_torch(rows, w), x)
    assert full.dtype == dtype and full.shape == (70, 33)
    assert torch.equal(linear_torch(x.reshape(7, 10, 130), w).reshape(70, 33), full)


def test_gemm_config_depends_on_the_weight_only():
    # The 7B's shapes on an H100 (132 SMs): narrow layers split K to fill the SMs with one row-tile.
    qkv, o_proj, gate_up = (gemm_config(n, k, torch.bfloat16, 132) for n, k in
                            ((4608, 3584), (3584, 3584), (37888, 3584)))
    assert (qkv.split_k, o_proj.split_k, gate_up.split_k) == (5, 7, 1)  # 360, 392 programs on 396 slots; 592 tiles
    for cfg, k in ((qkv, 3584), (o_proj, 3584)):
        assert cfg.k_per_split % cfg.block_k == 0 and (cfg.split_k - 1) * cfg.k_per_split < k <= cfg.split_k * cfg.k_per_split


# -- paged attention --------------------------------------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 32, 16


def _sequences(contexts, dtype, device, generator):
    """A paged cache holding the given sequences, and every position's query of each."""
    batch = make_paged_batch([1] * len(contexts), contexts, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32,
                             device, generator)
    queries = [torch.randn(c, HEADS, HEAD_DIM, generator=generator).to(dtype=dtype, device=device) for c in contexts]
    return batch.key_cache.to(dtype), batch.value_cache.to(dtype), batch.block_tables, queries


def _attend(attention, cache, parts):
    """One call over `parts` = [(sequence, first position, query count)]; returns each part's output rows."""
    key_cache, value_cache, tables, queries = cache
    device = key_cache.device
    query = torch.cat([queries[s][first:first + n] for s, first, n in parts])
    starts = [0]
    for _, _, n in parts:
        starts.append(starts[-1] + n)
    seq_lens = [first + n for _, first, n in parts]
    out = attention(query, key_cache, value_cache, tables[[s for s, _, _ in parts]],
                    torch.tensor(seq_lens, dtype=torch.int32, device=device),
                    torch.tensor(starts, dtype=torch.int32, device=device), HEAD_DIM**-0.5,
                    max(n for _, _, n in parts), max(seq_lens))
    return [out[a:b] for a, b in zip(starts, starts[1:])]


def _triton_invariant(*args):
    return paged_attention_triton(*args, ordered=True, split_tokens=64)


def _torch_invariant(*args):
    return paged_attention_torch(*args, ordered=True)


@pytest.mark.parametrize("path, dtype", [("triton", torch.bfloat16), ("torch", torch.bfloat16),
                                         ("torch", torch.float32)])
def test_attention_row_is_the_same_in_every_arrangement(path, dtype, device, generator):
    attention = _triton_invariant if path == "triton" else _torch_invariant
    if path == "torch":
        device = torch.device("cpu")
    # Sequence 0 (100 tokens: 2 splits of 64), 1 (40 tokens), 2 (200 tokens: 4 splits, the batch's longest).
    cache = _sequences([100, 40, 200], dtype, device, generator)
    p = 90  # the position under test, in sequence 0's second split
    decode_alone = _attend(attention, cache, [(0, p, 1)])[0][0]
    arrangements = {
        "verification of k+1 = 5 (third row)": _attend(attention, cache, [(0, p - 2, 5)])[0][2],
        "verification beside a decode and a prefill chunk": (
            _attend(attention, cache, [(1, 39, 1), (0, p - 4, 5), (2, 150, 50)])[1][4]),
        "whole prompt as one prefill": _attend(attention, cache, [(0, 0, 100)])[0][p],
        "prefill chunk starting at 60": _attend(attention, cache, [(2, 0, 16), (0, 60, 40)])[1][p - 60],
        "catch-up of two, second row": _attend(attention, cache, [(0, p - 1, 2), (1, 0, 40)])[0][1],
    }
    for name, row in arrangements.items():
        assert torch.equal(row, decode_alone), name


@pytest.mark.parametrize("dtype, contexts", [(torch.float32, [300, 40, 200, 7]), (torch.bfloat16, [300, 40, 200, 7]),
                                            (torch.bfloat16, [60, 40, 9, 7])], ids=["fp32", "bf16", "bf16-one-split"])
def test_attention_invariant_modes_match_the_exact_attention(dtype, contexts, device, generator):
    batch = make_paged_batch([1, 5, 3, 7], contexts, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32,
                             device, generator).to(dtype)
    want = naive_attention(batch)
    tolerance = 1e-5 if dtype == torch.float32 else 1.5e-2
    assert relative_error(paged_attention_triton(*batch.args(), ordered=True), want) < tolerance
    cpu = batch.to(dtype)
    cpu_args = [a.cpu() if torch.is_tensor(a) else a for a in cpu.args()]
    assert relative_error(paged_attention_torch(*cpu_args, ordered=True), want) < tolerance


def test_attention_in_the_mode_ignores_splits_past_the_context(device, generator):
    # Under CUDA graphs max_seq_len is the graph's context class (e.g. 2048 at max_model_len 32k), not the batch's
    # longest context: the splits past each tile's context must write nothing and the merge stop at the token's own
    # last split, with the same bits as a call sized by the real contexts.
    batch = make_paged_batch([1, 5, 3, 7], [300, 40, 200, 7], HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32,
                             device, generator).to(torch.bfloat16)
    *args, max_query_len, max_seq_len = batch.args()
    padded_query = torch.cat([batch.query, torch.randn_like(batch.query[:3])])  # 3 padding tokens no sequence owns
    sized = paged_attention_triton(*args, max_query_len, max_seq_len, ordered=True, split_tokens=64)  # 5 splits
    graph_class = paged_attention_triton(padded_query, *args[1:], max_query_len, 2048, ordered=True,
                                         split_tokens=64)  # 32 splits
    assert torch.equal(graph_class[:-3], sized)
    assert torch.equal(graph_class[-3:], torch.zeros_like(graph_class[-3:]))
    assert relative_error(sized, naive_attention(batch)) < 1.5e-2


# -- RMSNorm and SiLU -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_are_invariant(dtype, device, generator):
    # Each row carries its residual beside it: [x | residual]. 70 x 96 for the one-program-per-row GPU kernel; the
    # ordered reference at 32 x 40000, above torch's parallel grain: a row alone has its sum split over threads, a row
    # of the batch does not (in float32 that changes about one row in four here).
    def ordered(width):
        return lambda r: add_rms_norm_torch(r[:, :width], r[:, width:], weight[:width], 1e-6, ordered=True)[0]

    def on_device(r):
        r = r.to(device)
        return add_rms_norm_triton(r[:, :96], r[:, 96:], weight[:96].to(device), 1e-6)[0]

    wide = torch.randn(32, 2 * 40000, generator=generator).to(dtype)
    weight = torch.randn(40000, generator=generator).to(dtype)
    got = _row_invariance(ordered(40000), wide, rows=range(32))
    default = add_rms_norm_torch(wide[:, :40000], wide[:, 40000:], weight, 1e-6)[0]
    torch.testing.assert_close(got, default, rtol=1e-2, atol=1e-2)
    _row_invariance(on_device, torch.randn(70, 2 * 96, generator=generator).to(dtype))


def test_silu_mul_ordered_is_invariant_and_equals_the_batched_values(generator):
    # 16 x 40003 float32: above torch's parallel grain, so the default cuts rows between threads' chunks, and an odd
    # width, so the cut falls at another SIMD alignment alone than in the batch (some rows differ in the last bit).
    gate_up = 4 * torch.randn(16, 2 * 40003, generator=generator)
    full = _row_invariance(lambda rows: silu_mul_torch(rows, ordered=True), gate_up, rows=range(16))
    torch.testing.assert_close(full, silu_mul_torch(gate_up), rtol=1e-6, atol=1e-6)


# -- the mode against the default, through dispatch, on this machine's CPU ---------------------------------------
# Each case is a shape where torch's own CPU kernel gives some row other bits alone than in the batch (on a 2-thread
# x86 machine: linear in every row, RMSNorm and SiLU where a thread's chunk cuts a row). The mode must give every row
# its alone bits there; the default is checked to differ, so that the first check is known to decide something here
# (skipped, and only that check, on a machine whose default happens to be invariant at these shapes).

def _linear_case(generator):
    x, w = torch.randn(33, 1024, generator=generator), torch.randn(48, 1024, generator=generator)
    return lambda rows: dispatch.linear(rows, w), x


def _rms_norm_case(generator):
    x, weight = torch.randn(32, 2 * 40000, generator=generator), torch.randn(40000, generator=generator)
    return lambda rows: dispatch.add_rms_norm(rows[:, :40000], rows[:, 40000:], weight, 1e-6)[0], x


def _silu_mul_case(generator):
    return dispatch.silu_mul, 4 * torch.randn(16, 2 * 40003, generator=generator)


CONTRAST_CASES = {"linear": _linear_case, "rms_norm": _rms_norm_case, "silu_mul": _silu_mul_case}


def _rows_unlike_alone(fn, x) -> list[int]:
    full = fn(x)
    return [r for r in range(x.shape[0]) if not torch.equal(fn(x[r:r + 1])[0], full[r])]


@pytest.mark.parametrize("case", CONTRAST_CASES)
def test_the_mode_gives_every_row_its_alone_bits_on_the_cpu(case, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    monkeypatch.setattr(dispatch, "_MODE", True)
    fn, x = CONTRAST_CASES[case](torch.Generator().manual_seed(30))
    assert _rows_unlike_alone(fn, x) == []


@pytest.mark.parametrize("case", CONTRAST_CASES)
def test_the_default_is_not_row_invariant_at_the_same_shapes(case, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    monkeypatch.setattr(dispatch, "_MODE", False)
    fn, x = CONTRAST_CASES[case](torch.Generator().manual_seed(30))
    if not _rows_unlike_alone(fn, x):
        pytest.skip(f"torch's default {case} is already row-invariant at this shape on this machine")


# -- typical acceptance (lossy, opt-in; the mode makes it batch-invariant too) ----------------------------------

def _typical_case():
    # k = 1 over a 40003-token vocabulary: one entropy row per sequence, which torch's default sum splits over threads
    # when the row is alone and not in a batch (the contrast below).
    generator = torch.Generator().manual_seed(30)
    probs = torch.softmax(3 * torch.randn(8, 2, 40003, generator=generator), dim=-1)
    drafts = probs[:, 0].argmax(-1, keepdim=True)
    drafts[::2] = torch.randint(0, 40003, (4, 1), generator=generator)  # half the proposals fail
    return probs, drafts, torch.ones(8, dtype=torch.int64), torch.rand(8, 2, generator=generator)


def _bound_rows_unlike_alone(probs, ordered: bool) -> list[int]:
    bound = typical_bound(probs[:, :1], 0.09, 0.3, ordered)
    return [r for r in range(8) if not torch.equal(typical_bound(probs[r:r + 1, :1], 0.09, 0.3, ordered)[0], bound[r])]


def test_typical_acceptance_in_the_mode_gives_a_row_its_alone_result(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    monkeypatch.setattr(dispatch, "_MODE", True)
    entropy_sums = []
    monkeypatch.setattr(typical_acceptance, "ordered_sum", lambda x: entropy_sums.append(x.shape) or ordered_sum(x))
    probs, drafts, num_draft, uniforms = _typical_case()
    tokens, accepted = dispatch.typical_accept(probs, drafts, num_draft, uniforms, 0.09, 0.3)
    assert entropy_sums, "the mode's typical acceptance must sum the entropy in the fixed order"
    assert accepted.tolist() == [0, 1] * 4
    for r in range(8):
        alone = dispatch.typical_accept(probs[r:r + 1], drafts[r:r + 1], num_draft[r:r + 1], uniforms[r:r + 1], 0.09,
                                        0.3)
        assert torch.equal(alone[0][0], tokens[r]) and torch.equal(alone[1][0], accepted[r]), f"row {r}"
    assert _bound_rows_unlike_alone(probs, ordered=True) == []  # the bits the acceptance test compares against


def test_the_default_entropy_sum_is_not_row_invariant_at_the_same_shape():
    if not _bound_rows_unlike_alone(_typical_case()[0], ordered=False):
        pytest.skip("torch's default entropy sum is already row-invariant at this shape on this machine")
