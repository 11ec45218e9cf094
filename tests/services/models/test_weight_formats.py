"""CPU weight formats: packed float32 computes what dense does; an int8 draft changes acceptance, never outputs."""

import asyncio

import pytest
import torch

from specsplit.services.errors import InvalidArgument
from specsplit.services.local_engine import LocalEngine
from specsplit.services.models.loader import load_model
from specsplit.services.models.weight_formats import (
    DualLinear,
    Int8DynamicLinear,
    PackedLinear,
    resolve_weight_format,
    use_weight_format,
)
from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner
from specsplit.services.sampling_params import SamplingParams
from tiny_models import build_model, byte_tokenizer, perturbed_copy, save_model

PROMPTS = ["def add(a, b):", "The quick brown fox", "1, 2, 3, 5, 8,", "x"]


@pytest.fixture(scope="module")
def float32_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp32")
    target = build_model("qwen2", seed=3)
    return save_model(target, root / "target"), save_model(perturbed_copy(target, noise=0.02), root / "draft")


def test_auto_chooses_per_role_device_and_dtype():
    cpu = torch.device("cpu")
    assert resolve_weight_format("auto", "target", cpu, torch.float32) == "packed"
    assert resolve_weight_format("auto", "draft", cpu, torch.float32) == "int8"
    assert resolve_weight_format("auto", "draft", cpu, torch.float64) == "dense"
    assert resolve_weight_format("auto", "target", torch.device("cuda"), torch.bfloat16) == "dense"
    assert resolve_weight_format("dense", "target", cpu, torch.float32) == "dense"


@pytest.mark.parametrize(
    "requested, role, dtype, message",
    [
        ("int8", "target", torch.float32, "drafts only"),
        ("packed", "target", torch.float64, "float32 weights on the CPU"),
        ("int8", "draft", torch.bfloat16, "float32 weights on the CPU"),
        ("fp8", "draft", torch.float32, "must be one of"),
    ],
)
def test_bad_requests_are_refused_clearly(requested, role, dtype, message):
    with pytest.raises(InvalidArgument, match=message):
        resolve_weight_format(requested, role, torch.device("cpu"), dtype)


def _last_logits(loaded, ids):
    runner = ModelRunner(loaded, num_blocks=32)
    table = runner.block_manager.allocate(0)
    item = ForwardItem(table, ids, 3)
    assert runner.reserve([item]) == [None]
    return runner.forward([item])[0]


def test_packed_target_computes_the_dense_logits(float32_pair):
    ids = byte_tokenizer().encode(PROMPTS[0])
    dense = load_model(str(float32_pair[0]))
    packed = load_model(str(float32_pair[0]))
    assert use_weight_format(packed, "packed", "target") == "packed"
    layers = list(packed.model.modules())
    assert any(isinstance(m, PackedLinear) for m in layers)
    assert not any(isinstance(m, torch.nn.Linear) for m in layers)
    torch.testing.assert_close(_last_logits(packed, ids), _last_logits(dense, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_packed_weights_keep_float32_arithmetic(rows):
    """The target's packed layout must not compute in bf16 behind float32's back (oneDNN can, on CPUs with bf16
    units, when told to): its error against float64 stays at float32's level, three orders below bf16's."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(1536, 1536)
    x = torch.randn(rows, 1536)
    exact = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())

    def error(y):
        return ((y.double() - exact).abs().max() / exact.abs().max()).item()

    assert error(PackedLinear(linear)(x)) < 1e-5
    assert error(torch.nn.functional.linear(x, linear.weight.bfloat16().float(), linear.bias)) > 1e-4


def test_int8_draft_is_close_to_its_dense_self(float32_pair):
    ids = byte_tokenizer().encode(PROMPTS[0])
    dense = _last_logits(load_model(str(float32_pair[1])), ids)
    quantized = load_model(str(float32_pair[1]))
    use_weight_format(quantized, "int8", "draft")
    assert any(isinstance(m, Int8DynamicLinear) for m in quantized.model.modules())
    int8 = _last_logits(quantized, ids)
    assert not torch.equal(int8, dense)  # it is a different distribution...
    assert (int8 - dense).norm() / dense.norm() < 0.1  # ...and a close one (a broken conversion is ~1)


def test_converting_twice_is_a_no_op_and_switching_is_refused(float32_pair):
    loaded = load_model(str(float32_pair[0]))
    use_weight_format(loaded, "packed", "target")
    before = [id(m) for m in loaded.model.modules()]
    use_weight_format(loaded, "packed", "target")
    assert [id(m) for m in loaded.model.modules()] == before
    with pytest.raises(InvalidArgument, match="already holds packed"):
        use_weight_format(loaded, "dense", "target")


def _greedy(engine, k):
    tok = byte_tokenizer()

    async def run():
        results = await asyncio.gather(*(
            engine.generate(tok.encode(p), SamplingParams(max_tokens=20, ignore_eos=True, num_speculative_tokens=k))
            for p in PROMPTS
        ))
        await engine.coordinator.wait_idle()
        return results

    return asyncio.run(run())


def test_int8_draft_never_changes_greedy_output(float32_pair):
    target, draft = (str(p) for p in float32_pair)
    target_only = LocalEngine(target, None, num_speculative_tokens=0, target_weights="packed")
    expected = [r.token_ids for r in _greedy(target_only, 0)]
    for draft_weights in ("int8", "dense"):
        engine = LocalEngine(target, draft, num_speculative_tokens=4, target_weights="packed", draft_weights=draft_weights)
        results = _greedy(engine, 4)
        assert [r.token_ids for r in results] == expected, draft_weights
        assert sum(r.stats.accepted_tokens for r in results) > 0  # the draft was used, not bypassed
        assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_a_dual_layout_target_gives_the_target_alones_greedy_output(float32_pair, tmp_path):
    """A speculating target in the dual layout computes one sequence's tokens with both of its copies (one-row rounds
    dense, verifications and prefills packed): its greedy output is the dense target's alone. An unrelated draft, so
    that the policy runs plain one-row rounds, and requests of a fixed k = 4, so that verifications run packed."""
    target = str(float32_pair[0])
    unrelated = save_model(build_model("qwen2", seed=11), tmp_path / "unrelated")
    tok = byte_tokenizer()
    target_only = LocalEngine(target, None, num_speculative_tokens=0, target_weights="dense")
    dual = LocalEngine(target, str(unrelated), num_speculative_tokens=4, target_weights="dual")
    assert dual.target.weight_format == "dual"
    rows_seen = []
    layer = next(m for m in dual.target.model.modules() if isinstance(m, DualLinear))
    assert layer.weight is None and len(layer.dense_parts) == 3  # q, k, v mapped from the checkpoint file
    layer.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].numel() // module.in_features))

    def one_at_a_time(engine, speculation):
        async def run():
            out = []
            for prompt in PROMPTS:
                params = SamplingParams(max_tokens=24, ignore_eos=True, speculation=speculation,
                                        num_speculative_tokens=4 if speculation else None)
                out.append((await engine.generate(tok.encode(prompt), params)).token_ids)
            await engine.coordinator.wait_idle()
            return out
        return asyncio.run(run())

    expected = one_at_a_time(target_only, None)
    assert one_at_a_time(dual, None) == expected
    assert one_at_a_time(dual, "fixed") == expected
    assert any(r == 1 for r in rows_seen) and 5 in rows_seen  # both copies computed decode tokens
    assert dual.kv_blocks_used() == {"target": 0, "draft": 0}


def test_onednn_caches_are_bounded_before_any_model_loads_unless_the_operator_says_otherwise():
    """oneDNN and ideep keep buffers per cached shape; 1024 of each grew a packed target by 0.3-0.55 GB."""
    import os
    import subprocess
    import sys

    probe = "import os, specsplit.services.models.weight_formats; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])"
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["16", "16"]
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["256", "16"]


def test_the_dual_layouts_dense_half_is_the_checkpoint_file_mapped(float32_pair, tmp_path):
    """Mapped: every layer's dense weight (a fused layer's parts stacked) is the loaded weight, so the dual layout
    keeps no copy of its own; a checkpoint not in float32 maps nothing, and the dual layout keeps the dense weights."""
    from specsplit.services.models.mapped_weights import MappedCheckpoint
    from specsplit.services.models.weight_formats import apply_weight_format, extra_bytes, mapped_checkpoint

    dense = load_model(str(float32_pair[0]))
    mapped = mapped_checkpoint(dense)
    linears = {name: m for name, m in dense.model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, m in linears.items():
        parts = mapped.dense_parts(name, m.weight)
        if m.weight is dense.model.model.embed_tokens.weight:
            continue  # a tied head: the embedding's weight, not in the file as lm_head
        assert parts is not None and torch.equal(torch.cat(parts), m.weight), name
    assert extra_bytes(dense.model, "dual", mapped) == 0 < extra_bytes(dense.model, "dual")

    dual = load_model(str(float32_pair[0]))
    assert use_weight_format(dual, "dual", "target") == "dual"
    for name, m in dual.model.named_modules():
        if isinstance(m, DualLinear) and m.dense_parts:
            x = torch.randn(1, m.in_features)
            torch.testing.assert_close(m(x), linears[name](x), rtol=1e-6, atol=1e-6)  # one row: the file's weights
            torch.testing.assert_close(m(x.repeat(5, 1)), linears[name](x.repeat(5, 1)), rtol=1e-4, atol=1e-4)

    bf16_folder = save_model(build_model("qwen2", seed=5).to(torch.bfloat16), tmp_path / "bf16")
    assert len(MappedCheckpoint(bf16_folder)) == 0  # nothing float32 to map
    copied = load_model(str(float32_pair[0]))
    apply_weight_format(copied.model, "dual", MappedCheckpoint(bf16_folder))
    assert all(m.dense_parts is None and m.weight is not None for m in copied.model.modules()
               if isinstance(m, DualLinear))


def test_a_mapped_layer_whose_pages_were_dropped_steps_one_row_packed_for_a_while_then_tries_again(monkeypatch):
    """Under memory pressure the kernel drops the mapped file's pages and a one-row step would read them back from
    disk: a dense call slower than the layer's floor sends its small calls to packed for MAPPED_RETRY_CALLS calls."""
    from specsplit.services.models import weight_formats

    monkeypatch.setattr(weight_formats, "MAPPED_RETRY_CALLS", 3)
    torch.manual_seed(0)
    linear = torch.nn.Linear(1024, 2048)  # 8 MB of weights: judged by its calls' times
    now = [0.0]
    layer = DualLinear(linear, dense_parts=[linear.weight.detach()[:1024], linear.weight.detach()[1024:]],
                       clock=lambda: now[0])
    layer.min_bytes_per_s = 1e9  # 8 MB in 8 ms or less: memory speed
    dense_calls, packed_calls = [], []
    monkeypatch.setattr(layer.packed, "forward", lambda x: packed_calls.append(1) or torch.zeros(x.shape[0], 2048))
    real_linear = torch.nn.functional.linear

    def timed_linear(x, w, b=None):
        dense_calls.append(1)
        now[0] += seconds_per_part
        return real_linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", timed_linear)
    x = torch.randn(1, 1024)
    seconds_per_part = 0.001  # 2 ms for 8 MB: in memory
    layer(x)
    assert (len(dense_calls), len(packed_calls), layer.packed_calls_left) == (2, 0, 0)
    seconds_per_part = 0.5  # a second for 8 MB: read back from disk
    layer(x)
    assert layer.packed_calls_left == 3
    for _ in range(3):
        layer(x)
    assert (len(dense_calls), len(packed_calls)) == (4, 3)  # three calls packed, none dense
    layer(x)  # the try: still dropped, so twice as long packed
    assert (len(dense_calls), layer.packed_calls_left) == (6, 6)
    for _ in range(6):
        layer(x)
    seconds_per_part = 0.001  # memory came free: the next try reads at memory speed and stays dense
    layer(x)
    layer(x)
    assert (len(dense_calls), len(packed_calls), layer.packed_calls_left, layer.backoff) == (10, 9, 0, 1)
    layer(x.repeat(5, 1))  # more rows than dense_rows: packed, whatever the pages
    assert len(packed_calls) == 10
