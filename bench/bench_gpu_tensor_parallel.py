"""Tensor parallelism on two GPUs (the 70b part: two or four): random-weight bf16 models of real shapes; rank 0 in
this process (in-process engine) or in a target worker process (services), the other ranks its children; NCCL
between them, and the peer-to-peer all-reduces over NVLink (runtime/tensor_parallel_all_reduce.py) where they run.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, set
here for every process).

Parts (--parts; the default is the 2x H100 run, `70b` is its own run):
- exact: a small model (float32, then bf16) at degree 2 gives the degree-1 greedy tokens and seeded samples at
  batch 1, in every all-reduce mode (nccl, symm, fused); prefill logits against degree 1's.
- decode: a Qwen2.5-7B-shaped target alone at degree 1 and 2, batch 1 and 8: degree 2 over the socket command
  channel in each all-reduce mode, and with NCCL over the old channel (gloo broadcast) and over the socket with
  followers that never poll (SPECSPLIT_TP_SPIN_SECONDS=0, channel "socket_no_spin"). Goals: degree 2 >= 1.6x
  degree 1 at batch 1, >= 1.5x at batch 8.
- profile: one degree-2 decode at batch 1 per mode under torch.profiler on both ranks: per step, time in compute
  kernels, in communication kernels, GPU idle, and the gap between steps (host work and lockstep;
  gpu_trace_summary.py). Summaries in the results, gzipped Chrome traces beside them in $OUT.
- speculative: the 7B at degree 1 and 2 with a Qwen2.5-0.5B-shaped draft at degree 1 (on GPU 0), k = 4,
  alpha = 0.7 through the SYNTHETIC ACCEPTANCE benchmark mode (services/target/synthetic_acceptance.py, NOT
  LOSSLESS: random weights never agree, so a coin accepts each proposal with probability alpha; emitted tokens are
  the target's own samples).
- 70b: a Llama-3-70B-shaped target (~141 GB; each rank draws its slices of the model's tensors on its GPU, no
  process holds the whole model, and every degree's shards are slices of one model) at each of --big-degrees (the
  largest first), a 0.5B-shaped draft (Qwen2.5-0.5B dimensions, Llama-3 vocabulary) at degree 1 beside rank 0 on
  GPU 0, through the services (target worker, draft worker, coordinator; gRPC over loopback): target-only, fixed
  k = 4 and adaptive (k <= --adaptive-bound) at --batches under synthetic alpha 0.7, and k = 4 and adaptive at
  batch 1 under alpha 0.9, against the bandwidth floor (bytes one rank reads per step, its weight shard / one GPU's
  measured copy bandwidth); degree against the next lower one; batch-1 greedy tokens and seeded samples compared
  across the degrees. Goals: target-only >= 70% of the floor at batch 1 and 8; speculation >= 2.0x target-only at
  batch 1, >= 1.6x at batch 8 (alpha 0.7), >= 2.8x at batch 1 (alpha 0.9); degree 4 >= 1.6x degree 2 at batch 1.
  At degree 2 rank 0 holds ~66 GiB of weights plus the draft and KV: 2x H200, or 2x H100 if --kv-gib stays small.

    source bench/gpu_env.sh; cd /tmp; OUT=/some/dir python3 $R/bench/bench_gpu_tensor_parallel.py
    ... --parts 70b --big-degrees 4,2 --batches 1,8,32 --name gpu_tensor_parallel_70b
    python3 bench/bench_gpu_tensor_parallel.py --dry-run --parts exact,decode,profile,speculative,70b  # CPU, gloo

Results: $OUT/NAME.json (bench/results/ without $OUT) with commit, machine and command, written after each part.
"""

import argparse
import asyncio
import contextlib
import gc
import gzip
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)  # before torch loads NCCL; inherited by every rank and service started here

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from bench_common import print_table, write_results  # noqa: E402
from gpu_trace_summary import summarize_trace  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.loader import RANDOM_WEIGHTS_MARKER, load_model  # noqa: E402
from specsplit.services.runtime.tensor_parallel_all_reduce import MODE_ENV  # noqa: E402
from specsplit.services.runtime.tensor_parallel_commands import CHANNEL_ENV, SPIN_ENV  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402

SHAPES = {  # config.json values of the real models
    "qwen2.5-7b": ("qwen2", dict(vocab_size=151936, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                                 rope_theta=1000000.0, max_position_embeddings=32768)),
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                                   rope_theta=1000000.0, max_position_embeddings=32768)),
    "llama-3-70b": ("llama", dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                  num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
                                  rope_theta=500000.0, max_position_embeddings=8192)),
    # The 70B's draft: Qwen2.5-0.5B's dimensions with Llama 3's vocabulary (draft and target must share one).
    "0.5b-llama-vocab": ("qwen2", dict(vocab_size=128256, hidden_size=896, intermediate_size=4864,
                                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                       tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192)),
    # --dry-run only
    "tiny-target": ("qwen2", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                  max_position_embeddings=512)),
    "tiny-draft": ("qwen2", dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                 max_position_embeddings=512)),
}
DRY_RUN = {"qwen2.5-7b": "tiny-target", "qwen2.5-0.5b": "tiny-draft", "llama-3-70b": "tiny-target",
           "0.5b-llama-vocab": "tiny-draft"}
# The exact part's model: tests/tiny_models.py weights (peaked distributions: no near-ties), larger than the tests'.
EXACT_MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2)
K = 4
PROMPT_LEN = 32
MODES = ("nccl", "symm", "fused")


def log(*args):
    print(*args, flush=True)


class Run:
    """The arguments and the results so far (written after each part)."""

    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.device = "cpu" if self.dry else "cuda"
        self.dtype = "float32" if self.dry else "bfloat16"
        self.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp())
        self.rows: list[dict] = []
        self.profiles: list[dict] = []
        self.outputs: dict[int, dict] = {}  # 70b: degree -> batch-1 outputs, for the identity check
        self.summary: dict = {}
        self.watchdog: Watchdog | None = None

    def beat(self, stage: str) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(stage)

    def shape(self, name: str) -> str:
        return DRY_RUN[name] if self.dry else name

    def save(self) -> None:
        extra = {"summary": self.summary, "profile": self.profiles}
        if self.dry:
            extra["note"] = "DRY RUN: CPU, gloo, tiny shapes; numbers mean nothing"
        path = write_results(self.args.name + ("_dry_run" if self.dry else ""), self.rows, extra)
        log(f"wrote {path}")


class Watchdog:
    """A GPU kernel that never ends (a collective whose peer never comes) cannot be interrupted: after `seconds`
    without progress, save what was measured, stop the services started here and exit, so a hang costs minutes of
    device time, not the whole run's."""

    def __init__(self, run: Run, seconds: float):
        self.run, self.seconds = run, seconds
        self.stage, self.last = "start", time.monotonic()
        self.processes: list = []
        threading.Thread(target=self._watch, name="bench-watchdog", daemon=True).start()

    def beat(self, stage: str) -> None:
        self.stage, self.last = stage, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(5)
            if time.monotonic() - self.last > self.seconds:
                log(f"STALLED: no progress for {self.seconds:.0f}s in {self.stage}; saving and exiting")
                self.run.summary["stalled"] = f"no progress for {self.seconds:.0f}s in {self.stage}"
                self.run.save()
                for process in self.processes:
                    process.kill()
                os._exit(3)


# -- models ------------------------------------------------------------------------------------------------------

def model_folder(root: Path, shape: str) -> Path:
    """config.json and the random-weights marker: each process that loads it draws its (shard's) weights."""
    from transformers import LlamaConfig, Qwen2Config

    family, values = SHAPES[shape]
    folder = root / shape
    if not folder.exists():
        config = (Qwen2Config if family == "qwen2" else LlamaConfig)(**values, eos_token_id=0, bos_token_id=None)
        config.save_pretrained(folder)
        (folder / RANDOM_WEIGHTS_MARKER).write_text(json.dumps({"seed": 0, "std": 0.02}))
    return folder


def weight_bytes(shape: str, degree: int, dtype_bytes: int = 2) -> int:
    """Bytes one rank reads per decode step: its shard of every weight (embedding lookups excluded)."""
    _, v = SHAPES[shape]
    hidden, inter, layers = v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"]
    head_dim = hidden // v["num_attention_heads"]
    kv = max(v["num_key_value_heads"] // degree, 1) * degree  # replicated KV heads are read on every rank
    attention = hidden * (hidden + 2 * kv * head_dim) + hidden * hidden
    per_layer = attention + 3 * hidden * inter
    return (layers * per_layer + v["vocab_size"] * hidden) * dtype_bytes // degree


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write), the floor's denominator."""
    size = (1 << 30) if device != "cpu" else (64 << 20)
    x = torch.empty(size, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    start = time.perf_counter()
    repeats = 10
    for _ in range(repeats):
        y.copy_(x)
    sync(device)
    rate = 2 * size * repeats / (time.perf_counter() - start)
    del x, y
    free(device)
    return rate


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def environment(**values):
    """Variables for the ranks started inside (children inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def engine(run: Run, target, draft, degree: int) -> LocalEngine:
    """`target`: a folder (sharded at degree > 1) or a LoadedModel; `draft`: a LoadedModel or None. Graphs are
    captured by each measurement's warm-up run (only the shapes measured)."""
    return LocalEngine(target, draft, num_speculative_tokens=K if draft is not None else 0, dtype=run.dtype,
                       device=run.device, speculation="fixed", target_tensor_parallel_size=degree,
                       target_weights="dense", draft_weights="dense", prefix_caching=False, warm_up=False)


def close(run: Run, e: LocalEngine) -> None:
    asyncio.run(e.close())
    free(run.device)


# -- measurements ------------------------------------------------------------------------------------------------

def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab, (batch, PROMPT_LEN), generator=g).tolist()


def generate_batch(e: LocalEngine, batch: int, tokens: int, k: int, vocab: int):
    params = [SamplingParams(max_tokens=tokens, ignore_eos=True, num_speculative_tokens=k, temperature=0.0, seed=i)
              for i in range(batch)]

    async def main():
        results = await asyncio.gather(*(e.generate(p, sp) for p, sp in zip(prompts(batch, vocab), params)))
        await e.coordinator.wait_idle()
        return results

    return asyncio.run(main())


def decode_rate(results) -> dict:
    """Tokens after each request's first, over the time from the earliest first token to the last token."""
    tokens = sum(r.completion_tokens - 1 for r in results)
    seconds = max(r.total_time for r in results) - min(r.time_to_first_token for r in results)
    rounds = sum(max(r.stats.rounds, 1) for r in results)  # rounds after the prefill
    return {"tokens_per_s": tokens / seconds, "tokens_per_round": tokens / rounds}


def measure(run: Run, e: LocalEngine, batch: int, k: int, alpha: float | None, vocab: int) -> dict:
    """A warm-up run (captures this shape's graphs), then the median of --repeats runs."""
    e.verifier.synthetic_acceptance = alpha  # BENCHMARK ONLY when set: not lossless (labelled in the row)
    tokens = run.args.tokens if batch == 1 else run.args.batch_tokens
    run.beat(f"warm-up batch {batch} k {k}")
    generate_batch(e, batch, tokens, k, vocab)
    runs = []
    for repeat in range(run.args.repeats):
        run.beat(f"batch {batch} k {k} run {repeat}")
        runs.append(decode_rate(generate_batch(e, batch, tokens, k, vocab)))
    runs.sort(key=lambda r: r["tokens_per_s"])
    e.verifier.synthetic_acceptance = None
    median = runs[len(runs) // 2]
    return {"tokens_per_s": round(median["tokens_per_s"], 2), "tokens_per_round": round(median["tokens_per_round"], 3),
            "repeats_tokens_per_s": [round(r["tokens_per_s"], 2) for r in runs]}


def row(run: Run, **values) -> dict:
    values.setdefault("acceptance", "synthetic" if values.get("alpha") is not None else None)
    run.beat(f"row {len(run.rows)}")
    run.rows.append(values)
    log(json.dumps(values))
    return values


# -- part: exact -------------------------------------------------------------------------------------------------

def exact_part(run: Run, root: Path, modes: list[str]) -> None:
    from engine_runs import run_prompt
    from tiny_models import build_model, save_model

    prompt_ids = [[(7 * i + 3) % 250 for i in range(n)] for n in (5, 12, 23)]
    greedy = SamplingParams(max_tokens=run.args.exact_tokens, ignore_eos=True, num_speculative_tokens=0)
    sampled = SamplingParams(max_tokens=run.args.exact_tokens, ignore_eos=True, num_speculative_tokens=0,
                             temperature=0.8, seed=17)

    def outputs(e):
        """Batch 1: each prompt alone, greedy, then one seeded sample; and the prefill logits of a prompt."""
        tokens = [asyncio.run(e.generate(p, greedy)).token_ids for p in prompt_ids]
        tokens.append(asyncio.run(e.generate(prompt_ids[1], sampled)).token_ids)
        return tokens, run_prompt(e.target_runner, prompt_ids[2]).float().cpu()

    shape = dict(EXACT_MODEL) if not run.dry else {}
    for dtype in ("float32", "bfloat16"):
        folder = root / f"exact-{dtype}"
        if not folder.exists():
            save_model(build_model("qwen2", seed=11, **shape), folder)
        common = dict(dtype=dtype, device=run.device, speculation="fixed", warm_up=False, num_kv_blocks=256,
                      target_weights="dense")
        one = LocalEngine(str(folder), None, **common)
        want_tokens, want_logits = outputs(one)
        close(run, one)
        two = LocalEngine(str(folder), None, target_tensor_parallel_size=2, **common)
        try:
            for mode in modes:
                run.beat(f"exact {dtype} {mode}")
                chosen = two.target_runner.use_all_reduce(mode)
                tokens, logits = outputs(two)
                differs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                           for x, y in zip(tokens, want_tokens)]
                row(run, part="exact", dtype=dtype, mode=mode, mode_used=chosen, batch=1,
                    greedy_identical=tokens[:-1] == want_tokens[:-1], sampled_identical=tokens[-1] == want_tokens[-1],
                    first_difference=differs, max_logit_difference=float((logits - want_logits).abs().max()),
                    argmax_identical=bool(torch.equal(logits.argmax(-1), want_logits.argmax(-1))))
        finally:
            close(run, two)
    exact = [r for r in run.rows if r["part"] == "exact"]
    run.summary["exact_all_identical"] = all(r["greedy_identical"] and r["sampled_identical"] for r in exact)
    run.summary["exact_modes_used"] = sorted({f'{r["mode"]}->{r["mode_used"]}' for r in exact})
    run.save()


# -- parts: decode, profile, speculative (7B) --------------------------------------------------------------------

def seven_b_parts(run: Run, root: Path, parts: list[str]) -> None:
    target = model_folder(root, run.shape("qwen2.5-7b"))
    vocab = SHAPES[run.shape("qwen2.5-7b")][1]["vocab_size"]
    speculative = "speculative" in parts
    draft = load_model(str(model_folder(root, run.shape("qwen2.5-0.5b"))), run.dtype, run.device) if speculative else None
    batches = [int(b) for b in run.args.batches.split(",")]
    base = dict(part="decode", target="qwen2.5-7b", draft="", k=0, alpha=None)

    e = engine(run, load_model(str(target), run.dtype, run.device), draft, 1)
    try:
        if "decode" in parts:
            for batch in batches:
                row(run, **base, degree=1, channel="", mode="", batch=batch, **measure(run, e, batch, 0, None, vocab))
        if speculative:
            for batch in batches:
                row(run, **{**base, "part": "speculative", "draft": "qwen2.5-0.5b", "k": K, "alpha": run.args.alpha},
                    degree=1, channel="", mode="", batch=batch, **measure(run, e, batch, K, run.args.alpha, vocab))
    finally:
        close(run, e)
    run.save()

    # The gloo channel (the one before this issue) and the socket channel with followers that block at once
    # (SPECSPLIT_TP_SPIN_SECONDS=0, against the polling default), both with NCCL.
    variants = [] if "decode" not in parts else [
        *([] if run.args.no_gloo_channel else [("gloo", {CHANNEL_ENV: "gloo"})]),
        ("socket_no_spin", {CHANNEL_ENV: "socket", SPIN_ENV: "0"})]
    for channel, variables in variants:
        with environment(**variables, **{MODE_ENV: "nccl"}):
            e = engine(run, str(target), None, 2)
        try:
            for batch in batches:
                row(run, **base, degree=2, channel=channel, mode="nccl", batch=batch,
                    **measure(run, e, batch, 0, None, vocab))
        finally:
            close(run, e)
        run.save()

    def speculate(mode: str) -> None:
        e.target_runner.use_all_reduce(mode)
        for batch in batches:
            row(run, **{**base, "part": "speculative", "draft": "qwen2.5-0.5b", "k": K, "alpha": run.args.alpha},
                degree=2, channel="socket", mode=mode, batch=batch, **measure(run, e, batch, K, run.args.alpha, vocab))
        speculated.add(mode)

    speculated: set[str] = set()
    e = engine(run, str(target), draft, 2)
    try:
        for mode in run.modes:  # fused last: see main
            if mode == "fused" and speculative and not speculated:
                speculate(_fastest_mode(run) or "nccl")
            run.beat(f"degree 2 {mode}")
            chosen = e.target_runner.use_all_reduce(mode)
            if chosen != mode:
                row(run, **base, degree=2, channel="socket", mode=mode, mode_used=chosen, batch=None,
                    note=f"{mode} unavailable on this machine (see the log): not measured")
                continue
            if "decode" in parts:
                for batch in batches:
                    row(run, **base, degree=2, channel="socket", mode=mode, mode_used=chosen, batch=batch,
                        **measure(run, e, batch, 0, None, vocab))
            if "profile" in parts:
                profile_mode(run, e, mode, vocab)
            run.save()
        if speculative and (_fastest_mode(run) or "nccl") not in speculated:
            speculate(_fastest_mode(run) or "nccl")
    finally:
        close(run, e)
    _decode_summary(run, batches)
    run.save()


def _fastest_mode(run: Run, batch: int = 1) -> str | None:
    rows = [r for r in run.rows if r["part"] == "decode" and r["degree"] == 2 and r["channel"] == "socket"
            and r["batch"] == batch and "tokens_per_s" in r]
    return max(rows, key=lambda r: r["tokens_per_s"])["mode"] if rows else None


def _decode_summary(run: Run, batches: list[int]) -> None:
    decode = [r for r in run.rows if r["part"] == "decode" and "tokens_per_s" in r]
    for batch in batches:
        one = next((r for r in decode if r["degree"] == 1 and r["batch"] == batch), None)
        if one is None:
            continue
        for r in decode:
            if r["degree"] == 2 and r["batch"] == batch:
                r["vs_degree_1"] = round(r["tokens_per_s"] / one["tokens_per_s"], 3)
                run.summary[f"decode_b{batch}_{r['channel']}_{r['mode']}_vs_degree_1"] = r["vs_degree_1"]
        best = max((r["vs_degree_1"] for r in decode if r["degree"] == 2 and r["batch"] == batch), default=None)
        goal = {1: 1.6, 8: 1.5}.get(batch)
        if best is not None and goal:
            run.summary[f"decode_b{batch}_goal_{goal}x_met"] = best >= goal
    spec = [r for r in run.rows if r["part"] == "speculative"]
    for r in spec:
        plain = next((d for d in decode if d["degree"] == r["degree"] and d["batch"] == r["batch"]
                      and d["mode"] in (r["mode"], "") and d["channel"] in (r["channel"], "")), None)
        if plain:
            r["vs_target_only"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3)


def profile_mode(run: Run, e: LocalEngine, mode: str, vocab: int) -> None:
    """One batch-1 decode under torch.profiler on every rank (graphs already captured by the decode part)."""
    runner = e.target_runner
    pattern = str(run.out / f"trace_{mode}_rank{{rank}}.json")
    tokens = run.args.profile_tokens
    generate_batch(e, 1, tokens, 0, vocab)  # warm (captures, when the decode part did not run)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if run.device != "cpu":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        runner.profile_followers("start")
        with torch.profiler.profile(activities=activities) as profiler:
            generate_batch(e, 1, tokens, 0, vocab)
            sync(run.device)
        runner.profile_followers("stop", pattern)
        profiler.export_chrome_trace(pattern.replace("{rank}", "0"))
        paths = [Path(pattern.replace("{rank}", str(r))) for r in range(runner.tensor_parallel_size)]
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in paths) and time.monotonic() < deadline:
            time.sleep(0.2)
        for rank, path in enumerate(paths):
            summary = {"mode": mode, "rank": rank, "batch": 1, "tokens": tokens, **summarize_trace(str(path))}
            run.profiles.append(summary)
            with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb") as g:
                shutil.copyfileobj(f, g)
            path.unlink()
    except Exception as error:  # a profiler that cannot run here costs the profile, not the run
        run.profiles.append({"mode": mode, "error": repr(error)})
    log(json.dumps(run.profiles[-runner.tensor_parallel_size:]))


# -- part: 70b (services) ----------------------------------------------------------------------------------------

def seventy_b_part(run: Run, root: Path, bandwidth: float) -> None:
    """Each degree of --big-degrees in turn (the largest first: at a smaller one the model may not fit, and that row
    is then recorded as an error instead of losing the others)."""
    target_shape, draft_shape = run.shape("llama-3-70b"), run.shape("0.5b-llama-vocab")
    target, draft = model_folder(root, target_shape), model_folder(root, draft_shape)
    started = time.perf_counter()
    floors = {}
    for degree in sorted((int(d) for d in run.args.big_degrees.split(",")), reverse=True):
        if not run.dry and degree > torch.cuda.device_count():
            run.summary[f"big_degree_{degree}_error"] = f"needs {degree} GPUs, found {torch.cuda.device_count()}"
            continue
        floors[degree] = weight_bytes(target_shape, degree, 4 if run.dry else 2) / bandwidth
        try:
            _seventy_b_degree(run, target, draft, target_shape, degree, floors[degree])
        except Exception as error:  # e.g. out of GPU memory at degree 2 on 80 GB cards: the other degrees stand
            log(f"70b degree {degree} failed: {error!r}")
            run.summary[f"big_degree_{degree}_error"] = repr(error)[:2000]
        run.save()
    _seventy_b_summary(run, floors, bandwidth, time.perf_counter() - started)
    run.save()


def _seventy_b_degree(run: Run, target: Path, draft: Path, target_shape: str, degree: int, floor_step: float):
    """One target worker per alpha at this degree (synthetic acceptance is the worker's flag), the draft worker on
    GPU 0 beside rank 0, one coordinator: target-only, fixed k = 4 and adaptive (bound --adaptive-bound) rows, and at
    the first alpha the batch-1 outputs (greedy and seeded) that the identity check compares across degrees."""
    from specsplit.client import Client
    from specsplit.services.service_commands import spawn_service, stop_processes

    vocab = SHAPES[target_shape][1]["vocab_size"]
    # The workers capture every round shape up to the adaptive bound before serving. With none captured (the first
    # 70B runs, --warm-up-k 0) a shape a timed run met first was captured inside it (random coins shrink a batch
    # differently each run), and twice, by the log, a capture outlasted the coordinator's hung-call deadline, which
    # took the replica down for ~2 s: the likely cause of speculative rows spreading 1.1-4x between runs while
    # target-only rows agreed (not confirmed by a run since).
    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--dtype", run.dtype,
              "--no-prefix-caching", "--warm-up-k", str(max(K, run.args.adaptive_bound))]
    device = "cpu" if run.dry else "cuda:0"
    batches = [int(b) for b in run.args.batches.split(",")]
    alphas = [float(a) for a in run.args.big_alphas.split(",")]
    procs: list = []
    # The worker's ranks take the mode from the environment; one that is unavailable falls back to NCCL with a
    # warning in the worker's log.
    with environment(SPECSPLIT_KV_CACHE_BYTES=str(int(run.args.kv_gib * (1 << 30))), **{MODE_ENV: run.args.big_mode}):
        try:
            run.beat(f"70b degree {degree} draft start")
            drafter, d_addr = spawn_service(["draft", "--model", str(draft), "--device", device,
                                             "--weights", "dense", *common])
            procs.append(drafter)
            run.watchdog.processes = procs
            for alpha in alphas:
                first = alpha == alphas[0]
                t0 = time.perf_counter()
                run.beat(f"70b degree {degree} target start (alpha {alpha})")
                worker, t_addr = spawn_service(["target", "--model", str(target), "--device", device,
                                                "--tensor-parallel-size", str(degree),
                                                "--synthetic-acceptance", str(alpha), *common])
                coordinator, c_addr = spawn_service(["coordinator", "--target", t_addr, "--draft", d_addr, "-k",
                                                     str(run.args.adaptive_bound), "--host", "127.0.0.1",
                                                     "--port", "0", "--metrics-port", "-1", "--http-port", "-1"])
                run.watchdog.processes = procs + [worker, coordinator]
                started = round(time.perf_counter() - t0, 1)
                log(f"70b degree {degree} target (alpha {alpha}) and coordinator up in {started}s")
                try:
                    with Client(c_addr, timeout=1200) as client:
                        if first:
                            run.outputs[degree] = _identity_outputs(run, client, vocab)
                        kinds = [(0, "fixed"), (K, "fixed"), (run.args.adaptive_bound, "adaptive")]
                        for batch in batches if first else batches[:1]:
                            for k, speculation in kinds if first else kinds[1:]:
                                measured = _client_measure(run, client, batch, k, speculation, vocab)
                                values = dict(part="70b", target="llama-3-70b", degree=degree,
                                              draft="0.5b (llama vocab)" if k else "", draft_degree=1 if k else None,
                                              channel="socket", mode=run.args.big_mode, batch=batch,
                                              k=k if speculation == "fixed" else f"adaptive<={k}",
                                              alpha=alpha if k else None, target_start_seconds=started, **measured)
                                if not k:
                                    floor = batch / floor_step
                                    values.update(bandwidth_floor_tokens_per_s=round(floor, 2),
                                                  fraction_of_floor=round(measured["tokens_per_s"] / floor, 3))
                                row(run, **values)
                finally:
                    stop_processes([coordinator, worker])
                run.save()
        finally:
            stop_processes(procs)


def _identity_outputs(run: Run, client, vocab: int) -> dict:
    """Batch 1, target-only: the greedy tokens and a seeded sample of each of three prompts."""
    run.beat("70b identity outputs")
    outputs = {}
    for i, prompt in enumerate(prompts(3, vocab)):
        for name, params in (("greedy", dict(temperature=0.0)), ("seeded", dict(temperature=1.0, seed=100 + i))):
            result = client.generate(prompt, max_tokens=run.args.exact_tokens, ignore_eos=True,
                                     num_speculative_tokens=0, **params)
            outputs[f"{name}_{i}"] = list(result.token_ids)
    return outputs


def _client_measure(run: Run, client, batch: int, k: int, speculation: str, vocab: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    tokens = run.args.tokens if batch == 1 else run.args.batch_tokens

    def once():
        with ThreadPoolExecutor(batch) as pool:
            return list(pool.map(lambda p: client.generate(p, max_tokens=tokens, ignore_eos=True, temperature=0.0,
                                                           num_speculative_tokens=k, speculation=speculation),
                                 prompts(batch, vocab)))

    run.beat(f"70b warm-up batch {batch} k {k} {speculation}")
    once()  # warm-up: captures this shape's graphs (and, adaptive, lets the policy measure its ks)
    runs = []
    for repeat in range(run.args.repeats):
        run.beat(f"70b batch {batch} k {k} {speculation} run {repeat}")
        runs.append(decode_rate(once()))
    runs.sort(key=lambda r: r["tokens_per_s"])
    median = runs[len(runs) // 2]
    return {"tokens_per_s": round(median["tokens_per_s"], 2), "tokens_per_round": round(median["tokens_per_round"], 3),
            "repeats_tokens_per_s": [round(r["tokens_per_s"], 2) for r in runs]}


def _seventy_b_summary(run: Run, floors: dict, bandwidth: float, seconds: float) -> None:
    rows = [r for r in run.rows if r["part"] == "70b"]
    run.summary["big_part_seconds"] = round(seconds, 1)
    for degree, floor_step in floors.items():
        run.summary[f"big_degree_{degree}_weight_bytes_per_rank"] = int(floor_step * bandwidth)
        run.summary[f"big_degree_{degree}_floor_step_ms"] = round(floor_step * 1e3, 3)
    goals = {(run.args.alpha, 1): 2.0, (run.args.alpha, 8): 1.6, (0.9, 1): 2.8}
    for r in rows:
        plain = next((p for p in rows if p["k"] == 0 and p["batch"] == r["batch"] and p["degree"] == r["degree"]),
                     None)
        if r["k"] != 0 and plain:
            r["vs_target_only"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3)
        prefix = f"big_d{r['degree']}_b{r['batch']}"
        if r["k"] == 0:
            run.summary[f"{prefix}_fraction_of_floor"] = r["fraction_of_floor"]
            if r["batch"] in (1, 8):
                run.summary[f"{prefix}_goal_0.7_of_floor_met"] = r["fraction_of_floor"] >= 0.7
            lower = next((p for p in rows if p["k"] == 0 and p["batch"] == r["batch"] and p["degree"] < r["degree"]),
                         None)
            if lower:
                ratio = round(r["tokens_per_s"] / lower["tokens_per_s"], 3)
                run.summary[f"{prefix}_vs_degree_{lower['degree']}"] = ratio
                if r["batch"] == 1 and r["degree"] == 2 * lower["degree"]:
                    run.summary[f"{prefix}_goal_1.6x_degree_{lower['degree']}_met"] = ratio >= 1.6
        else:
            key = f"{prefix}_alpha{r['alpha']}_k{r['k']}_vs_target_only"
            run.summary[key] = r.get("vs_target_only")
            goal = goals.get((r["alpha"], r["batch"]))
            if goal and r.get("vs_target_only") is not None:
                run.summary[key.replace("_vs_target_only", f"_goal_{goal}x_met")] = r["vs_target_only"] >= goal
    degrees = sorted(run.outputs)
    for low, high in zip(degrees, degrees[1:]):
        a, b = run.outputs[low], run.outputs[high]
        for name in ("greedy", "seeded"):
            keys = [key for key in a if key.startswith(name)]
            same = sum(a[key] == b[key] for key in keys)
            run.summary[f"big_{name}_identical_degree_{low}_vs_{high}"] = f"{same} of {len(keys)}"
            run.summary[f"big_{name}_first_difference_degree_{low}_vs_{high}"] = [
                next((i for i, (x, y) in enumerate(zip(a[key], b[key])) if x != y), None) for key in keys]
    run.summary["big_outputs"] = {str(d): o for d, o in run.outputs.items()}


# -- main --------------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="exact,decode,profile,speculative")
    parser.add_argument("--modes", default=",".join(MODES), help="all-reduce modes to measure at degree 2")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per request at batch 1")
    parser.add_argument("--batch-tokens", type=int, default=48, help="tokens per request at larger batches")
    parser.add_argument("--profile-tokens", type=int, default=24)
    parser.add_argument("--exact-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--alpha", type=float, default=0.7)
    parser.add_argument("--kv-gib", type=float, default=2.0, help="KV cache of each 70b worker rank")
    parser.add_argument("--big-mode", default="auto", help="the 70b target's all-reduce mode (auto, nccl, symm, fused)")
    parser.add_argument("--big-degrees", default="2", help="the 70b target's tensor-parallel degrees, e.g. 4,2")
    parser.add_argument("--big-alphas", default="0.7,0.9", help="the 70b part's synthetic alphas (the first: every "
                        "batch and the identity outputs; the others: batch 1)")
    parser.add_argument("--adaptive-bound", type=int, default=8, help="the adaptive rows' bound on k")
    parser.add_argument("--no-gloo-channel", action="store_true", help="skip the degree-2 run over the gloo channel")
    parser.add_argument("--stall-seconds", type=float, default=240, help="exit after this long without progress")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes: the script's own check")
    parser.add_argument("--name", default="gpu_tensor_parallel")
    args = parser.parse_args()
    run = Run(args)
    run.modes = [m for m in args.modes.split(",") if m]
    if args.dry_run:
        args.tokens, args.batch_tokens, args.profile_tokens, args.exact_tokens, args.repeats = 6, 4, 4, 6, 1
        os.environ.setdefault("SPECSPLIT_KV_CACHE_BYTES", str(16 << 20))
    else:
        if torch.cuda.device_count() < 2:
            raise SystemExit(f"needs 2 GPUs, found {torch.cuda.device_count()} (--dry-run runs on the CPU)")
        os.environ.setdefault("SPECSPLIT_KV_CACHE_BYTES", str(2 << 30))
    parts = [p for p in args.parts.split(",") if p]
    run.watchdog = Watchdog(run, args.stall_seconds)
    started = time.perf_counter()
    bandwidth = copy_bandwidth(run.device)
    run.summary["copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
    run.summary["environment"] = {k: os.environ.get(k) for k in (*MULTICAST_OFF, MODE_ENV, CHANNEL_ENV, SPIN_ENV)}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            # The fused kernel's own barrier is the one thing here that could hang a GPU: its exactness check
            # comes last, after everything the other modes measure (the watchdog ends a hang).
            if "exact" in parts:
                exact_part(run, root, [m for m in run.modes if m != "fused"])
            if {"decode", "profile", "speculative"} & set(parts):
                seven_b_parts(run, root, parts)
            if "exact" in parts and "fused" in run.modes:
                exact_part(run, root, ["fused"])
            if "70b" in parts:
                seventy_b_part(run, root, bandwidth)
    except BaseException as error:  # a part that fails keeps what the others measured
        run.summary["error"] = repr(error)
        raise
    finally:
        run.summary["seconds"] = round(time.perf_counter() - started, 1)
        run.save()
    for rows, columns in (
            ([r for r in run.rows if r["part"] != "exact"],
             ["part", "target", "degree", "channel", "mode", "batch", "k", "alpha", "tokens_per_s", "vs_degree_1",
              "vs_target_only", "fraction_of_floor"]),
            ([r for r in run.rows if r["part"] == "exact"],
             ["dtype", "mode", "mode_used", "greedy_identical", "sampled_identical", "max_logit_difference"]),
            (run.profiles, ["mode", "rank", "step_us", "compute_us", "comm_us", "comm_kernels", "idle_us", "gap_us",
                            "kernels_per_replay"])):
        if rows:
            print_table(rows, columns)
    log(json.dumps(run.summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
