"""End to end on one GPU: target-only, speculative in one process, speculative split across processes, and
transformers `generate` (eager, and with a static cache under torch.compile) / assisted generation, on random-weight
models of Qwen2.5 shapes (bf16).

Random weights give near-uniform next-token distributions, so a random draft is (almost) never accepted. To show
realistic round shapes the speculative runs use the SYNTHETIC ACCEPTANCE benchmark mode
(services/target/synthetic_acceptance.py, NOT LOSSLESS): each proposal is accepted with probability alpha by a coin;
emitted tokens are still real samples of the target. Rows measured that way say `acceptance: synthetic`. alpha = 1
is measured for real, with draft = target (same weights) and the real rejection sampler (greedy).

The adaptive rows speculate with the random draft for real (the real rejection sampler: acceptance ~ 0, an
unrelated draft) under the adaptive speculation policy: they show what speculation costs when it cannot help.
The synthetic rows use a fixed k (--speculation fixed), as the goals are stated for k = 4.

All models use vocabulary 151936 (Qwen2.5 0.5B/1.5B's; the 7B's real 152064 would not match the draft's).
The bound is E/(1+k*c) (DESIGN.md), with c = draft step / target decode step, both measured here at batch 1 as the
workers run them (a draft call of k steps / k, against a one-token verification).

    python3 bench/bench_gpu_e2e.py [--targets 7b,1.5b] [--batches 1,8,32,64] [--split-batches 1,8]
"""

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.coordinator.coordinator import CoordinatorConfig  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.models.config import DecoderConfig  # noqa: E402
from specsplit.services.models.decoder import CausalDecoder  # noqa: E402
from specsplit.services.models.loader import LoadedModel  # noqa: E402
from specsplit.services.models.rotary import RotaryEmbedding  # noqa: E402
from specsplit.services.draft.proposer import DraftPrefill, DraftProposer, ProposeItem  # noqa: E402
from specsplit.services.runtime.model_runner import ModelRunner  # noqa: E402
from specsplit.services.runtime.worker_sequences import WorkerSampling  # noqa: E402
from specsplit.services.sampling_params import SamplingParams  # noqa: E402
from specsplit.services.target.verifier import TargetPrefill, TargetVerifier, VerifyItem  # noqa: E402

VOCAB = int(os.environ.get("SPECSPLIT_BENCH_VOCAB", 151936))
DEVICE = os.environ.get("SPECSPLIT_BENCH_DEVICE", "cuda")  # "cpu" only for a smoke run of this script
QWEN25 = {  # Qwen2.5 config.json values (base and coder share them)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False),  # smoke runs of this script only
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
}
K = 4
PROMPT_LEN = 32
RESULTS: dict = {"rows": [], "notes": []}
REPEATS = 1  # --repeats: each measured configuration runs this often; rows report the median run


def _empty_cache():
    if DEVICE != "cpu":
        torch.cuda.empty_cache()


def _sync():
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def log(*args):
    print(*args, flush=True)


def hf_random_model(size: str, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                         bos_token_id=None, eos_token_id=None, **QWEN25[size])
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():  # explicit init (never benchmark on uninitialised or zero weights)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def loaded_from_hf(hf, name: str) -> LoadedModel:
    """Our decoder with the same weights, built in-process (what load_model does from a folder)."""
    config = DecoderConfig.from_hf(hf.config)
    with torch.device("meta"):
        decoder = CausalDecoder(config)
    decoder = decoder.to_empty(device=DEVICE).to(torch.bfloat16)
    if config.tie_word_embeddings:
        decoder.lm_head.weight = decoder.model.embed_tokens.weight
    decoder.rotary = RotaryEmbedding(hf.config, config.head_dim).to(DEVICE)
    decoder.load_hf_state_dict(dict(hf.state_dict()))
    decoder.eval().requires_grad_(False)
    return LoadedModel(decoder, config, None, "", name)


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, VOCAB, (batch, PROMPT_LEN), generator=g).tolist()


def run_local(engine: LocalEngine, batch: int, k: int | None, max_tokens: int):
    """k None: the engine's policy chooses (adaptive speculation). Seeds are fixed, so the synthetic coin falls the
    same way in every repeat and the warm-up run meets every graph shape the timed runs will."""
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k, temperature=0.0,
                             seed=i) for i in range(batch)]

    async def main():
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts(batch), params)))
        elapsed = time.perf_counter() - start
        await engine.coordinator.wait_idle()
        return results, elapsed

    runs = []
    for _ in range(REPEATS):
        with DraftWork(engine) as work:
            run = summarize(*asyncio.run(main()), batch)
        runs.append({**run, **work.summary()})
    runs.sort(key=lambda r: r["tokens_per_s_total"])
    median = dict(runs[len(runs) // 2])
    median["repeats_tokens_per_s_total"] = [r["tokens_per_s_total"] for r in runs]
    return median


class DraftWork:
    """Where a run's time goes besides the target: the speculation lengths the policy chose (rounds per k) and the
    draft's calls (prefills of new requests, proposals with their catch-ups), counted and timed (each call ends with
    its one wait, so wall time is device time plus the call's host work)."""

    def __init__(self, engine: LocalEngine):
        self.engine = engine
        self.k_rounds: dict[int, int] = {}
        self.calls = {"draft_prefill": [0, 0.0], "draft_propose": [0, 0.0], "target_prefill": [0, 0.0],
                      "target_verify": [0, 0.0]}

    def __enter__(self):
        policy, proposer, verifier = self.engine.coordinator.policy, self.engine.proposer, self.engine.verifier
        self.saved = (policy.choose_round, proposer and proposer.prefill, proposer and proposer.propose,
                      verifier.prefill, verifier.verify)

        def choose_round(*args, **kwargs):  # what the coordinator calls for a round's k
            k, probe = self.saved[0](*args, **kwargs)
            self.k_rounds[k] = self.k_rounds.get(k, 0) + 1
            return k, probe

        def timed(name, call):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return call(*args, **kwargs)
                finally:
                    self.calls[name][0] += 1
                    self.calls[name][1] += time.perf_counter() - t0
            return wrapper

        policy.choose_round = choose_round
        verifier.prefill = timed("target_prefill", self.saved[3])
        verifier.verify = timed("target_verify", self.saved[4])
        if proposer is not None:
            proposer.prefill = timed("draft_prefill", self.saved[1])
            proposer.propose = timed("draft_propose", self.saved[2])
        return self

    def __exit__(self, *exc):
        policy, proposer, verifier = self.engine.coordinator.policy, self.engine.proposer, self.engine.verifier
        del policy.choose_round, verifier.prefill, verifier.verify
        if proposer is not None:
            del proposer.prefill, proposer.propose

    def summary(self) -> dict:
        return {"rounds_per_k": dict(sorted(self.k_rounds.items())),
                **{f"{name}_calls": n for name, (n, _) in self.calls.items()},
                **{f"{name}_seconds": s for name, (_, s) in self.calls.items()}}


def summarize(results, elapsed, batch) -> dict:
    tokens = sum(len(r.token_ids) for r in results)
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    rounds = sum(r.stats.rounds for r in results)
    return {"tokens_per_s_total": tokens / elapsed, "tokens_per_s_per_request": tokens / elapsed / batch,
            "accepted_per_drafted": accepted / drafted if drafted else None,
            "tokens_per_round": (tokens - batch) / rounds if rounds else None, "seconds": elapsed}


def step_times(draft: LoadedModel, target: LoadedModel, context: int = 64, repeats: int = 30) -> dict:
    """Seconds of the worker calls at batch 1 as the workers run them (graphs by default): a draft call of K steps,
    a target decode (one token) and a verification of K proposals; the KV is rewound every call."""
    greedy = WorkerSampling(0.0, 0, 1.0, 1)
    ids = prompts(1)[0] * (context // PROMPT_LEN + 1)
    proposer = DraftProposer(ModelRunner(draft, num_blocks=context // 16 + 8, prefix_caching=False))
    proposer.prefill([DraftPrefill("s", ids[:context], greedy)])
    verifier = TargetVerifier(ModelRunner(target, num_blocks=context // 16 + 8, prefix_caching=False))
    verifier.prefill([TargetPrefill("s", ids[:context], greedy)])
    drafts = ids[:K]
    q = (torch.tensor(drafts)[:, None], torch.ones(K, 1))

    def median(call):
        call()
        samples = []
        for _ in range(repeats):
            _sync()
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
        return sorted(samples)[len(samples) // 2]

    out = {"draft_call": median(lambda: proposer.propose([ProposeItem("s", context, [7], K)])),
           "decode": median(lambda: verifier.verify([VerifyItem("s", context, [7])])),
           "verify": median(lambda: verifier.verify([VerifyItem("s", context, [7], drafts, *q)]))}
    del proposer, verifier
    _empty_cache()
    return out


def hf_compiled_generate(hf_target, max_tokens: int) -> float:
    """transformers' fastest single-stream path: `generate` with a static KV cache, which transformers compiles
    itself on a GPU (torch.compile of the decoding forward, mode reduce-overhead: CUDA graphs), greedy, batch 1.
    Tokens per second after two warm-up calls."""
    ids = torch.tensor(prompts(1), device=DEVICE)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        for _ in range(2):  # compiles, then captures
            hf_target.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
        _sync()
        t0 = time.perf_counter()
        result = hf_target.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
        _sync()
    return (result.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def expected_tokens(alpha: float, k: int) -> float:
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def _per_token_alpha(accepted_per_drafted: float, k: int) -> float:
    """Invert accepted/drafted = (a + a^2 + ... + a^k) / k for the per-proposal rate a (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(1, k + 1)) / k < accepted_per_drafted else (lo, mid)
    return lo


def hf_generate(hf_target, hf_draft, max_tokens: int, assisted: bool = True) -> dict:
    ids = torch.tensor(prompts(1), device=DEVICE)
    out = {}
    runs = [("transformers_generate", {})] + ([("transformers_assisted", {"assistant_model": hf_draft})] if assisted else [])
    for name, extra in runs:
        kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
        with torch.no_grad():
            hf_target.generate(ids, max_new_tokens=8, min_new_tokens=8, **kwargs)  # warm-up
            _sync()
            t0 = time.perf_counter()
            result = hf_target.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
            _sync()
        elapsed = time.perf_counter() - t0
        new = result.shape[1] - ids.shape[1]
        out[name] = new / elapsed
    return out


def correctness_check() -> dict:
    """Greedy fp32 on the GPU (Triton path) equals the CPU torch path, on a tiny model pair, before timing."""
    from tiny_models import build_model, perturbed_copy, save_model

    root = Path(tempfile.mkdtemp())
    target = build_model("qwen2", seed=0)
    target_dir = save_model(target, root / "t")
    draft_dir = save_model(perturbed_copy(target, 0.01), root / "d")
    outs = {}
    for device in ("cpu", DEVICE):
        engine = LocalEngine(str(target_dir), str(draft_dir), num_speculative_tokens=4, device=device,
                             prefix_caching=False)
        outs[device] = {k: [r["ids"] for r in _tiny_run(engine, k)] for k in (0, 4)}
    same = outs["cpu"] == outs[DEVICE] and outs["cpu"][0] == outs["cpu"][4]
    bf16 = LocalEngine(str(target_dir), str(draft_dir), num_speculative_tokens=4, device=DEVICE, dtype="bfloat16",
                       prefix_caching=False)
    bf16_out = [r["ids"] for r in _tiny_run(bf16, 4)]
    ref = outs["cpu"][0]
    agree = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(bf16_out, ref))
    return {"fp32_gpu_equals_cpu": same, "bf16_greedy_match_rate": agree / sum(len(r) for r in ref)}


def _tiny_run(engine, k):
    params = SamplingParams(max_tokens=24, ignore_eos=True, num_speculative_tokens=k)

    async def main():
        res = await asyncio.gather(*(engine.generate([i + 1, 7, 9, 11], params) for i in range(4)))
        await engine.coordinator.wait_idle()
        return res

    return [{"ids": r.token_ids} for r in asyncio.run(main())]


def split_runs(target_dir, draft_dir, alpha, batches, max_tokens, device_target, device_draft, size) -> list[dict]:
    from specsplit.client import Client
    from specsplit.services.service_commands import spawn_service, stop_processes

    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--dtype", "bfloat16", "--no-prefix-caching"]
    procs = []
    rows = []
    try:
        t0 = time.perf_counter()
        target, t_addr = spawn_service(["target", "--model", str(target_dir), "--device", device_target, *common,
                                        "--synthetic-acceptance", str(alpha)])
        procs.append(target)
        draft, d_addr = spawn_service(["draft", "--model", str(draft_dir), "--device", device_draft, *common])
        procs.append(draft)
        coord, c_addr = spawn_service(["coordinator", "--target", t_addr, "--draft", d_addr, "-k", str(K),
                                       "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1"])
        procs.append(coord)
        log(f"split services up in {time.perf_counter() - t0:.1f}s")
        with Client(c_addr, timeout=600) as client:
            def one(p, k, n):
                return client.generate(p, max_tokens=n, ignore_eos=True, num_speculative_tokens=k, temperature=0.0)

            one(prompts(1)[0], K, 16)  # warm-up
            one(prompts(1)[0], 0, 16)
            for batch in batches:
                for k in (0, K):
                    median, _ = client_batch_runs(lambda p: one(p, k, max_tokens), batch, REPEATS)
                    row = {"target": size, "mode": "split" if k else "split_target_only", "batch": batch, "k": k,
                           "alpha": alpha if k else None, "acceptance": "synthetic" if k else None,
                           "devices": f"target {device_target}, draft {device_draft}", **median}
                    rows.append(row)
                    log(row)
    finally:
        stop_processes(procs)
    return rows


def client_batch_runs(generate_one, batch: int, repeats: int) -> tuple[dict, list]:
    """`repeats` timed runs of `batch` concurrent requests through a client (generate_one(prompt) each): the median
    run's summary with every run's tokens/s, and the last run's results."""
    runs = []
    for _ in range(repeats):
        with ThreadPoolExecutor(batch) as pool:
            start = time.perf_counter()
            results = list(pool.map(generate_one, prompts(batch)))
            runs.append(summarize(results, time.perf_counter() - start, batch))
    runs.sort(key=lambda r: r["tokens_per_s_total"])
    return {**runs[len(runs) // 2], "repeats_tokens_per_s_total": [r["tokens_per_s_total"] for r in runs]}, results


def split_only(args, size, hf_target, hf_draft, target, draft) -> None:
    """In-process on the target's device, then the three services (target and draft on --split-devices)."""
    batches = [int(b) for b in args.split_batches.split(",")]
    root = Path(tempfile.mkdtemp())
    hf_target.save_pretrained(root / "target")
    hf_draft.save_pretrained(root / "draft")
    engine = LocalEngine(target, draft, num_speculative_tokens=K, coordinator_config=CoordinatorConfig(max_num_seqs=256),
                         synthetic_acceptance=args.split_alpha, prefix_caching=False)
    run_local(engine, 2, K, 16)
    run_local(engine, 2, 0, 16)
    in_process = {}
    for batch in batches:
        for k in (0, K):
            row = {"target": size, "mode": "speculative_in_process" if k else "target_only", "batch": batch, "k": k,
                   "alpha": args.split_alpha if k else None, "acceptance": "synthetic" if k else None,
                   **run_local(engine, batch, k, args.max_tokens)}
            in_process[(batch, k)] = row
            RESULTS["rows"].append(row)
            log(row)
    del engine
    gc.collect()
    devices = args.split_devices.split(",")
    for row in split_runs(root / "target", root / "draft", args.split_alpha, batches, args.max_tokens, devices[0],
                          devices[1], size):
        ref = in_process[(row["batch"], row["k"])]
        row["split_cost_vs_in_process"] = 1 - row["tokens_per_s_total"] / ref["tokens_per_s_total"]
        RESULTS["rows"].append(row)
    save(args.name)


def save(extra_name: str):
    write_results(f"gpu_e2e{extra_name}", RESULTS["rows"], {k: v for k, v in RESULTS.items() if k != "rows"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", default="7b,1.5b")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--alphas", default="0.5,0.7,0.9")
    parser.add_argument("--split-batches", default="1,8", help="'' = no split runs")
    parser.add_argument("--split-alpha", type=float, default=0.7)
    parser.add_argument("--split-devices", default="cuda:0,cuda:0", help="target device, draft device")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--name", default="", help="suffix of the results file")
    parser.add_argument("--draft-size", default="0.5b")
    parser.add_argument("--split-only", action="store_true",
                        help="only in-process vs split at --split-alpha and --split-batches (e.g. on two GPUs)")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median is reported")
    parser.add_argument("--no-assisted", action="store_true", help="skip transformers assisted generation")
    parser.add_argument("--compiled-baseline", action="store_true",
                        help="also time transformers generate with a static cache under torch.compile (slow to compile)")
    args = parser.parse_args()
    global REPEATS
    REPEATS = args.repeats
    batches = [int(b) for b in args.batches.split(",") if b]
    alphas = [float(a) for a in args.alphas.split(",") if a]
    RESULTS.update({"k": K, "max_tokens": args.max_tokens, "prompt_len": PROMPT_LEN, "vocab": VOCAB,
                    "dtype": "bfloat16", "models": "random-weight Qwen2.5 shapes (0.5B draft; 1.5B/7B targets)",
                    "acceptance_note": "rows with acceptance=synthetic use the NOT-LOSSLESS synthetic acceptance mode"})
    if not args.skip_check:
        RESULTS["correctness"] = correctness_check()
        log("correctness:", RESULTS["correctness"])
        save(args.name)

    hf_draft = hf_random_model(args.draft_size, seed=1)
    draft = loaded_from_hf(hf_draft, "random-qwen2.5-0.5b")
    for size in args.targets.split(","):
        t_build = time.perf_counter()
        hf_target = hf_random_model(size, seed=2)
        target = loaded_from_hf(hf_target, f"random-qwen2.5-{size}")
        log(f"built {size} in {time.perf_counter() - t_build:.1f}s")
        times = step_times(draft, target)
        c = times["draft_call"] / K / times["decode"]
        RESULTS.setdefault("step_ms", {})[size] = {**{name: 1e3 * t for name, t in times.items()},
                                                   "draft_per_step": 1e3 * times["draft_call"] / K, "c": c}
        log(f"{size}: draft call {1e3 * times['draft_call']:.2f} ms ({1e3 * times['draft_call'] / K:.2f} per step), "
            f"decode {1e3 * times['decode']:.2f} ms, verify k={K} {1e3 * times['verify']:.2f} ms, c = {c:.3f}")

        if args.split_only:
            split_only(args, size, hf_target, hf_draft, target, draft)
            continue
        split_dirs = None
        if args.split_batches:
            root = Path(tempfile.mkdtemp(dir=os.environ.get("SPECSPLIT_BENCH_TMP")))
            t_save = time.perf_counter()
            hf_target.save_pretrained(root / "target")
            hf_draft.save_pretrained(root / "draft")
            split_dirs = (root / "target", root / "draft")
            log(f"saved models in {time.perf_counter() - t_save:.1f}s")

        # Fixed k = 4 with synthetic acceptance (labelled), and target-only, in one engine.
        config = CoordinatorConfig(max_num_seqs=256, speculation="fixed")
        engine = LocalEngine(target, draft, num_speculative_tokens=K, coordinator_config=config, prefix_caching=False)
        run_local(engine, 2, K, 16)  # warm-up (compiles kernels)
        run_local(engine, 2, 0, 16)
        baseline = {}
        for batch in batches:
            run_local(engine, batch, 0, args.max_tokens)  # the same run once untimed: nothing left to capture
            row = {"target": size, "mode": "target_only", "batch": batch, "k": 0, **run_local(engine, batch, 0, args.max_tokens)}
            baseline[batch] = row["tokens_per_s_total"]
            RESULTS["rows"].append(row)
            log(row)
            for alpha in alphas:
                engine.verifier.synthetic_acceptance = alpha  # benchmark-only switch, labelled below
                run_local(engine, batch, K, args.max_tokens)
                row = {"target": size, "mode": "speculative_in_process", "batch": batch, "k": K, "alpha": alpha,
                       "acceptance": "synthetic", **run_local(engine, batch, K, args.max_tokens)}
                engine.verifier.synthetic_acceptance = None
                row["speedup"] = row["tokens_per_s_total"] / baseline[batch]
                row["bound"] = expected_tokens(alpha, K) / (1 + K * c)
                row["share_of_bound"] = row["speedup"] / row["bound"]
                row["c"] = c
                RESULTS["rows"].append(row)
                log(row)
            save(args.name)
        del engine
        gc.collect()

        # Adaptive speculation with the random draft for real (real rejection sampler; acceptance ~ 0): the policy
        # must find that speculating cannot pay and stay at least as fast as target-only.
        adaptive = LocalEngine(target, draft, num_speculative_tokens=K, prefix_caching=False,
                               coordinator_config=CoordinatorConfig(max_num_seqs=256, speculation="adaptive"))
        for batch in batches:
            # Target-only in this engine too: the adaptive rows' other baseline, free of any engine-to-engine
            # difference (graphs captured in another order, memory laid out differently).
            run_local(adaptive, batch, 0, args.max_tokens)
            same = {"target": size, "mode": "target_only_adaptive_engine", "batch": batch, "k": 0,
                    **run_local(adaptive, batch, 0, args.max_tokens)}
            RESULTS["rows"].append(same)
            log(same)
            run_local(adaptive, batch, None, args.max_tokens)  # the policy measures this batch size's costs
            row = {"target": size, "mode": "adaptive_unrelated_draft", "batch": batch, "k": f"<={K}",
                   "acceptance": "real (unrelated draft)", **run_local(adaptive, batch, None, args.max_tokens)}
            row["speedup"] = row["tokens_per_s_total"] / baseline[batch]
            row["speedup_vs_same_engine"] = row["tokens_per_s_total"] / same["tokens_per_s_total"]
            RESULTS["rows"].append(row)
            log(row)
            save(args.name)
        del adaptive
        gc.collect()
        _empty_cache()

        # transformers on the same weights, last (its compilation is slow, and a failure must not cost the rows above).
        hf = hf_generate(hf_target, hf_draft, args.max_tokens, assisted=not args.no_assisted)
        if args.compiled_baseline:
            try:
                hf["transformers_static_compiled"] = hf_compiled_generate(hf_target, args.max_tokens)
            except Exception as error:  # recorded, not fatal
                RESULTS["notes"].append(f"transformers static-cache compiled generate failed: {error!r}"[:500])
        for name, tps in hf.items():
            RESULTS["rows"].append({"target": size, "mode": name, "batch": 1, "tokens_per_s_total": tps,
                                    "tokens_per_s_per_request": tps, "vs_target_only": baseline.get(1, 0) / tps,
                                    "acceptance": "real (random weights)" if "assisted" in name else None})
        log(size, hf)
        del hf_target
        gc.collect()
        _empty_cache()
        save(args.name)

        if split_dirs:
            devices = args.split_devices.split(",")
            in_process = {r["batch"]: r for r in RESULTS["rows"] if r["target"] == size
                          and r["mode"] == "speculative_in_process" and r.get("alpha") == args.split_alpha}
            rows = split_runs(*split_dirs, args.split_alpha, [int(b) for b in args.split_batches.split(",")],
                              args.max_tokens, devices[0], devices[1], size)
            for row in rows:
                ref = in_process.get(row["batch"]) if row["k"] else None
                if ref:
                    row["split_cost_vs_in_process"] = 1 - row["tokens_per_s_total"] / ref["tokens_per_s_total"]
                RESULTS["rows"].append(row)
            save(args.name)
        del target
        gc.collect()
        _empty_cache()

    print_table(RESULTS["rows"], ["target", "mode", "batch", "alpha", "tokens_per_s_total", "tokens_per_s_per_request",
                                  "tokens_per_round", "accepted_per_drafted", "speedup", "bound", "share_of_bound",
                                  "split_cost_vs_in_process"])
    print("step_ms:", RESULTS.get("step_ms"))
    print("correctness:", RESULTS.get("correctness"))


if __name__ == "__main__":
    main()
