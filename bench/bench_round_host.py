"""Host time per round of the in-process engine, with the device work taken out: what the coordinator, the draft
proposer and the target verifier spend in Python per round, at batch 1, 8, 32, 64.

The model runners' step programs are replaced by a stand-in that does all of the call's host work (block-table
sync, packing the inputs) and returns a made-up result of the right shape instantly (every proposal accepted, so
rounds look like a trained pair's at acceptance 1); prefills run the tiny model for real. The tokenizer is the
real Qwen2.5 one (detokenization is part of every round), taken from the prepared target when it is there.
On a GPU the same host work precedes every graph replay (bench_gpu_steps.py measures it there as host_ms).

    python bench/bench_round_host.py [--batches 1,8,32,64] [--tokens 128] [--profile]
"""

import argparse
import asyncio
import cProfile
import pstats
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.coordinator.coordinator import CoordinatorConfig  # noqa: E402
from specsplit.services.draft.draft_steps import DraftSteps  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.runtime.cuda_graphs import bucket_for  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402
from tiny_models import build_model, save_model  # noqa: E402

VOCAB = 151936
TOKEN = 4416  # a plain word piece of the Qwen vocabulary


def instant_steps(runner):
    """Replace `runner.run_step` by its host work plus a made-up result (see the module docstring)."""

    def run_step(program, shape, values, tables):
        bucket = bucket_for(len(tables)) or len(tables)
        layout = program.layout(shape, bucket)
        layout.pack({**values, **runner.block_tables.sync(tables)}, np.empty(layout.size, dtype=np.int64))
        if program is DraftSteps:
            out = np.zeros((bucket, shape.steps, 1 + 2 * shape.support), dtype=np.int32)
            out[..., 0] = out[..., 1] = TOKEN
            out[..., 1 + shape.support] = np.float32(1.0).view(np.int32)
            return out
        k = np.asarray(values["k"])
        n_delta = np.asarray(values["n_delta"])
        out = np.full((bucket, shape.steps + 2), -1, dtype=np.int32)
        for b in range(len(tables)):  # accept every proposal, then a bonus token
            out[b, : k[b]] = values["tokens"][b, n_delta[b] : n_delta[b] + k[b]]
            out[b, k[b]] = TOKEN
            out[b, shape.steps + 1] = k[b]
        return out

    runner.run_step = run_step


def tokenizer(folder: str | None):
    """The Qwen2.5 tokenizer: from `folder` (tokenizer files only will do), else the prepared built-in target."""
    from transformers import AutoTokenizer

    if folder is None:
        from specsplit.services.models.prepare import prepared_path

        folder = prepared_path("qwen2.5-coder-1.5b-instruct")
        if folder is None:
            raise SystemExit("prepare the built-in target (specsplit models prepare qwen2.5-coder-1.5b-instruct) "
                             "or pass --tokenizer")
    return AutoTokenizer.from_pretrained(folder)


def run(engine, batch: int, k: int, tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, num_speculative_tokens=k)
    prompts = [[TOKEN + i] * 16 for i in range(batch)]

    async def main():
        return await asyncio.gather(*(engine.coordinator.generate(engine.request(p, params)) for p in prompts))

    results = asyncio.run(main())
    # Rounds only: from each request's first token (its prefill, which runs the tiny model for real) to its end.
    per_round = sorted((r.total_time - r.time_to_first_token) / r.stats.rounds for r in results)[len(results) // 2]
    return {"batch": batch, "k": k, "rounds": results[0].stats.rounds, "host_ms_per_round": 1e3 * per_round,
            "host_us_per_round_per_sequence": 1e6 * per_round / batch}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--name", default="")
    parser.add_argument("--tokenizer", default=None, help="folder with the Qwen2.5 tokenizer files")
    args = parser.parse_args()
    root = Path(__import__("tempfile").mkdtemp())
    model = save_model(build_model("qwen2", seed=0, vocab_size=VOCAB), root / "model", with_tokenizer=False)
    tok = tokenizer(args.tokenizer)
    rows = []
    for k in (0, 4):
        engine = LocalEngine(str(model), str(model) if k else None, num_speculative_tokens=max(k, 1),
                             coordinator_config=CoordinatorConfig(max_num_seqs=256), prefix_caching=False)
        engine.coordinator.tokenizer = tok
        for runner in (engine.target_runner, getattr(engine, "draft_runner", None)):
            if runner is not None:
                instant_steps(runner)
        run(engine, 2, k, 8)  # warm-up
        for batch in [int(b) for b in args.batches.split(",")]:
            if args.profile and batch == max(int(b) for b in args.batches.split(",")):
                profiler = cProfile.Profile()
                profiler.enable()
                row = run(engine, batch, k, args.tokens)
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            else:
                row = run(engine, batch, k, args.tokens)
            rows.append(row)
            print(row, flush=True)
    write_results(f"round_host_cpu{args.name}", rows, {"tokens": args.tokens,
                                                       "note": "device work replaced by an instant stand-in"})
    print_table(rows, ["batch", "k", "rounds", "host_ms_per_round", "host_us_per_round_per_sequence"])


if __name__ == "__main__":
    main()
