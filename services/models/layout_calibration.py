"""Weight layouts chosen by measurement on the machine that runs them, once, then cached.

CPUs differ: one row through a dense float32 matmul is fastest on one Xeon, oneDNN's packed layout is 1.4-1.7x
faster on an AMD EPYC of the same size. So "auto" on a float32 CPU model is decided by timing the candidate layouts
(weight_formats.py) on the model's own matmul shapes and the row counts its role runs:
- target: dense and packed float32 only (the target stays exact: its layouts differ in the last bits at most);
  1 row per sequence when it decodes alone, k+1 when it verifies k proposals. A speculating target also runs
  one-row steps, whenever the speculation policy finds its draft does not pay (every round, with a draft that never
  agrees): where packed wins its verifications and dense its one-row steps by MARGIN, and its checkpoint's float32
  file can be mapped as the dense half (no second copy in memory: weight_formats.py, mapped_weights.py), "auto"
  takes the dual layout (`choose_dual`). A dual layout that would copy the dense weights is only taken when asked
  for (`--target-weights dual`), with a warning where the memory for the copy looks short (room_for_dual).
- draft: dense, packed, int8, and bf16 where the CPU multiplies bf16 natively; its precision never changes the
  output (the target verifies every token), only how fast it drafts and how much of it is accepted.

Only the matmuls are timed, not a whole generation: two of the model's layers and its output head, each layout
converted from the model's own weights, a few repetitions each (a few seconds on a first start). The choice is
cached in <cache>/models/layouts.json keyed by CPU model, cores, threads, torch version, model and row counts, so
later starts read it and time nothing. An explicit --weights / --target-weights / --draft-weights skips all of it;
SPECSPLIT_LAYOUTS=defaults uses weight_formats.py's fixed defaults without measuring (the tests do).
"""

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specsplit.kernels.dispatch import batch_invariant
from specsplit.services.runtime.json_cache import read_cache, write_cache
from specsplit.services.runtime.machine import cpu_model
from specsplit.services.runtime.machine import machine_key as runtime_machine_key
from specsplit.services.models.weight_formats import (
    DUAL_DENSE_ROWS,
    DualLinear,
    LINEAR_LAYOUTS,
    _int8_available,
    extra_bytes,
    mapped_checkpoint,
    resolve_weight_format,
    use_weight_format,
)

log = logging.getLogger(__name__)

LAYOUTS_ENV = "SPECSPLIT_LAYOUTS"  # "calibrate" (default), "recalibrate" (measure again, replace) or "defaults"
CACHE_FILE = "layouts.json"
# Another layout replaces the role's default (weight_formats.py) only when it measures at least this much faster: a
# measurement on a busy machine can be off by more than the few percent that separate close layouts, and a wrong
# choice is cached; the defaults are right on the CPUs measured so far wherever two layouts are close.
MARGIN = 0.10
SAMPLED_LAYERS = 2  # layers timed per layout; the rest are assumed alike (every layer has the same shapes)
# Each layout at a row count is timed until this much time per layout has gone or MAX_REPEATS were run (at least
# MIN_REPEATS), taking turns with the other layouts.
TIME_PER_MEASUREMENT_S = 0.3
MIN_REPEATS, MAX_REPEATS = 3, 15

# A timer: (layouts, rows) -> {layout: seconds that one forward's matmuls take at that many rows}. Tests inject one.
Timer = Callable[[tuple[str, ...], int], dict[str, float]]


@dataclass
class LayoutChoice:
    layout: str
    role: str
    rows: dict[int, float]  # row count -> how many such forwards a round runs (the weights of the cost)
    ms: dict[str, float] = field(default_factory=dict)  # layout -> weighted matmul milliseconds per round
    seconds: float = 0.0  # what the measurement took (0 when read from the cache or not measured)
    source: str = "measured"  # measured | cached | requested | defaults | held
    default: str | None = None  # the role's default layout, kept when no other was MARGIN faster
    one_row_ms: dict[str, float] = field(default_factory=dict)  # a speculating target's one-row steps (choose_dual)

    def describe(self, model: str) -> str:
        """One line: what was chosen for what, and why."""
        rows = "+".join(f"{w:g}x{r}" if w != 1 else str(r) for r, w in sorted(self.rows.items()))
        layout = self.layout + (f" (dense up to {DUAL_DENSE_ROWS} rows, packed above)" if self.layout == "dual" else "")
        head = f"{model} ({self.role}, rows {rows}): {layout}"
        if not self.ms:
            return f"{head} ({self.source})"
        others = ", ".join(f"{name} {ms:.1f} ms" for name, ms in sorted(self.ms.items(), key=lambda kv: kv[1]))
        how = f"measured in {self.seconds:.1f} s" if self.source == "measured" else self.source
        if self.layout == "dual":
            one_row = ", ".join(f"{name} {ms:.1f} ms" for name, ms in sorted(self.one_row_ms.items()))
            why = f"packed verifies fastest, dense steps one row fastest ({one_row}); dense half mapped from the file"
        elif self.layout == min(self.ms, key=self.ms.get):
            why = "the fastest"
        else:
            why = f"the default, none other {MARGIN:.0%} faster"
        return (f"{head} ({why}) - matmuls per round: {others} ({how} on {cpu_model()}, "
                f"{torch.get_num_threads()} threads)")


def native_bf16() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def candidate_layouts(role: str) -> tuple[str, ...]:
    if role == "target":  # float32 only: anything else would change the output
        return ("dense", "packed") if torch.backends.mkldnn.is_available() else ("dense",)
    layouts = ["dense"]
    if torch.backends.mkldnn.is_available():
        layouts.append("packed")
    if _int8_available():
        layouts.append("int8")
    if native_bf16():
        layouts.append("bf16")
    return tuple(layouts)


def role_rows(role: str, num_speculative_tokens: int, batch_sizes: tuple[int, ...] = (1,)) -> dict[int, float]:
    """The row counts a role's forwards run per round, for each batch size in use: a target decodes 1 row per
    sequence alone and verifies k+1 when speculating; a draft proposes one row at a time, k times a round."""
    k = num_speculative_tokens
    if role == "target":
        return {b * (k + 1): 1.0 for b in batch_sizes}
    return {b: float(max(k, 1)) for b in batch_sizes}


def default_layout(role: str, rows: dict[int, float]) -> str:
    """weight_formats.py's fixed defaults: dense for a target decoding one row at a time, packed when it verifies."""
    if role == "target" and max(rows) == 1:
        return "dense"
    return resolve_weight_format("auto", role, torch.device("cpu"), torch.float32)


def choose_layout(loaded, requested: str, role: str, rows: dict[int, float], timer: Timer | None = None,
                  cache_file: Path | None = None) -> LayoutChoice:
    """The layout to use for `loaded` in `role`: `requested` if explicit, else measured (or read from the cache)."""
    if requested != "auto":
        if requested == "dual" and not room_for_dual(loaded):
            log.warning("%s: the dual layout's second copy (%.1f GB) leaves less than %g times its size free in this "
                        "machine's or container's memory (--target-weights packed or dense hold one copy)",
                        loaded.name, extra_bytes(loaded.model, "dual") / 1e9, DUAL_MEMORY_FACTOR)
        return LayoutChoice(requested, role, rows, source="requested")
    if loaded.weight_format != "dense":  # converted by its caller already: keep what it holds
        return LayoutChoice(loaded.weight_format, role, rows, source="held")
    param = next(loaded.model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32 or batch_invariant():
        return LayoutChoice(resolve_weight_format("auto", role, param.device, param.dtype), role, rows, source="defaults")
    candidates = candidate_layouts(role)
    if os.environ.get(LAYOUTS_ENV, "calibrate") == "defaults" or len(candidates) == 1:
        return LayoutChoice(default_layout(role, rows), role, rows, source="defaults")
    cache_file = cache_file or default_cache_file()
    dual_possible = role == "target" and min(rows) > DUAL_DENSE_ROWS and "packed" in candidates and \
        mapped_dual_fits(loaded)
    # A choice that may be dual is cached apart: entries made before one-row steps were timed do not answer it.
    key = cache_key(loaded, role, rows) + ("|one-row steps timed" if dual_possible else "")
    cached = None if os.environ.get(LAYOUTS_ENV) == "recalibrate" else read_cache(cache_file).get(key)
    if cached is not None and (cached.get("layout") in candidates or (cached.get("layout") == "dual" and dual_possible)):
        choice = LayoutChoice(cached["layout"], role, rows, cached.get("ms", {}), 0.0, "cached",
                              one_row_ms=cached.get("one_row_ms", {}))
        log.info("layout %s", choice.describe(loaded.name))
        return choice
    started = time.perf_counter()
    timer = timer or MatmulTimer(loaded.model)
    ms = dict.fromkeys(candidates, 0.0)
    per_rows: dict[str, dict[int, float]] = {layout: {} for layout in candidates}
    for r, weight in rows.items():
        for layout, seconds in timer(candidates, r).items():
            ms[layout] += 1000 * weight * seconds
            per_rows[layout][r] = seconds
    choice = LayoutChoice(pick(ms, default_layout(role, rows)), role, rows, ms, 0.0, "measured")
    if dual_possible and choice.layout == "packed":
        one_row = timer(("dense", "packed"), 1)
        choice.one_row_ms = {layout: 1000 * seconds for layout, seconds in one_row.items()}
        choice.layout = choose_dual(one_row)
    choice.seconds = time.perf_counter() - started
    per_rows_ms = {name: {str(r): 1000 * t for r, t in by.items()} for name, by in per_rows.items()}
    write_cache(cache_file, key, {"layout": choice.layout, "ms": ms, "one_row_ms": choice.one_row_ms,
                                  "seconds": choice.seconds,
                                  "model": loaded.name, "role": role, "rows": {str(r): w for r, w in rows.items()},
                                  "ms_per_rows": per_rows_ms, **machine_key(), "load_avg_1m": os.getloadavg()[0],
                                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, quiet=True)
    log.warning("layout %s", choice.describe(loaded.name))
    return choice


def choose_dual(one_row: dict[str, float]) -> str:
    """A speculating target whose verifications measured fastest packed: the dual layout (dense half mapped from its
    checkpoint) where dense one-row steps measure at least MARGIN faster than packed ones, else packed."""
    return "dual" if one_row["dense"] <= (1 - MARGIN) * one_row["packed"] else "packed"


def mapped_dual_fits(loaded) -> bool:
    """Whether the dual layout's dense half can be the model's own float32 checkpoint, mapped, with room for it in
    the page cache: the machine's (or container's) free memory, page cache included, at least the mapped bytes
    (short of that, its pages would be dropped and read back from disk on one-row steps)."""
    mapped = mapped_checkpoint(loaded)
    if mapped is None or extra_bytes(loaded.model, "dual", mapped) > 0:
        return False  # some layer's dense weight is not in the file: the dual layout would keep it
    return memory_available() > extra_bytes(loaded.model, "dual")  # the bytes mapped from the file


DUAL_MEMORY_FACTOR = 4.0  # memory free for the dual layout's copies, as a multiple of what they take
MAPPED_RATE_DIVISOR = 8  # a mapped dense call slower than the calibrated read rate / this found its pages dropped


def room_for_dual(loaded) -> bool:
    """Whether there is room for the dual layout's copies (its dense weights where the checkpoint cannot be mapped):
    free memory of four times their size. The copies double the target's linear weights (6 GB more for a float32
    1.5B), and the process is rarely alone (`serve` starts the draft beside it)."""
    return memory_available() > DUAL_MEMORY_FACTOR * extra_bytes(loaded.model, "dual", mapped_checkpoint(loaded))


def memory_available() -> int:
    """The machine's free memory (MemAvailable, page cache included) or, in a container with a memory limit, what
    its cgroup has left if less; 0 where neither can be read."""
    try:
        meminfo = Path("/proc/meminfo").read_text().split("\n")
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0
    left = cgroup_memory_left()
    return available if left is None else min(available, left)


def cgroup_memory_left(root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes this process's cgroup may still use under its memory limit (cgroup v2 memory.max - memory.current, else
    v1 memory.limit_in_bytes - memory.usage_in_bytes); None without a limit or where neither can be read."""
    try:  # v2: "0::/path" (a container with its own cgroup namespace sees "0::/", its limit at the root)
        v2 = next(line[3:].strip().lstrip("/") for line in own.read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        v2 = ""
    for limit_file, usage_file in ((f"{v2}/memory.max".lstrip("/"), f"{v2}/memory.current".lstrip("/")),
                                   ("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:  # "max" (v2) or v1's huge number: no limit
            return None
        return max(int(limit) - usage, 0)
    return None


def pick(ms: dict[str, float], default: str) -> str:
    """The fastest layout, unless the default is within MARGIN of it."""
    fastest = min(ms, key=ms.get)
    if default in ms and ms[fastest] > (1 - MARGIN) * ms[default]:
        return default
    return fastest


def use_calibrated_layout(loaded, requested: str, role: str, rows: dict[int, float], timer: Timer | None = None,
                          cache_file: Path | None = None) -> LayoutChoice:
    """Choose the layout (choose_layout) and convert `loaded` to it once. A dual layout measured here judges its
    mapped pages dropped below an eighth of the dense read rate measured (DualLinear.min_bytes_per_s: disk reads
    run far slower than that, a core shared with the other services now and then a few times slower)."""
    choice = choose_layout(loaded, requested, role, rows, timer, cache_file)
    floor = None
    if choice.layout == "dual" and choice.one_row_ms.get("dense"):  # the bytes one row reads, before conversion
        linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in loaded.model.modules()
                           if isinstance(m, nn.Linear))
        floor = linear_bytes / (choice.one_row_ms["dense"] / 1000) / MAPPED_RATE_DIVISOR
    choice.layout = use_weight_format(loaded, choice.layout, role)
    dual_layers = [m for m in loaded.model.modules() if isinstance(m, DualLinear)] if floor is not None else []
    for layer in dual_layers:
        layer.min_bytes_per_s = floor
    return choice


class MatmulTimer:
    """Times one forward's matmuls for every candidate layout at a row count: SAMPLED_LAYERS layers' linears (scaled
    to all layers) and the output head, converted from the model's own weights. The layouts take turns, repetition
    by repetition, so a load that comes and goes on a shared machine weighs on all of them alike."""

    def __init__(self, model: nn.Module):
        layers = model.model.layers
        picks = sorted({round(i * (len(layers) - 1) / max(SAMPLED_LAYERS - 1, 1)) for i in range(SAMPLED_LAYERS)})
        self.layer_linears = [m for i in picks for m in layers[i].modules() if isinstance(m, nn.Linear)]
        self.layer_scale = len(layers) / len(picks)
        self.head = model.lm_head if isinstance(model.lm_head, nn.Linear) else None
        self._converted: dict[str, tuple[list, nn.Module | None]] = {}

    def __call__(self, layouts: tuple[str, ...], rows: int) -> dict[str, float]:
        converted = {layout: self._layout(layout) for layout in layouts}
        inputs = [torch.randn(rows, m.in_features) for m in self.layer_linears]
        head_input = torch.randn(rows, self.head.in_features) if self.head is not None else None

        def once(layers, head) -> float:
            start = time.perf_counter()
            for m, x in zip(layers, inputs):
                m(x)
            middle = time.perf_counter()
            if head is not None:
                head(head_input)
            return (middle - start) * self.layer_scale + (time.perf_counter() - middle)

        samples = {layout: [] for layout in layouts}
        with torch.no_grad():
            for layers, head in converted.values():
                once(layers, head)  # first call: one-time costs (oneDNN primitive creation, allocation)
            started = time.perf_counter()
            while True:
                for layout, (layers, head) in converted.items():
                    samples[layout].append(once(layers, head))
                done = len(samples[layouts[0]])
                if done >= MAX_REPEATS or (done >= MIN_REPEATS and time.perf_counter() - started > TIME_PER_MEASUREMENT_S * len(layouts)):
                    break
        # The fastest repetition: on a shared machine the others carry whatever else ran at that moment.
        return {layout: min(times) for layout, times in samples.items()}

    def _layout(self, layout: str):
        if layout not in self._converted:
            convert = LINEAR_LAYOUTS.get(layout, lambda linear: linear)  # dense: the model's own layers
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's deprecated quantized-tensor constructors (int8)
                layers = [convert(m) for m in self.layer_linears]
                head = convert(self.head) if self.head is not None else None
            self._converted[layout] = (layers, head)
        return self._converted[layout]


def machine_key() -> dict:
    return runtime_machine_key(threads=torch.get_num_threads())


def model_fingerprint(loaded) -> str:
    c = loaded.config
    return f"{loaded.name}:{c.num_layers}x{c.hidden_size}x{c.intermediate_size}x{c.vocab_size}"


def cache_key(loaded, role: str, rows: dict[int, float]) -> str:
    m = machine_key()
    rows_text = ",".join(f"{r}:{w:g}" for r, w in sorted(rows.items()))
    return f"{m['cpu']}|{m['cores']} cores|{m['threads']} threads|torch {m['torch']}|{model_fingerprint(loaded)}|{role}|rows {rows_text}"


def default_cache_file() -> Path:
    from specsplit.services.models.prepare import models_root

    return models_root() / CACHE_FILE


def cached_choices_for_this_machine(path: Path | None = None) -> list[dict]:
    """The cached entries measured on this CPU with this torch (for `specsplit models list`)."""
    m = machine_key()
    entries = read_cache(path or default_cache_file()).values()
    return [e for e in entries if e.get("cpu") == m["cpu"] and e.get("cores") == m["cores"] and e.get("torch") == m["torch"]]
