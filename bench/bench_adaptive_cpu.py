"""Speculation that never loses, on the CPU: the real 1.5B target with a draft that never agrees with it (a 0.5B
Qwen2.5-shaped model with random weights, same vocabulary), under adaptive speculation, against the target alone,
in process and through the services (`specsplit serve`), side by side in one run.

The policy (services/coordinator/speculation_policy.py) measures plain decoding and one proposal first, then keeps
k = 0, builds no draft KV for new requests and probes with one proposal every 32-256 rounds. One untimed request per
system lets it measure before the timed ones (a deployment measures once, at its first requests). Greedy, HumanEval
prompts, `--tokens` new tokens each, one at a time.

    python bench/bench_adaptive_cpu.py [--prompts 3] [--tokens 48] [--tiny] [--interleave 5]

`--tiny`: the test suite's tiny random models instead (a qwen2 target and an unrelated one of the same shape, byte
tokenizer, float32), where everything but the models' own arithmetic is what costs: the coordinator's per-round work,
the draft's prefills and probes.
"""

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

# The in-process systems wait as `specsplit generate --local` would (before torch loads OpenMP); the services choose
# their own, as `specsplit serve` does (services/runtime/cpu_wait_policy.py).
from specsplit.services.runtime.cpu_wait_policy import WAIT_REASON_ENV, choose_for_command, without_wait_choice

choose_for_command(["generate", "--local"])

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from bench_real_pair_cpu import Services as RealPairServices  # noqa: E402
from prompts import humaneval_prompts  # noqa: E402
from specsplit.client import Client  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.prepare import resolve_model  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402

TARGET = "qwen2.5-coder-1.5b-instruct"


def Services(target_dir, draft_dir, kv_blocks: int) -> RealPairServices:
    """`specsplit serve` (k = 4, adaptive) in a child process that chooses its own OpenMP wait policy."""
    return RealPairServices(target_dir, draft_dir, kv_blocks, "--http-port", "-1", env=without_wait_choice(os.environ))


def unrelated_draft(folder: Path, target_dir: Path) -> Path:
    """A Qwen2.5-0.5B-shaped draft with random weights and the target's vocabulary and tokenizer files."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    config = AutoConfig.from_pretrained(target_dir)
    config.update(dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, tie_word_embeddings=True))
    if getattr(config, "layer_types", None) is not None:  # one per layer, recounted for the new depth
        config.layer_types = config.layer_types[:1] * config.num_hidden_layers
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (target_dir / name).exists():
            (folder / name).write_bytes((target_dir / name).read_bytes())
    return folder


def timed_in_process(engine: LocalEngine, prompts: list[str], tokens: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    async def main():
        results, start = [], time.perf_counter()
        for prompt in prompts:
            results.append(await engine.generate(prompt, params))
        return time.perf_counter() - start, results

    return asyncio.run(main())


def timed_services(address: str, prompts: list[str], tokens: int) -> tuple[float, list]:
    with Client(address, timeout=3600) as client:
        start = time.perf_counter()
        results = [client.generate(p, max_tokens=tokens, ignore_eos=True) for p in prompts]
        return time.perf_counter() - start, results


def row(system: str, seconds: float, results: list) -> dict:
    tokens = sum(len(r.token_ids) for r in results)
    drafted = sum(r.stats.draft_tokens for r in results)
    rounds = sum(r.stats.rounds for r in results)
    return {"system": system, "tokens_per_s": tokens / seconds, "seconds": seconds, "rounds": rounds,
            "drafted_tokens": drafted, "drafted_per_round": drafted / rounds if rounds else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--tiny", action="store_true", help="the tiny test models instead of the real target")
    parser.add_argument("--name", default="adaptive_unrelated_cpu")
    parser.add_argument("--interleave", type=int, default=1,
                        help="both systems loaded (in process, then as services), N timed runs each taking turns, "
                        "the medians (the real target twice: ~19 GB at its peak in one process, too much beside the services on a "
                        "24 GB machine: the run was killed for memory there)")
    args = parser.parse_args()
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
        from tiny_models import build_model, save_model

        root = Path(tempfile.mkdtemp())
        target_dir, draft_dir = (save_model(build_model("qwen2", seed=seed), root / name)
                                 for seed, name in ((0, "target"), (7, "unrelated")))
    else:
        target_dir = Path(resolve_model(TARGET))
        draft_dir = unrelated_draft(Path(tempfile.mkdtemp()) / "unrelated-0.5b", target_dir)
    prompts = [p["prompt"] for p in humaneval_prompts(args.prompts + 1)]
    warm, timed = prompts[0], prompts[1:]
    rows = []

    if args.interleave > 1:  # both engines at once, taking turns: a load that comes and goes weighs on both
        alone = LocalEngine(str(target_dir), None, num_speculative_tokens=0)
        engine = LocalEngine(str(target_dir), str(draft_dir), num_speculative_tokens=4)  # adaptive by default
        timed_in_process(alone, [warm], 8)
        timed_in_process(engine, [warm], args.tokens)
        runs = {"alone": [], "adaptive": []}
        for _ in range(args.interleave):
            runs["alone"].append(timed_in_process(alone, timed, args.tokens))
            runs["adaptive"].append(timed_in_process(engine, timed, args.tokens))
        (seconds, baseline), (spec_seconds, results) = (sorted(r, key=lambda x: x[0])[len(r) // 2]
                                                        for r in runs.values())
        rows.append({**row("in-process target-only", seconds, baseline), "runs_s": [x[0] for x in runs["alone"]]})
        rows.append({**row("in-process adaptive, unrelated draft", spec_seconds, results),
                     "runs_s": [x[0] for x in runs["adaptive"]]})
        del alone, engine
        gc.collect()  # engines sit in reference cycles: free their weights before the services load theirs
    else:
        alone = LocalEngine(str(target_dir), None, num_speculative_tokens=0)
        timed_in_process(alone, [warm], 8)
        seconds, baseline = timed_in_process(alone, timed, args.tokens)
        rows.append(row("in-process target-only", seconds, baseline))
        del alone
        gc.collect()
        engine = LocalEngine(str(target_dir), str(draft_dir), num_speculative_tokens=4)  # adaptive by default
        timed_in_process(engine, [warm], args.tokens)
        seconds, results = timed_in_process(engine, timed, args.tokens)
        rows.append(row("in-process adaptive, unrelated draft", seconds, results))
        del engine
        gc.collect()
    assert [r.token_ids for r in results] == [r.token_ids for r in baseline]  # exact whatever k was

    if args.interleave > 1:
        with Services(target_dir, None, 2048) as alone, Services(target_dir, draft_dir, 2048) as adaptive:
            timed_services(alone, [warm], 8)
            timed_services(adaptive, [warm], args.tokens)
            runs = {"alone": [], "adaptive": []}
            for _ in range(args.interleave):
                runs["alone"].append(timed_services(alone, timed, args.tokens))
                runs["adaptive"].append(timed_services(adaptive, timed, args.tokens))
        for system, key in (("services target-only", "alone"), ("services adaptive, unrelated draft", "adaptive")):
            seconds, results = sorted(runs[key], key=lambda x: x[0])[len(runs[key]) // 2]
            rows.append({**row(system, seconds, results), "runs_s": [x[0] for x in runs[key]]})
    else:
        with Services(target_dir, None, 2048) as address:
            timed_services(address, [warm], 8)
            rows.append(row("services target-only", *timed_services(address, timed, args.tokens)))
        with Services(target_dir, draft_dir, 2048) as address:
            timed_services(address, [warm], args.tokens)
            rows.append(row("services adaptive, unrelated draft", *timed_services(address, timed, args.tokens)))
    for adaptive, reference in ((rows[1], rows[0]), (rows[3], rows[2])):
        adaptive["vs_target_only"] = adaptive["tokens_per_s"] / reference["tokens_per_s"]
    draft = "tiny random qwen2 (never agrees)" if args.tiny else "random-weight Qwen2.5-0.5B shape (never agrees)"
    write_results(args.name, rows, {"prompts": args.prompts, "tokens": args.tokens, "draft": draft,
                                    "target": "tiny random qwen2" if args.tiny else TARGET,
                                    "load_avg_1m_at_end": os.getloadavg()[0],
                                    "in_process_openmp_wait": os.environ.get(WAIT_REASON_ENV)})
    print_table(rows, ["system", "tokens_per_s", "seconds", "rounds", "drafted_per_round", "vs_target_only"])


if __name__ == "__main__":
    main()
