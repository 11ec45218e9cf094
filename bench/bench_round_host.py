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


def instant_steps(runner, accept: bool = True):
    """Replace `runner.run_step` by its host work plus a made-up result (see the module docstring); `accept` False:
    every proposal is rejected, as with an unrelated draft."""

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
        for b in range(len(tables)):  # accept every proposal, then a bonus token (or reject them all)
            accepted = k[b] if accept else 0
            out[b, :accepted] = values["tokens"][b, n_delta[b] : n_delta[b] + accepted]
            out[b, accepted] = TOKEN
            out[b, shape.steps + 1] = accepted
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


def run(engine, batch: int, k: int | None, tokens: int, mode: str) -> dict:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, num_speculative_tokens=k)
    prompts = [[TOKEN + i] * 16 for i in range(batch)]

    async def main():
        return await asyncio.gather(*(engine.coordinator.generate(engine.request(p, params)) for p in prompts))

    results = asyncio.run(main())
    # Rounds only: from each request's first token (its prefill, which runs the tiny model for real) to its end.
    per_round = sorted((r.total_time - r.time_to_first_token) / r.stats.rounds for r in results)[len(results) // 2]
    return {"mode": mode, "batch": batch, "k": "adaptive" if k is None else k, "rounds": results[0].stats.rounds, "host_ms_per_round": 1e3 * per_round,
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
    # Target-only (no draft); a fixed k = 4 with every proposal accepted; and the policy's choice with every
    # proposal rejected (an unrelated draft: it settles on k = 0 with a probe now and then), whose host time per round
    # should be target-only's.
    for mode, k, accept in (("target_only", 0, True), ("fixed_k4", 4, True), ("adaptive_unrelated", None, False)):
        engine = LocalEngine(str(model), str(model) if k != 0 else None, num_speculative_tokens=4,
                             coordinator_config=CoordinatorConfig(max_num_seqs=256,
                                                                  speculation="fixed" if k else "adaptive"),
                             prefix_caching=False)
        engine.coordinator.tokenizer = tok
        for runner in (engine.target_runner, getattr(engine, "draft_runner", None)):
            if runner is not None:
                instant_steps(runner, accept)
        run(engine, 2, k, 8, mode)  # warm-up
        for batch in [int(b) for b in args.batches.split(",")]:
            run(engine, batch, k, args.tokens, mode)  # lets the policy measure this batch size
            if args.profile and batch == max(int(b) for b in args.batches.split(",")):
                profiler = cProfile.Profile()
                profiler.enable()
                row = run(engine, batch, k, args.tokens, mode)
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            else:
                row = run(engine, batch, k, args.tokens, mode)
            rows.append(row)
            print(row, flush=True)
    write_results(f"round_host_cpu{args.name}", rows, {"tokens": args.tokens,
                                                       "note": "device work replaced by an instant stand-in"})
    print_table(rows, ["mode", "batch", "k", "rounds", "host_ms_per_round", "host_us_per_round_per_sequence"])


if __name__ == "__main__":
    main()
