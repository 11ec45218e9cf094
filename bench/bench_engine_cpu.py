"""Target-only vs speculative decoding in one process on the CPU with small random-weight models.

The target is a 12-layer Qwen2-shaped random model whose layers 4-12 write only weakly into the residual stream
(their output projections are scaled down), and the draft is the target's first 3 layers with the same final norm
and head (self-speculation): ~4x cheaper, and it agrees with the target often but not always, like a trained pair. Same prompts,
same requests, one run; reports tokens/s, acceptance, mean emitted tokens per round, and the speedup over
target-only with the Leviathan bound E/(1+k*c) beside it, c measured as draft step time / target step time.

    python bench/bench_engine_cpu.py [--max-tokens 96] [--batch 1]
"""

import argparse
import asyncio
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.coordinator.coordinator import CoordinatorConfig  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.loader import load_model  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402
from tiny_models import build_model, save_model  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:", "The answer is"]


def build_pair(root: Path):
    target = build_model("qwen2", seed=0, scale=0.12, hidden_size=256, intermediate_size=768, num_hidden_layers=12,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    with torch.no_grad():  # later layers perturb the residual stream only a little
        for layer in target.model.layers[3:]:
            layer.self_attn.o_proj.weight.mul_(0.03)
            layer.mlp.down_proj.weight.mul_(0.03)
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:3]
    draft.config.num_hidden_layers = 3
    if hasattr(draft.config, "layer_types"):
        draft.config.layer_types = draft.config.layer_types[:3]
    return save_model(target, root / "target"), save_model(draft, root / "draft")


async def run(engine, prompts, params):
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.coordinator.generate(engine.request(p, params)) for p in prompts))
    elapsed = time.perf_counter() - start
    await engine.coordinator.wait_idle()
    return results, elapsed


def step_cost_ratio(target_dir, draft_dir) -> float:
    """c: one draft decode step over one target decode step (batch 1, 64-token context)."""
    from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner

    times = {}
    for name, path in (("target", target_dir), ("draft", draft_dir)):
        runner = ModelRunner(load_model(str(path)), num_blocks=64)
        table = runner.block_manager.allocate(0)
        first = ForwardItem(table, list(range(1, 65)), 1)
        runner.reserve([first])
        runner.forward([first])
        samples = []
        for i in range(30):
            item = ForwardItem(table, [5], 1)
            runner.reserve([item])
            t = time.perf_counter()
            runner.forward([item])
            samples.append(time.perf_counter() - t)
        times[name] = sorted(samples)[len(samples) // 2]
    return times["draft"] / times["target"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=1, help="concurrent requests per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # Small models on 2 cores run faster single-threaded (no thread hand-offs per tiny op).
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    target_dir, draft_dir = build_pair(root)
    target, draft = load_model(str(target_dir)), load_model(str(draft_dir))
    c = step_cost_ratio(target_dir, draft_dir)
    prompts = (PROMPTS * ((args.batch + len(PROMPTS) - 1) // len(PROMPTS)))[: max(args.batch, len(PROMPTS))]
    rows = []
    engine = LocalEngine(target, draft, num_speculative_tokens=8, num_kv_blocks=512, coordinator_config=CoordinatorConfig(),
                         prefix_caching=False)
    asyncio.run(run(engine, prompts[:1], SamplingParams(max_tokens=8)))  # warm-up
    # Every k runs once per repetition, in turn, so load that drifts over the run hits every k alike; each k's
    # time is its median over repetitions.
    ks = list(range(0, 9))
    times = {k: [] for k in ks}
    stats = {}
    for _ in range(args.repeats):
        for k in ks:
            p = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, num_speculative_tokens=k,
                               speculation="fixed" if k else None)  # exactly k a round, not the policy's pick
            elapsed_total, results_all = 0.0, []
            for i in range(0, len(prompts), args.batch):
                results, elapsed = asyncio.run(run(engine, prompts[i : i + args.batch], p))
                elapsed_total += elapsed
                results_all.extend(results)
            times[k].append(elapsed_total)
            stats[k] = results_all
    reference = [r.token_ids for r in stats[0]]
    tokens = sum(len(t) for t in reference)
    baseline = tokens / statistics.median(times[0])
    for k in ks:
        results = stats[k]
        drafted = sum(r.stats.draft_tokens for r in results)
        accepted = sum(r.stats.accepted_tokens for r in results)
        rounds = sum(r.stats.rounds for r in results)
        alpha = accepted / drafted if drafted else 0.0
        expected = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
        tps = tokens / statistics.median(times[k])
        rows.append({
            "k": k,
            "tokens_per_s": tps,
            "speedup": tps / baseline,
            "acceptance": alpha,
            "tokens_per_round": (tokens - len(prompts)) / rounds if rounds else 0.0,
            "bound": expected / (1 + k * c) if k else 1.0,
            "identical_to_target_only": [r.token_ids for r in results] == reference,
        })
    write_results(f"engine_cpu_batch{args.batch}", rows, {"draft_target_step_cost_ratio_c": c, "max_tokens": args.max_tokens,
                                                       "models": "random Qwen2 12-layer target (hidden 256), draft = its first 3 layers"})
    print(f"c = {c:.3f}")
    print_table(rows, ["k", "tokens_per_s", "speedup", "acceptance", "tokens_per_round", "bound", "identical_to_target_only"])


if __name__ == "__main__":
    main()
