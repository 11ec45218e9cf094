"""What logprobs cost while speculating, i.e. what `--no-logprobs-while-speculating` saves, CPU.

Logprobs are computed only for requests that ask for them, only on the target (the draft never computes any): per
sequence and verify step, a log-softmax over the vocabulary for the emitted rows (accepted + 1), a top-n and a copy
to the host (services/sampling/logprobs.py, called from the verifier's `_decide`), plus the TokenLogprob messages on
the wire. So the switch saves nothing for requests without logprobs; for requests with them it moves that cost off
the speculative path (they are refused, or run with speculation off).

Part A, per verify step (k = 4 proposals per sequence, so up to 5 emitted rows):
  - the logprob work itself: `token_logprobs` on 5 rows of the real 151,936-token vocabulary with 0, 5 and 20
    alternatives, median of `--reps` x 20 calls (a small, steady operation: timed alone, it is not lost in noise);
  - one TargetVerifier.verify call without logprobs at batch 1 and 8, median of `--reps` (the step it is added to, per
    sequence in the batch): the real target, Qwen2.5-Coder-1.5B-Instruct (float32, packed weights as served with a
    draft), and a tiny random Qwen2 (2 layers, hidden 64) with the same vocabulary, where the forward is almost free
    and the logprob work shows at its largest.
Part B, end to end in one process, the real pair, greedy, k = 4, batch 1, `--prompts` HumanEval prompts x
`--max-tokens`, configurations interleaved per prompt: speculating without logprobs, speculating with 20, and
target-only with 20 (what a logprob request gets under the switch).

    python bench/bench_logprobs_cpu.py [--reps 15] [--prompts 3] [--max-tokens 64]
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from prompts import humaneval_prompts  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.loader import load_model  # noqa: E402
from specsplit.services.models.prepare import resolve_model  # noqa: E402
from specsplit.services.models.weight_formats import target_weight_request, use_weight_format  # noqa: E402
from specsplit.services.runtime.model_runner import ModelRunner  # noqa: E402
from specsplit.services.runtime.worker_sequences import WorkerSampling  # noqa: E402
from specsplit.services.sampling.logprobs import token_logprobs  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402
from specsplit.services.target.verifier import TargetPrefill, TargetVerifier, VerifyItem  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
K = 4


def tiny_model_with_real_vocab(folder: Path, vocab_size: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def target_verifier(model_path: str) -> TargetVerifier:
    loaded = load_model(model_path, "float32", "cpu")
    use_weight_format(loaded, target_weight_request("auto", speculative=True), "target")
    return TargetVerifier(ModelRunner(loaded, num_blocks=256))


def verify_step_ms(verifier: TargetVerifier, batch: int, reps: int) -> float:
    """Median milliseconds of one verify call (no logprobs) over `batch` sequences."""
    vocab = verifier.runner.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (200,), generator=generator).tolist() for _ in range(batch)]
    verdicts = verifier.prefill([TargetPrefill(f"s{b}", p, WorkerSampling(0.0, 0, 1.0, b)) for b, p in enumerate(prompts)])
    drafts = [torch.randint(0, vocab, (K,), generator=generator).tolist() for _ in range(batch)]
    # Every call rewinds to the prompt and verifies the same proposals: identical work each time.
    items = [VerifyItem(f"s{b}", len(p), [v.token_ids[0]], d, torch.tensor(d)[:, None], torch.ones(K, 1))
             for b, (p, v, d) in enumerate(zip(prompts, verdicts, drafts))]
    times = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        verifier.verify(items)
        if rep:  # the first call warms up
            times.append(time.perf_counter() - start)
    verifier.release([f"s{b}" for b in range(batch)])
    return statistics.median(times) * 1e3


def logprob_work_ms(vocab: int, top_n: int, reps: int, calls: int = 20) -> float:
    """Median milliseconds of the logprob work for one sequence's K + 1 emitted rows."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(K + 1, vocab, generator=generator) * 4
    tokens = logits.argmax(-1).tolist()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            token_logprobs(logits, tokens, top_n)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) * 1e3


def end_to_end(prompts: list[str], max_tokens: int) -> list[dict]:
    engine = LocalEngine(str(resolve_model(TARGET)), str(resolve_model(DRAFT)), num_speculative_tokens=K)
    configs = [("speculative, no logprobs", dict(logprobs=None, speculation="fixed")),  # k = K every round
               ("speculative, logprobs 20", dict(logprobs=20, speculation="fixed")),
               ("target-only, logprobs 20", dict(logprobs=20, num_speculative_tokens=0))]

    async def one(prompt, params):
        start = time.perf_counter()
        result = await engine.generate(prompt, params)
        await engine.coordinator.wait_idle()
        return result, time.perf_counter() - start

    for prompt in dict.fromkeys(prompts):  # warm-up, and every prompt's KV into the prefix cache: no config pays it
        asyncio.run(one(prompt, SamplingParams(max_tokens=2)))
    totals = {name: [0, 0.0] for name, _ in configs}
    outputs = {}
    for i, prompt in enumerate(prompts):
        for name, extra in configs[i % 3:] + configs[: i % 3]:  # interleaved per prompt, order rotated
            result, seconds = asyncio.run(one(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)))
            totals[name][0] += len(result.token_ids)
            totals[name][1] += seconds
            outputs.setdefault(prompt, set()).add(tuple(result.token_ids))
    assert all(len(v) == 1 for v in outputs.values()), "greedy outputs differ between configurations"
    base = totals[configs[0][0]][0] / totals[configs[0][0]][1]
    return [{"config": name, "tokens": n, "seconds": round(s, 2), "tokens_per_s": round(n / s, 2),
             "vs_speculative_without_logprobs": round((n / s) / base, 3)} for name, (n, s) in totals.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--e2e-reps", type=int, default=2, help="part B runs the prompt list this many times")
    args = parser.parse_args()

    target = str(resolve_model(TARGET))
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    work = {n: logprob_work_ms(vocab, n, args.reps) for n in (0, 5, 20)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(tiny_model_with_real_vocab(Path(tmp) / "tiny", vocab))
        for label, path in (("tiny random, real vocab", tiny), ("Qwen2.5-Coder-1.5B", target)):
            verifier = target_verifier(path)
            for batch in (1, 8):
                step = verify_step_ms(verifier, batch, args.reps)
                for top_n, ms in work.items():
                    # Every sequence of the batch asking for logprobs: batch x the per-sequence work.
                    rows.append({"part": "A verify step", "model": label, "batch": batch, "top_n": top_n,
                                 "verify_step_ms": round(step, 2), "logprob_ms_per_sequence": round(ms, 3),
                                 "logprob_share_if_all_ask": round(batch * ms / (step + batch * ms), 4)})
                print(rows[-1], flush=True)
            del verifier
    print_table(rows, ["model", "batch", "top_n", "verify_step_ms", "logprob_ms_per_sequence", "logprob_share_if_all_ask"])
    e2e = end_to_end([p["prompt"] for p in humaneval_prompts(args.prompts)] * args.e2e_reps, args.max_tokens)
    print_table(e2e, ["config", "tokens", "seconds", "tokens_per_s", "vs_speculative_without_logprobs"])
    path = write_results("logprobs_cpu", rows + [{"part": "B end to end", **r} for r in e2e], {
        "k": K, "reps": args.reps, "prompts": f"HumanEval[:{args.prompts}] x {args.e2e_reps}", "max_tokens": args.max_tokens,
        "note": "part A: logprob work per sequence timed alone (5 rows, real vocabulary); verify step = median of one "
                "TargetVerifier.verify call without logprobs (k=4 per sequence, 200-token prompts); share = batch x "
                "work / (step + batch x work). Part B: in-process engine, greedy, batch 1, default weight formats, "
                "configurations interleaved per prompt in rotating order after a warm-up that puts every prompt in "
                "the prefix cache. Shared 2-core machine with other work running: part B differences of a few "
                "percent are noise.",
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
