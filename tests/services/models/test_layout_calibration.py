"""Weight layouts chosen by measurement: the fastest candidate by timing, cached per machine and model, explicit
requests and non-float32 models never timed, and the target never given a layout that changes its arithmetic."""

import json

import pytest
import torch

from specsplit.services.local_engine import LocalEngine
from specsplit.services.models import commands, layout_calibration
from specsplit.services.models.layout_calibration import (
    LAYOUTS_ENV,
    MatmulTimer,
    candidate_layouts,
    choose_layout,
    read_cache,
    role_rows,
    use_calibrated_layout,
)
from specsplit.services.models.loader import load_model
from specsplit.services.models.weight_formats import Bf16Linear, DualLinear, PackedLinear
from tiny_models import build_model, save_model


@pytest.fixture(scope="module")
def float32_model(tmp_path_factory):
    return save_model(build_model("qwen2", seed=5), tmp_path_factory.mktemp("calibration") / "model")


@pytest.fixture(autouse=True)
def calibrate(monkeypatch, tmp_path):
    """Measure (conftest turns calibration off for every other test) into a cache of this test's own."""
    monkeypatch.setenv(LAYOUTS_ENV, "calibrate")
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(layout_calibration, "TIME_PER_MEASUREMENT_S", 0.01)  # tiny models: a few repetitions do


class ScriptedTimer:
    """Seconds per layout and row count as scripted; records every call."""

    def __init__(self, seconds: dict[str, dict[int, float]]):
        self.seconds, self.calls = seconds, []

    def __call__(self, layouts, rows):
        self.calls.append((tuple(layouts), rows))
        return {layout: self.seconds[layout][rows] for layout in layouts}


def test_the_fastest_candidate_for_the_roles_rows_wins(float32_model, tmp_path):
    loaded = load_model(str(float32_model))
    # dense wins at 1 row (by 4%: within the margin), packed at 5: a target-only target and a verifying one choose
    # differently.
    timer = ScriptedTimer({"dense": {1: 0.0115, 5: 0.030}, "packed": {1: 0.012, 5: 0.014}})
    alone = choose_layout(loaded, "auto", "target", role_rows("target", 0), timer, tmp_path / "a.json")
    verifying = choose_layout(loaded, "auto", "target", role_rows("target", 4), timer, tmp_path / "a.json")
    assert (alone.layout, verifying.layout) == ("dense", "packed")
    # the verifying target's one-row steps are timed too (it runs them while its draft does not pay)
    assert timer.calls == [(("dense", "packed"), 1), (("dense", "packed"), 5), (("dense", "packed"), 1)]
    assert verifying.ms == pytest.approx({"dense": 30.0, "packed": 14.0})
    assert verifying.one_row_ms == pytest.approx({"dense": 11.5, "packed": 12.0})
    assert "packed" in verifying.describe("m") and "dense 30.0 ms" in verifying.describe("m")


def test_a_verifying_target_takes_the_mapped_dual_layout_where_dense_steps_one_row_clearly_faster(
        float32_model, tmp_path):
    timer = ScriptedTimer({"dense": {1: 0.010, 5: 0.030}, "packed": {1: 0.012, 5: 0.014}})
    loaded = load_model(str(float32_model))
    linear_bytes = sum(m.weight.numel() * 4 for m in loaded.model.modules() if isinstance(m, torch.nn.Linear))
    choice = use_calibrated_layout(loaded, "auto", "target", role_rows("target", 4), timer, tmp_path / "a.json")
    assert choice.layout == loaded.weight_format == "dual"
    # dropped pages are judged against an eighth of the read rate measured: all linear bytes in 10 ms
    floors = [m.min_bytes_per_s for m in loaded.model.modules() if isinstance(m, DualLinear)]
    assert floors == pytest.approx([linear_bytes / 0.010 / 8] * len(floors))
    assert "dense 10.0 ms, packed 12.0 ms" in choice.describe("m") and "mapped from the file" in choice.describe("m")
    layers = [m for m in loaded.model.modules() if isinstance(m, DualLinear)]
    assert layers and all(m.weight is None and m.dense_parts for m in layers if m is not loaded.model.lm_head)
    # a later start reads the choice from the cache, timing nothing
    again = choose_layout(load_model(str(float32_model)), "auto", "target", role_rows("target", 4), timer,
                          tmp_path / "a.json")
    assert (again.layout, again.source, len(timer.calls)) == ("dual", "cached", 2)


def test_no_dual_layout_by_auto_where_the_checkpoint_cannot_be_mapped(float32_model, tmp_path, monkeypatch):
    timer = ScriptedTimer({"dense": {1: 0.010, 5: 0.030}, "packed": {1: 0.012, 5: 0.014}})
    monkeypatch.setattr(layout_calibration, "mapped_checkpoint", lambda loaded: None)  # a GGUF, a bf16 file
    choice = choose_layout(load_model(str(float32_model)), "auto", "target", role_rows("target", 4), timer,
                           tmp_path / "a.json")
    assert choice.layout == "packed" and timer.calls == [(("dense", "packed"), 5)]


def test_the_dual_layout_is_taken_only_when_asked_for_and_warns_where_memory_looks_short(float32_model, monkeypatch,
                                                                                         caplog):
    loaded = load_model(str(float32_model))
    monkeypatch.setattr(layout_calibration, "room_for_dual", lambda loaded: True)
    choice = choose_layout(loaded, "dual", "target", role_rows("target", 4))
    assert (choice.layout, choice.source) == ("dual", "requested") and "dense up to 2 rows" in choice.describe("m")
    assert not caplog.records
    monkeypatch.setattr(layout_calibration, "room_for_dual", lambda loaded: False)
    assert choose_layout(loaded, "dual", "target", role_rows("target", 4)).layout == "dual"  # asked for: kept
    assert "dual layout's second copy" in caplog.text


def test_the_free_memory_for_dual_is_the_containers_where_it_has_a_limit(tmp_path):
    v2, v1, none = tmp_path / "v2", tmp_path / "v1", tmp_path / "none"
    (v2 / "pod").mkdir(parents=True)
    (v2 / "pod" / "memory.max").write_text("17179869184\n")
    (v2 / "pod" / "memory.current").write_text("4294967296\n")
    own = tmp_path / "cgroup"
    own.write_text("0::/pod\n")
    assert layout_calibration.cgroup_memory_left(v2, own) == 12 * 1024 ** 3
    (v2 / "pod" / "memory.max").write_text("max\n")
    assert layout_calibration.cgroup_memory_left(v2, own) is None
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(8 * 1024 ** 3))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(9 * 1024 ** 3))
    assert layout_calibration.cgroup_memory_left(v1, tmp_path / "absent") == 0
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's "no limit"
    assert layout_calibration.cgroup_memory_left(v1, tmp_path / "absent") is None
    none.mkdir()
    assert layout_calibration.cgroup_memory_left(none, tmp_path / "absent") is None


def test_the_dual_layout_splits_rows_between_its_copies(float32_model):
    loaded = load_model(str(float32_model))
    linear = loaded.model.model.layers[0].mlp.gate_up_proj
    dual = DualLinear(linear, dense_rows=2)
    seen = []
    dual.packed.register_forward_hook(lambda *_: seen.append("packed"))
    with torch.no_grad():
        for rows in (1, 2, 3, 5):
            x = torch.randn(rows, linear.in_features)
            torch.testing.assert_close(dual(x), linear(x), rtol=1e-5, atol=1e-5)
    assert seen == ["packed", "packed"]  # 3 and 5 rows; 1 and 2 ran dense
    assert dual.weight.data_ptr() == linear.weight.data_ptr()  # the dense copy is the model's own


def test_weights_of_row_counts_add_up(float32_model, tmp_path):
    loaded = load_model(str(float32_model))
    # Per round: 1 forward of 5 rows and 3 of 1 row. int8 is best at 1 row, packed at 5; weighted, packed wins.
    timer = ScriptedTimer({"dense": {1: 0.010, 5: 0.030}, "packed": {1: 0.011, 5: 0.012},
                           "int8": {1: 0.009, 5: 0.030}, "bf16": {1: 0.5, 5: 0.5}})
    rows = {1: 3.0, 5: 1.0}
    choice = choose_layout(loaded, "auto", "draft", rows, timer, tmp_path / "b.json")
    assert choice.ms["int8"] == pytest.approx(1000 * (3 * 0.009 + 0.030))
    assert choice.ms["packed"] == pytest.approx(1000 * (3 * 0.011 + 0.012))
    assert choice.layout == "packed"


@pytest.mark.parametrize("packed_seconds, chosen", [(0.0095, "dense"), (0.0085, "packed")])
def test_the_default_stays_unless_another_layout_is_clearly_faster(float32_model, tmp_path, packed_seconds, chosen):
    """A target decoding alone defaults to dense: packed 5% faster is within a busy machine's noise, 15% is not."""
    loaded = load_model(str(float32_model))
    timer = ScriptedTimer({"dense": {1: 0.010}, "packed": {1: packed_seconds}})
    choice = choose_layout(loaded, "auto", "target", {1: 1.0}, timer, tmp_path / "m.json")
    assert choice.layout == chosen
    assert ("the default" in choice.describe("m")) == (chosen == "dense")


def test_recalibrate_measures_again_and_replaces_the_cached_choice(float32_model, tmp_path, monkeypatch):
    loaded = load_model(str(float32_model))
    cache = tmp_path / "r.json"
    choose_layout(loaded, "auto", "target", {1: 1.0}, ScriptedTimer({"dense": {1: 0.01}, "packed": {1: 0.05}}), cache)
    monkeypatch.setenv(LAYOUTS_ENV, "recalibrate")
    again = choose_layout(loaded, "auto", "target", {1: 1.0}, ScriptedTimer({"dense": {1: 0.05}, "packed": {1: 0.01}}), cache)
    assert (again.layout, again.source) == ("packed", "measured")
    assert [e["layout"] for e in read_cache(cache).values()] == ["packed"]


def test_a_cache_hit_times_nothing_and_the_key_separates_roles_and_rows(float32_model, tmp_path):
    loaded = load_model(str(float32_model))
    cache = tmp_path / "layouts.json"
    timer = ScriptedTimer({"dense": {1: 0.010, 5: 0.050}, "packed": {1: 0.020, 5: 0.010}})
    first = choose_layout(loaded, "auto", "target", {1: 1.0}, timer, cache)
    assert (first.layout, first.source, len(timer.calls)) == ("dense", "measured", 1)
    entry = next(iter(read_cache(cache).values()))
    assert entry["cpu"] == layout_calibration.cpu_model() and entry["torch"] == torch.__version__
    assert entry["threads"] == torch.get_num_threads() and entry["layout"] == "dense"

    def no_timing(layouts, rows):
        raise AssertionError("a cached choice must not be measured again")

    again = choose_layout(loaded, "auto", "target", {1: 1.0}, no_timing, cache)
    assert (again.layout, again.source, again.ms) == ("dense", "cached", first.ms)
    other_rows = choose_layout(loaded, "auto", "target", {5: 1.0}, timer, cache)  # a new key: measured
    assert (other_rows.layout, other_rows.source) == ("dual", "measured")  # packed verifies, dense steps one row
    assert len(read_cache(cache)) == 2


def test_explicit_requests_and_non_float32_models_skip_calibration(float32_model, tmp_path, tiny_pair):
    def no_timing(layouts, rows):
        raise AssertionError("an explicit layout must not be measured")

    loaded = load_model(str(float32_model))
    choice = use_calibrated_layout(loaded, "dense", "target", {5: 1.0}, no_timing, tmp_path / "c.json")
    assert (choice.layout, choice.source, loaded.weight_format) == ("dense", "requested", "dense")
    packed = load_model(str(float32_model))
    assert use_calibrated_layout(packed, "packed", "target", {1: 1.0}, no_timing, tmp_path / "c.json").layout == "packed"
    float64 = load_model(str(tiny_pair["target"]), dtype="float64")
    assert choose_layout(float64, "auto", "draft", {1: 4.0}, no_timing, tmp_path / "c.json").layout == "dense"
    assert not (tmp_path / "c.json").exists()


def test_the_target_is_only_ever_offered_float32_layouts(float32_model, tmp_path, monkeypatch):
    monkeypatch.setattr(layout_calibration, "native_bf16", lambda: True)  # as on a CPU with avx512_bf16
    assert set(candidate_layouts("target")) == {"dense", "packed"}
    assert "bf16" in candidate_layouts("draft") and "int8" in candidate_layouts("draft")
    loaded = load_model(str(float32_model))
    # bf16 and int8 would be "fastest" for the target too: never offered, never timed, never chosen.
    timer = ScriptedTimer({"dense": {1: 0.5}, "packed": {1: 0.4}, "int8": {1: 0.001}, "bf16": {1: 0.001}})
    choice = use_calibrated_layout(loaded, "auto", "target", {1: 1.0}, timer, tmp_path / "d.json")
    assert choice.layout == "packed" and set(choice.ms) == {"dense", "packed"}
    assert all(p.dtype == torch.float32 for p in loaded.model.buffers() if p.is_floating_point())
    draft = load_model(str(float32_model))
    assert use_calibrated_layout(draft, "auto", "draft", {1: 4.0}, timer, tmp_path / "d.json").layout in ("int8", "bf16")


def test_a_real_calibration_times_every_candidate_and_converts_the_model(float32_model):
    """No injected timer: real timing of a tiny model's layers, cached in SPECSPLIT_CACHE, converted to the winner."""
    loaded = load_model(str(float32_model))
    choice = use_calibrated_layout(loaded, "auto", "draft", role_rows("draft", 4))
    assert set(choice.ms) == set(candidate_layouts("draft")) and all(ms > 0 for ms in choice.ms.values())
    assert choice.layout == loaded.weight_format
    assert choice.layout == layout_calibration.pick(choice.ms, layout_calibration.default_layout("draft", choice.rows))
    assert choice.seconds < 5
    entries = read_cache(layout_calibration.default_cache_file())
    assert [e["layout"] for e in entries.values()] == [choice.layout]


def test_the_matmul_timer_times_converted_copies_and_leaves_the_model_dense(float32_model):
    loaded = load_model(str(float32_model))
    timer = MatmulTimer(loaded.model)
    seconds = timer(("dense", "packed", "bf16"), 3)
    assert set(seconds) == {"dense", "packed", "bf16"} and all(s > 0 for s in seconds.values())
    assert isinstance(timer._converted["packed"][1], PackedLinear) and isinstance(timer._converted["bf16"][1], Bf16Linear)
    assert all(isinstance(m, torch.nn.Linear) for m in timer.layer_linears) and loaded.weight_format == "dense"
    assert not any(isinstance(m, (PackedLinear, Bf16Linear)) for m in loaded.model.modules())


def test_the_engine_reports_its_choices_and_models_list_shows_them(float32_model, monkeypatch, capsys):
    engine = LocalEngine(str(float32_model), str(float32_model), num_speculative_tokens=3)
    assert engine.layouts["target"].rows == {4: 1.0} and engine.layouts["draft"].rows == {1: 3.0}
    assert engine.layouts["target"].layout in ("dense", "packed", "dual")  # dual: where dense steps one row faster
    assert engine.target.weight_format == engine.layouts["target"].layout
    assert commands.main(["list"]) == 0
    out = capsys.readouterr().out
    listed = [line for line in out.splitlines() if line.startswith("  model ")]
    assert len(listed) == 2, out
    assert any("target (rows 4, " in line and f": {engine.layouts['target'].layout}" in line for line in listed)
    assert any("draft (rows 3x1, " in line and f": {engine.layouts['draft'].layout}  [" in line for line in listed)


def test_bf16_draft_is_close_to_its_dense_self_and_refused_for_a_target(float32_model):
    from specsplit.services.errors import InvalidArgument
    from specsplit.services.models.weight_formats import use_weight_format

    linear = build_model("qwen2", seed=5).model.layers[0].mlp.down_proj.float()
    x = torch.randn(4, linear.in_features)
    dense, bf16 = linear(x), Bf16Linear(linear)(x)
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, dense)
    assert (bf16 - dense).norm() / dense.norm() < 0.02
    with pytest.raises(InvalidArgument, match="drafts only"):
        use_weight_format(load_model(str(float32_model)), "bf16", "target")


def test_a_cache_for_another_machine_is_not_listed(tmp_path, capsys):
    cache = layout_calibration.default_cache_file()
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"k": {"cpu": "Some Other CPU", "cores": 2, "torch": torch.__version__,
                                       "layout": "packed", "model": "x", "role": "target", "rows": {"1": 1.0}}}))
    assert commands.main(["list"]) == 0
    assert "none measured yet" in capsys.readouterr().out
