"""The eager torch attention and rotary of this checkout against those of another commit, side by side in
speculative rounds on the CPU (A/B of a change to kernels/paged_attention.py or kernels/rotary_kv.py).

The real pair (Qwen2.5-Coder 1.5B target packed float32, 0.5B draft int8), in process, greedy, k = 4 fixed, batch 1,
HumanEval prompts 1..`--prompts` after an untimed HumanEval/0, `--tokens` new tokens each, prefix caching off. Each
prompt runs in turn with this checkout's functions and with commit `--before`'s (read with `git show` and swapped
into kernels/dispatch.py), so a load that comes and goes falls on both alike. Per mode: the draft's propose calls
and the target's verify calls, counted and timed, the whole generation time, and the greedy output, which must be
identical. With `--profile`, the share of the calls' time spent in the matmuls, in the eager paged attention and in
rotary (cProfile, inclusive times; cProfile's own overhead is in the call times of such a run).

    python bench/bench_torch_kernels_ab_cpu.py --before REV [--prompts 3] [--tokens 64] [--profile]

Results: bench/results/torch_kernels_ab_cpu.json (torch_kernels_ab_cpu_profile.json with --profile).
"""

import argparse
import asyncio
import cProfile
import pstats
import subprocess
import sys
import time
import types
from pathlib import Path

from specsplit.services.runtime.cpu_wait_policy import choose_for_command  # noqa: E402 (imports no torch)

choose_for_command(["generate", "--local"])  # as the specsplit command chooses it for one process

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from prompts import humaneval_prompts  # noqa: E402
from specsplit.kernels import dispatch  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.prepare import resolve_model  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
K = 4
# cProfile entries (function name fragments) -> the part of the layer they stand for
PARTS = {"matmuls": ("_linear_pointwise", "linear_dynamic"), "paged attention": ("paged_attention_torch",),
         "rotary": ("rotary_kv_torch",)}


class CallTimer:
    """Wraps the engine's propose and verify calls: count, seconds, and optionally a cProfile of them."""

    def __init__(self, engine: LocalEngine, profile: cProfile.Profile | None):
        self.seconds = {"propose": 0.0, "verify": 0.0}
        self.calls = {"propose": 0, "verify": 0}
        for obj, name in ((engine.proposer, "propose"), (engine.verifier, "verify")):
            setattr(obj, name, self._timed(getattr(obj, name), name, profile))

    def _timed(self, call, name, profile):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            if profile is not None:
                profile.enable()
            try:
                return call(*args, **kwargs)
            finally:
                if profile is not None:
                    profile.disable()
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
        return timed


def kernels_at(rev: str) -> dict:
    """The torch attention and rotary functions as commit `rev` had them: dispatch's names -> functions."""
    root = Path(__file__).resolve().parent.parent
    out = {}
    for name, path in (("paged_attention_torch", "kernels/paged_attention.py"), ("rotary_kv_torch", "kernels/rotary_kv.py")):
        module = types.ModuleType(f"{name}_at_{rev}")
        exec(subprocess.check_output(["git", "-C", str(root), "show", f"{rev}:{path}"], text=True), module.__dict__)
        out[name] = getattr(module, name)
    return out


def shares(profile: cProfile.Profile) -> dict:
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    total = sum(entry[2] for entry in stats.values())
    out = {}
    for part, names in PARTS.items():
        seconds = sum(entry[3] for (_, _, fn), entry in stats.items() if any(n in fn for n in names))
        out[part] = round(seconds / total, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--before", metavar="REV", required=True, help="the commit whose functions to compare with")
    parser.add_argument("--profile", action="store_true", help="also the time shares of matmuls, attention, rotary")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    target_dir, draft_dir = resolve_model(TARGET), resolve_model(DRAFT)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tokenizer(p["prompt"])["input_ids"] for p in humaneval_prompts(args.prompts + 1)]
    engine = LocalEngine(str(target_dir), str(draft_dir), num_speculative_tokens=K, speculation="fixed",
                         num_kv_blocks=128, prefix_caching=False)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, num_speculative_tokens=K)

    def generate(ids):
        async def once():
            result = await engine.generate(ids, params)
            await engine.coordinator.wait_idle()
            return result
        return asyncio.run(once())

    generate(prompts[0][:32])  # warm-up: first-call costs of both models
    shipped = {name: getattr(dispatch, name) for name in ("paged_attention_torch", "rotary_kv_torch")}
    kernels = {"this checkout": shipped, f"at {args.before}": kernels_at(args.before)}
    modes = list(kernels)
    profiles = {mode: cProfile.Profile() if args.profile else None for mode in modes}
    measured = {mode: {"seconds": 0.0, "outputs": [], "propose_s": 0.0, "verify_s": 0.0, "propose_calls": 0,
                       "verify_calls": 0} for mode in modes}
    original = engine.proposer.propose, engine.verifier.verify
    for ids in prompts[1:]:
        for mode in modes:
            for name, function in kernels[mode].items():
                setattr(dispatch, name, function)
            timer = CallTimer(engine, profiles[mode])
            start = time.perf_counter()
            result = generate(ids)
            m = measured[mode]
            m["seconds"] += time.perf_counter() - start
            m["outputs"].append(result.token_ids)
            for name in ("propose", "verify"):
                m[f"{name}_s"] += timer.seconds[name]
                m[f"{name}_calls"] += timer.calls[name]
            engine.proposer.propose, engine.verifier.verify = original
    for name, function in shipped.items():
        setattr(dispatch, name, function)

    rows = []
    for mode, m in measured.items():
        row = {"mode": mode, "seconds": round(m["seconds"], 2),
               "tokens": sum(len(o) for o in m["outputs"]),
               "propose_ms_per_call": round(1000 * m["propose_s"] / m["propose_calls"], 1),
               "verify_ms_per_call": round(1000 * m["verify_s"] / m["verify_calls"], 1),
               "rounds": m["verify_calls"],
               "output_identical": m["outputs"] == measured["this checkout"]["outputs"]}
        if profiles[mode] is not None:
            row["time_shares_of_calls"] = shares(profiles[mode])
        rows.append(row)
    for row in rows:
        row["time_vs_this_checkout"] = round(row["seconds"] / rows[0]["seconds"], 3)
    print_table(rows, ["mode", "seconds", "tokens", "rounds", "propose_ms_per_call", "verify_ms_per_call",
                       "output_identical", "time_vs_this_checkout", "time_shares_of_calls"])
    path = write_results("torch_kernels_ab_cpu" + ("_profile" if args.profile else ""), rows, {
        "models": {"target": TARGET + " (packed float32)", "draft": DRAFT + " (int8)"}, "k": K,
        "prompts": [f"HumanEval/{i}" for i in range(1, args.prompts + 1)], "tokens": args.tokens,
        "before": args.before,
        "note": "modes interleaved prompt by prompt on one engine; with --profile the call times include cProfile's "
                "own overhead, so compare the rows' times from a run without it"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
