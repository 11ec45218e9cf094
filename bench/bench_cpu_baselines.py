"""Honest CPU baselines: every speedup against the fastest target-only configuration on this machine, with
`transformers` generate and assisted generation in the same run as outside anchors (issue 22).

The real pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft, float32 weights), greedy, batch 1, the first
`--prompts` HumanEval prompts after one untimed warm-up prompt, `--tokens` new tokens each (EOS ends a generation,
as it does for transformers), prefix caching off (every system pays each prompt's prefill, as transformers does).
One system after another:
- transformers generate (float32, the same prepared weights) and assisted generation (`assistant_model=` the 0.5B);
- specsplit in-process target-only: dense, packed, and the calibrated choice (the layout `auto` picks on this
  machine; when it is one of the two above, it is that row, not run twice);
- the layout calibration itself: seconds on a first start (an empty cache file) and on a later one (cache hit);
- specsplit in-process speculative, k = 4: adaptive (the default, at most 4) and fixed (requests in fixed mode);
- through the services (`specsplit serve`, three processes over loopback gRPC): target-only, and speculative k = 4
  adaptive and fixed, with the default per-process threads (services/runtime/cpu_threads.py).
Greedy tokens of every system are compared with transformers' greedy generate. The CPU model, the load average
around each system (the machine may be shared) and the command go into bench/results/cpu_baselines*.json.

    flock /work/heavy.lock python bench/bench_cpu_baselines.py [--prompts 3] [--tokens 64] [--name _xeon]
"""

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# As the specsplit command chooses it for one process computing (services/runtime/cpu_wait_policy.py), for every
# in-process system of this run alike, transformers included; the services choose their own, as `serve` does.
from specsplit.services.runtime.cpu_wait_policy import WAIT_REASON_ENV, choose_for_command, without_wait_choice  # noqa: E402

choose_for_command(["generate", "--local"])

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from prompts import humaneval_prompts  # noqa: E402
from specsplit.client import Client  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.layout_calibration import choose_layout, role_rows  # noqa: E402
from specsplit.services.models.loader import load_model  # noqa: E402
from specsplit.services.models.prepare import resolve_model  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402
from specsplit.services.service_commands import spawn_service  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CALIBRATED_TARGET_ONLY = "specsplit target-only, calibrated (auto)"
KV_BLOCKS = 128  # 2,048 tokens per model: a prompt and its new tokens, one request at a time


def trim_at_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


class Recorder:
    def __init__(self, eos: int):
        self.eos, self.rows, self.tokens = eos, [], {}

    def add(self, system: str, kind: str, seconds: list[float], outputs: list[list[int]], **extra) -> dict:
        outputs = [trim_at_eos(list(o), self.eos) for o in outputs]
        row = {"system": system, "kind": kind, "tokens_per_s": sum(map(len, outputs)) / sum(seconds),
               "seconds": sum(seconds), "tokens": sum(map(len, outputs)), "load_avg_1m": os.getloadavg()[0], **extra}
        self.rows.append(row)
        self.tokens[system] = outputs
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        return row


def run_transformers(rec: Recorder, target_dir, draft_dir, warm, prompts, tokens: int) -> None:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    for system, extra in (("transformers generate", {}), ("transformers assisted (0.5B draft)", {"assistant_model": draft})):
        seconds, outputs = [], []
        with torch.no_grad():
            target.generate(torch.tensor([warm]), max_new_tokens=8, do_sample=False, **extra)
            for ids in prompts:
                start = time.perf_counter()
                out = target.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, **extra)
                seconds.append(time.perf_counter() - start)
                outputs.append(out[0, len(ids):].tolist())
        rec.add(system, "target-only" if not extra else "speculative", seconds, outputs)
    del target, draft
    gc.collect()


def run_engine(rec: Recorder, engine: LocalEngine, system: str, kind: str, warm, prompts, tokens: int, k=None, **extra):
    """`k`: every request proposes exactly k a round (a request's fixed mode); None: the policy picks."""
    fixed = "fixed" if k else None
    params = SamplingParams(max_tokens=tokens, num_speculative_tokens=k, speculation=fixed)

    async def main():
        await engine.generate(warm, SamplingParams(max_tokens=8, num_speculative_tokens=k, speculation=fixed))
        seconds, results = [], []
        for ids in prompts:
            start = time.perf_counter()
            results.append(await engine.generate(ids, params))
            seconds.append(time.perf_counter() - start)
        return seconds, results

    seconds, results = asyncio.run(main())
    return rec.add(system, kind, seconds, [r.token_ids for r in results], **_stats(results), **extra)


def _stats(results) -> dict:
    drafted = sum(r.stats.draft_tokens for r in results)
    rounds = sum(r.stats.rounds for r in results)
    return {"rounds": rounds, "acceptance": sum(r.stats.accepted_tokens for r in results) / drafted if drafted else None,
            "drafted_per_round": drafted / rounds if rounds else 0.0}


def run_target_only_in_process(rec: Recorder, target_dir, warm, prompts, tokens: int) -> dict:
    layouts = {}
    for layout in ("dense", "packed"):
        engine = LocalEngine(str(target_dir), None, num_speculative_tokens=0, target_weights=layout,
                             num_kv_blocks=KV_BLOCKS, prefix_caching=False)
        row = run_engine(rec, engine, f"specsplit target-only, {layout}", "target-only", warm, prompts, tokens,
                         layout=layout)
        layouts[layout] = row
        del engine
        gc.collect()
    return layouts


def calibration_part(target_dir, draft_dir) -> dict:
    """Seconds the calibration adds to a first start (an empty cache) and to a later one (a cache hit), per role and
    row count; and the choice `auto` makes with the real cache, which the systems after it use."""
    out = {}
    scratch = Path(tempfile.mkdtemp()) / "layouts.json"
    for folder, role, ks in ((target_dir, "target", (0, 4)), (draft_dir, "draft", (4,))):
        loaded = load_model(str(folder))
        for k in ks:
            rows = role_rows(role, k)
            start = time.perf_counter()
            first = choose_layout(loaded, "auto", role, rows, cache_file=scratch)
            first_s = time.perf_counter() - start
            start = time.perf_counter()
            again = choose_layout(loaded, "auto", role, rows, cache_file=scratch)
            again_s = time.perf_counter() - start
            used = choose_layout(loaded, "auto", role, rows)  # the real cache: measured once per machine
            name = f"{role} k={k}"
            out[name] = {"rows": rows, "first_start_s": first_s, "later_start_s": again_s, "choice_first": first.layout,
                         "ms_first": first.ms, "choice_used": used.layout, "ms_used": used.ms,
                         "source_used": used.source, "same_choice_on_later_start": again.layout == first.layout}
            print(name, out[name], flush=True)
        del loaded
        gc.collect()
    return out


class Services:
    """`specsplit serve` in a child process for the duration of a `with` block."""

    def __init__(self, target_dir, draft_dir, *extra: str):
        argv = ["serve", "--target", str(target_dir), "--draft", str(draft_dir) if draft_dir else "none", "--port", "0",
                "--metrics-port", "-1", "-k", "4", "--num-kv-blocks", str(KV_BLOCKS), "--no-prefix-caching", *extra]
        self.process, self.address = spawn_service(argv, env=without_wait_choice(os.environ))
        self.startup_lines = self.process.startup_lines

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.wait(timeout=120)


def run_services(rec: Recorder, services: Services, system: str, kind: str, warm, prompts, tokens: int, k=None, **extra):
    with Client(services.address, timeout=3600) as client:
        fixed = "fixed" if k else None
        client.generate(warm, max_tokens=8, num_speculative_tokens=k, speculation=fixed)
        seconds, results = [], []
        for ids in prompts:
            start = time.perf_counter()
            results.append(client.generate(ids, max_tokens=tokens, num_speculative_tokens=k, speculation=fixed))
            seconds.append(time.perf_counter() - start)
    return rec.add(system, kind, seconds, [r.token_ids for r in results], **_stats(results), **extra)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-offset", type=int, default=0,
                        help="start at this HumanEval prompt (e.g. 100: a held-out set, none of it used for tuning)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parts", default="calibration,transformers,target,speculative,services",
                        help="comma list, run in this order: calibration, transformers, target, speculative, services")
    parser.add_argument("--name", default="", help="suffix for the result file")
    parser.add_argument("--target", default=TARGET, help="a built-in name or a folder (a tiny pair checks the script)")
    parser.add_argument("--draft", default=DRAFT)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    parts = args.parts.split(",")
    target_dir, draft_dir = resolve_model(args.target), resolve_model(args.draft)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    texts = humaneval_prompts(args.prompt_offset + args.prompts + 1)[args.prompt_offset:]
    warm, *prompts = [tokenizer.encode(p["prompt"]) for p in texts]
    rec = Recorder(tokenizer.eos_token_id)
    extra = {"target": args.target, "draft": args.draft, "dtype": "float32", "prompts": [p["id"] for p in texts[1:]],
             "tokens": args.tokens, "lscpu_model": _lscpu_model(), "torch_threads": torch.get_num_threads(),
             "cpu_flags_bf16": _bf16_flags(), "omp_wait_policy": os.environ.get(WAIT_REASON_ENV)}
    started = time.perf_counter()

    def save() -> Path:  # after every part: a run stopped late keeps what it measured
        extra["total_s"] = time.perf_counter() - started
        summarize(rec, extra)
        return write_results("cpu_baselines" + args.name, rec.rows, extra)

    def calibration():  # first by default: it fills the real cache the systems after it read, as a first start would
        extra["calibration"] = calibration_part(target_dir, draft_dir)

    def transformers():
        run_transformers(rec, target_dir, draft_dir, warm, prompts, args.tokens)

    def target():
        layouts = run_target_only_in_process(rec, target_dir, warm, prompts, args.tokens)
        if "calibration" in extra:
            chosen = extra["calibration"]["target k=0"]["choice_used"]
        else:  # what a target-only engine's `auto` takes on this machine (the cache, or a measurement now)
            chosen = choose_layout(load_model(str(target_dir)), "auto", "target", role_rows("target", 0)).layout
            gc.collect()
        extra["calibrated_target_only"] = chosen
        rec.rows.append({**layouts[chosen], "system": CALIBRATED_TARGET_ONLY, "layout": chosen,
                         "note": "the same configuration as its row above, not run again"})

    def speculative():
        engine = LocalEngine(str(target_dir), str(draft_dir), num_speculative_tokens=4, num_kv_blocks=KV_BLOCKS,
                             prefix_caching=False)
        chosen = {role: c.layout for role, c in engine.layouts.items()}
        run_engine(rec, engine, "specsplit in-process k=4 adaptive", "speculative", warm, prompts, args.tokens,
                   layouts=chosen)
        run_engine(rec, engine, "specsplit in-process k=4 fixed", "speculative", warm, prompts, args.tokens, k=4,
                   layouts=chosen)
        del engine
        gc.collect()

    def services():
        with Services(target_dir, None) as running:
            run_services(rec, running, "specsplit services target-only", "target-only", warm, prompts, args.tokens)
        with Services(target_dir, draft_dir) as running:
            run_services(rec, running, "specsplit services k=4 adaptive", "speculative", warm, prompts, args.tokens)
            run_services(rec, running, "specsplit services k=4 fixed", "speculative", warm, prompts, args.tokens, k=4)

    steps = {"calibration": calibration, "transformers": transformers, "target": target, "speculative": speculative,
             "services": services}
    for part in parts:  # in the order given
        steps[part]()
        save()
    path = save()
    print_table(rec.rows, ["system", "tokens_per_s", "vs_fastest_target_only", "vs_transformers_generate",
                           "vs_in_process", "acceptance", "identical_to_transformers_greedy", "load_avg_1m"])
    print(f"fastest target-only: {extra['fastest_target_only']}; {extra['total_s']:.0f} s; {path}")


def summarize(rec: Recorder, extra: dict) -> None:
    """Ratios within the run: to the fastest target-only, to transformers generate, services to in-process."""
    reference = rec.tokens.get("transformers generate")
    target_only = [r for r in rec.rows if r["kind"] == "target-only"]
    fastest = max(target_only, key=lambda r: r["tokens_per_s"]) if target_only else None
    extra["fastest_target_only"] = fastest and fastest["system"]
    by_system = {r["system"]: r for r in rec.rows}
    for row in rec.rows:
        if fastest:
            row["vs_fastest_target_only"] = row["tokens_per_s"] / fastest["tokens_per_s"]
        if "transformers generate" in by_system:
            row["vs_transformers_generate"] = row["tokens_per_s"] / by_system["transformers generate"]["tokens_per_s"]
        if reference is not None and row["system"] in rec.tokens:
            row["identical_to_transformers_greedy"] = rec.tokens[row["system"]] == reference
        in_process = row["system"].replace("services", "in-process")
        if row["system"].startswith("specsplit services") and in_process in by_system:
            row["vs_in_process"] = row["tokens_per_s"] / by_system[in_process]["tokens_per_s"]
    if "specsplit services target-only" in by_system and CALIBRATED_TARGET_ONLY in by_system:
        # Both use the layout `auto` picks for a target decoding alone.
        row = by_system["specsplit services target-only"]
        row["vs_in_process"] = row["tokens_per_s"] / by_system[CALIBRATED_TARGET_ONLY]["tokens_per_s"]


def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return "unknown"


def _bf16_flags() -> list[str]:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"})


if __name__ == "__main__":
    main()
