"""Tensor parallelism on a 2-GPU machine (NCCL): random-weight bf16 models of real shapes, in-process engine
(this process is rank 0 of a sharded model, rank 1 its child process; a degree-1 draft shares GPU 0).

1. decode: a Qwen2.5-7B-shaped target, batch 1, target only, at degree 1 vs 2. Goal: degree 2 >= 1.6x degree 1.
2. speculative: the 7B-shaped target at degree 2 with a Qwen2.5-0.5B-shaped draft at degree 1, k = 4, at
   alpha = 0.7 through the SYNTHETIC ACCEPTANCE benchmark mode (services/target/synthetic_acceptance.py, NOT
   LOSSLESS: random weights never agree, so a coin accepts each proposal with probability alpha; emitted tokens are
   the target's own samples). Against the same at degree 1 and target-only at degree 2.
3. big: a Llama-3-70B-shaped bf16 target (~141 GB: no single GPU holds it) built in memory at degree 2 (each rank
   draws its own shard's random weights on its GPU: sharded_loader's RANDOM_WEIGHTS_MARKER), with a
   Llama-3.2-1B-shaped draft at degree 1; target-only and speculative (alpha 0.7) tokens/s against the bandwidth
   floor: bytes a rank reads per decode step (its weight shard) / the GPU's measured copy bandwidth.

    OUT=/some/dir python3 bench/bench_gpu_tensor_parallel.py [--parts decode,speculative,big] [--tokens 128]
    python3 bench/bench_gpu_tensor_parallel.py --dry-run     # CPU, gloo, tiny shapes: checks the script end to end

Results: $OUT/gpu_tensor_parallel.json (bench/results/ without $OUT) with commit, machine and command.
"""

import argparse
import asyncio
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.config import DecoderConfig  # noqa: E402
from specsplit.services.models.decoder import CausalDecoder  # noqa: E402
from specsplit.services.models.loader import LoadedModel  # noqa: E402
from specsplit.services.models.rotary import RotaryEmbedding  # noqa: E402
from specsplit.services.models.sharded_loader import RANDOM_WEIGHTS_MARKER  # noqa: E402
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
    "llama-3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                                   rope_theta=500000.0, max_position_embeddings=8192)),
    # --dry-run only
    "tiny-target": ("qwen2", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                  max_position_embeddings=512)),
    "tiny-draft": ("qwen2", dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                 max_position_embeddings=512)),
}
PLANS = {  # part -> (target shape, draft shape)
    "decode": ("qwen2.5-7b", None),
    "speculative": ("qwen2.5-7b", "qwen2.5-0.5b"),
    "big": ("llama-3-70b", "llama-3.2-1b"),
}
DRY_RUN = {"qwen2.5-7b": "tiny-target", "qwen2.5-0.5b": "tiny-draft", "llama-3-70b": "tiny-target",
           "llama-3.2-1b": "tiny-draft"}
K = 4
ALPHA = 0.7
PROMPT_LEN = 32


def log(*args):
    print(*args, flush=True)


def model_folder(root: Path, shape: str) -> Path:
    """config.json and the random-weights marker: what a sharded rank builds its random shard from."""
    from transformers import LlamaConfig, Qwen2Config

    family, values = SHAPES[shape]
    folder = root / shape
    if not folder.exists():
        config = (Qwen2Config if family == "qwen2" else LlamaConfig)(**values, eos_token_id=0, bos_token_id=None)
        config.save_pretrained(folder)
        (folder / RANDOM_WEIGHTS_MARKER).write_text(json.dumps({"seed": 0, "std": 0.02}))
    return folder


def whole_model(folder: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    """Degree 1: the ordinary decoder with random weights drawn on the device (bench_gpu_e2e.py does the same)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(folder)
    config = DecoderConfig.from_hf(hf_config)
    with torch.device("meta"):
        decoder = CausalDecoder(config)
    decoder = decoder.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        decoder.lm_head.weight = decoder.model.embed_tokens.weight
    decoder.rotary = RotaryEmbedding(hf_config, config.head_dim).to(device)
    with torch.no_grad():
        for name, parameter in decoder.named_parameters():
            parameter.fill_(1.0) if "norm" in name else parameter.normal_(0.0, 0.02)
    decoder.eval().requires_grad_(False)
    return LoadedModel(decoder, config, None, str(folder), folder.name)


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
    return 2 * size * repeats / (time.perf_counter() - start)


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def decode(engine: LocalEngine, tokens: int, k: int, repeats: int, vocab: int) -> dict:
    """Batch 1; decode rate = tokens after the first / time after the first. The first run warms up."""
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, num_speculative_tokens=k, temperature=0.0, seed=1)

    async def once():
        result = await engine.generate(prompt, params)
        await engine.coordinator.wait_idle()
        return result

    asyncio.run(once())
    rates, rounds = [], []
    for _ in range(repeats):
        result = asyncio.run(once())
        decode_time = result.total_time - result.time_to_first_token
        rates.append((result.completion_tokens - 1) / decode_time)
        rounds.append(result.stats.rounds)
    rates.sort()
    return {"tokens_per_s": rates[len(rates) // 2], "repeats_tokens_per_s": rates,
            "tokens_per_round": (tokens - 1) / max(rounds[0] - 1, 1) if k else 1.0}


def run_config(root: Path, args, target: str, draft: str | None, degree: int, alpha: float | None) -> dict:
    target_shape = DRY_RUN[target] if args.dry_run else target
    draft_shape = (DRY_RUN[draft] if args.dry_run else draft) if draft else None
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    device = "cpu" if args.dry_run else "cuda"
    target_folder = model_folder(root, target_shape)
    target_model = str(target_folder) if degree > 1 else whole_model(target_folder, dtype, device)
    draft_model = whole_model(model_folder(root, draft_shape), dtype, device) if draft_shape else None
    started = time.perf_counter()
    engine = LocalEngine(target_model, draft_model, num_speculative_tokens=K if draft else 0,
                         dtype="float32" if args.dry_run else "bfloat16", device=device, speculation="fixed",
                         synthetic_acceptance=alpha, target_tensor_parallel_size=degree,
                         target_weights="dense", draft_weights="dense")
    load_s = time.perf_counter() - started
    try:
        measured = decode(engine, args.tokens, K if draft else 0, args.repeats, SHAPES[target_shape][1]["vocab_size"])
    finally:
        asyncio.run(engine.close())
        del engine, target_model, draft_model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    row = {"target": target, "draft": draft or "", "target_degree": degree, "draft_degree": 1 if draft else None,
           "alpha": alpha if draft else None, "acceptance": "synthetic" if draft else None, "k": K if draft else 0,
           "load_s": round(load_s, 1), **measured}
    log(json.dumps(row))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="decode,speculative,big")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes: the script's own check")
    parser.add_argument("--name", default="gpu_tensor_parallel")
    args = parser.parse_args()
    if args.dry_run:
        args.tokens, args.repeats = min(args.tokens, 8), 1
        os.environ.setdefault("SPECSPLIT_KV_CACHE_BYTES", str(16 << 20))
    else:
        if torch.cuda.device_count() < 2:
            raise SystemExit(f"needs 2 GPUs, found {torch.cuda.device_count()} (--dry-run runs on the CPU)")
        os.environ.setdefault("SPECSPLIT_KV_CACHE_BYTES", str(2 << 30))
    parts = [p for p in args.parts.split(",") if p]
    device = "cpu" if args.dry_run else "cuda"
    bandwidth = copy_bandwidth(device)
    rows, summary = [], {"copy_bandwidth_GBps": round(bandwidth / 1e9, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "decode" in parts:
            target, _ = PLANS["decode"]
            one, two = (run_config(root, args, target, None, d, None) for d in (1, 2))
            rows += [one, two]
            summary["decode_speedup_degree2_vs_1"] = round(two["tokens_per_s"] / one["tokens_per_s"], 3)
            summary["decode_goal_1_6x_met"] = summary["decode_speedup_degree2_vs_1"] >= 1.6
        if "speculative" in parts:
            target, draft = PLANS["speculative"]
            spec_one = run_config(root, args, target, draft, 1, ALPHA)
            spec_two = run_config(root, args, target, draft, 2, ALPHA)
            plain_two = next((r for r in rows if r["target"] == target and not r["draft"] and r["target_degree"] == 2),
                             None) or run_config(root, args, target, None, 2, None)
            rows += [spec_one, spec_two] + ([plain_two] if plain_two not in rows else [])
            summary["speculative_degree2_vs_degree1"] = round(spec_two["tokens_per_s"] / spec_one["tokens_per_s"], 3)
            summary["speculative_vs_target_only_degree2"] = round(spec_two["tokens_per_s"] / plain_two["tokens_per_s"], 3)
        if "big" in parts:
            target, draft = PLANS["big"]
            shape = DRY_RUN[target] if args.dry_run else target
            element = 4 if args.dry_run else 2
            floor_step = weight_bytes(shape, 2, element) / bandwidth  # every rank reads its shard at once
            draft_step = weight_bytes(DRY_RUN[draft] if args.dry_run else draft, 1, element) / bandwidth
            plain = run_config(root, args, target, None, 2, None)
            spec = run_config(root, args, target, draft, 2, ALPHA)
            # Target only: one token per target step. Speculative: E tokens per round of k draft steps (degree 1,
            # its whole weights) and one verification (the target's shard), E = (1 - alpha^(k+1)) / (1 - alpha).
            expected_per_round = (1 - ALPHA ** (K + 1)) / (1 - ALPHA)
            floors = {id(plain): 1 / floor_step, id(spec): expected_per_round / (floor_step + K * draft_step)}
            for row in (plain, spec):
                row["bandwidth_floor_tokens_per_s"] = round(floors[id(row)], 2)
                row["fraction_of_floor"] = round(row["tokens_per_s"] / floors[id(row)], 3)
            rows += [plain, spec]
            summary["big_weight_bytes_per_rank"] = weight_bytes(shape, 2, 4 if args.dry_run else 2)
    print_table(rows, ["target", "draft", "target_degree", "alpha", "tokens_per_s", "tokens_per_round",
                       "bandwidth_floor_tokens_per_s", "fraction_of_floor"])
    log(json.dumps(summary))
    if args.dry_run:
        summary["note"] = "DRY RUN: CPU, gloo, tiny shapes; numbers mean nothing"
    path = write_results(args.name + ("_dry_run" if args.dry_run else ""), rows, {"summary": summary})
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
