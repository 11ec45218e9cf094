"""Overlapped rounds across the split on two GPUs (target on GPU 0, draft on GPU 1): pipelined vs non-pipelined
split, target-only split vs in-process, at synthetic acceptance 0.5 / 0.7 / 0.9, k = 4, batch 1 / 8 / 32, with the
stated bound of the pipelined scheme next to each row (services/coordinator/overlap_policy.py).

SYNTHETIC ACCEPTANCE (NOT LOSSLESS, services/target/synthetic_acceptance.py): random-weight models never agree, so
each proposal is accepted by a coin of bias alpha, AND the bonus guess of an overlapped round is confirmed by a coin
of the same bias (a random draft never guesses a real bonus token). A pre-proposal is thus used with probability
alpha^(k+1) per sequence, as for a trained pair of acceptance alpha. Every speculative row says `acceptance:
synthetic`. Emitted tokens are still real samples of the target (greedy here).

Rows (per alpha and batch; tokens/s over all requests, median of --repeats runs):
  target_only_in_process / target_only_split       k = 0, the split's cost without speculation
  in_process                                       both models on GPU 0, one process, serial rounds
  split_serial / split_pipelined / split_auto      three coordinators (--overlap off / on / auto) over the same
                                                   target (GPU 0, synthetic alpha) and draft (GPU 1)
The bound per row: T_off / T_on with T_off = t_p + t_v + 2h and T_on = (1 - H)(t_a + h) + max(t_v + h, t_a + h),
where t_p, t_a, t_v are the draft call (k, k+1 proposals) and the verification (k) measured here at that batch on
the GPUs the workers use, h = the per-call hop measured as half of what a serial split round costs beyond t_p + t_v,
and H = (alpha^(k+1))^batch. `of_bound` = (pipelined / serial) / bound.

    python3 bench/bench_gpu_overlap.py [--target 1.5b --draft 0.5b] [--alphas 0.5,0.7,0.9] [--batches 1,8,32]
    python3 bench/bench_gpu_overlap.py --dry-run    # CPU, tiny models, a smoke run of this script (no timings)
"""

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if "--dry-run" in sys.argv:  # before bench_gpu_e2e reads it
    os.environ["SPECSPLIT_BENCH_DEVICE"] = "cpu"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import bench_gpu_e2e as e2e  # noqa: E402
from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.coordinator.coordinator import CoordinatorConfig  # noqa: E402
from specsplit.services.coordinator.overlap_policy import overlapped_round_time, serial_round_time  # noqa: E402
from specsplit.services.draft.proposer import DraftPrefill, DraftProposer, ProposeItem  # noqa: E402
from specsplit.services.local_engine import LocalEngine  # noqa: E402
from specsplit.services.runtime.model_runner import ModelRunner  # noqa: E402
from specsplit.services.runtime.worker_sequences import WorkerSampling  # noqa: E402
from specsplit.services.service_commands import spawn_service, stop_processes  # noqa: E402
from specsplit.services.target.verifier import TargetPrefill, TargetVerifier, VerifyItem  # noqa: E402

K = 4
GREEDY = WorkerSampling(0.0, 0, 1.0, 1)


def call_costs(draft, target, draft_device: str, target_device: str, batch: int, context: int = 64,
               repeats: int = 20) -> dict:
    """Seconds of the worker calls at `batch` as the workers run them: draft k and k+1 proposals, verify k."""
    ids = e2e.prompts(1)[0] * (context // e2e.PROMPT_LEN + 1)
    blocks = batch * (context // 16 + 4) + 16
    proposer = DraftProposer(ModelRunner(draft, num_blocks=blocks, prefix_caching=False))
    verifier = TargetVerifier(ModelRunner(target, num_blocks=blocks, prefix_caching=False))
    handles = [f"s{i}" for i in range(batch)]
    proposer.prefill([DraftPrefill(h, ids[:context], GREEDY) for h in handles])
    verifier.prefill([TargetPrefill(h, ids[:context], GREEDY) for h in handles])
    q = (torch.tensor(ids[:K])[:, None], torch.ones(K, 1))

    def timed(device, call):
        call()
        samples = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        return sorted(samples)[len(samples) // 2]

    out = {
        "t_p": timed(draft_device, lambda: proposer.propose([ProposeItem(h, context, [7], K) for h in handles])),
        "t_a": timed(draft_device, lambda: proposer.propose([ProposeItem(h, context, [7], K + 1) for h in handles])),
        "t_v": timed(target_device, lambda: verifier.verify([VerifyItem(h, context, [7], ids[:K], *q) for h in handles])),
    }
    proposer.release(handles)
    verifier.release(handles)
    return out


def bound(costs: dict, hop: float, alpha: float, batch: int) -> float:
    all_hit = (alpha ** (K + 1)) ** batch
    serial = serial_round_time(costs["t_p"] + hop, costs["t_v"] + hop)
    return serial / overlapped_round_time(costs["t_a"] + hop, costs["t_v"] + hop, all_hit)


def split_rows(args, target_dir, draft_dir, alpha, batches, devices) -> list[dict]:
    from specsplit.client import Client

    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--dtype", args.dtype, "--no-prefix-caching"]
    procs, rows = [], []
    try:
        target, t_addr = spawn_service(["target", "--model", str(target_dir), "--device", devices[0], *common,
                                        "--synthetic-acceptance", str(alpha)])
        procs.append(target)
        draft, d_addr = spawn_service(["draft", "--model", str(draft_dir), "--device", devices[1], *common,
                                       "--warm-up-k", str(K + 1)])  # overlapped rounds propose k + 1
        procs.append(draft)
        coordinators = {}
        for mode, overlap in (("split_serial", "off"), ("split_pipelined", "on"), ("split_auto", "auto")):
            process, address = spawn_service(["coordinator", "--target", t_addr, "--draft", d_addr, "-k", str(K),
                                              "--speculation", "fixed", "--overlap", overlap, "--host", "127.0.0.1",
                                              "--port", "0", "--metrics-port", "-1"])
            procs.append(process)
            coordinators[mode] = address
        for batch in batches:
            for mode, address in [("target_only_split", coordinators["split_serial"]), *coordinators.items()]:
                k = 0 if mode == "target_only_split" else K
                with Client(address, timeout=1200) as client:
                    def one(p, n=args.max_tokens):
                        return client.generate(p, max_tokens=n, ignore_eos=True, num_speculative_tokens=k,
                                               temperature=0.0)

                    with ThreadPoolExecutor(batch) as pool:  # warm-up: every shape, and auto's measurements
                        list(pool.map(lambda p: one(p, 2 * args.max_tokens), e2e.prompts(batch)))
                    median, results = e2e.client_batch_runs(one, batch, args.repeats)
                row = {"mode": mode, "batch": batch, "k": k, "alpha": alpha if k else None,
                       "acceptance": "synthetic" if k else None, "devices": f"target {devices[0]}, draft {devices[1]}",
                       **median,
                       "pre_proposed_rounds": sum(r.stats.pre_proposed_rounds for r in results),
                       "rounds": sum(r.stats.rounds for r in results)}
                rows.append(row)
                e2e.log(row)
    finally:
        stop_processes(procs)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="1.5b", choices=sorted(e2e.QWEN25))
    parser.add_argument("--draft", default="0.5b", choices=sorted(e2e.QWEN25))
    parser.add_argument("--alphas", default="0.5,0.7,0.9")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", default="cuda:0,cuda:1", help="target's device, draft's device")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--name", default="gpu_overlap")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny models, few tokens: checks that the script runs (its timings mean nothing)")
    args = parser.parse_args()
    if args.dry_run:
        args.target = args.draft = "tiny"
        args.devices, args.dtype, args.max_tokens, args.repeats = "cpu,cpu", "bfloat16", 12, 1
        args.batches, args.name = "1,2", args.name + "_dry_run"
    elif torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs (target on GPU 0, draft on GPU 1); --dry-run checks the script on the CPU")
    devices = args.devices.split(",")
    alphas = [float(a) for a in args.alphas.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    hf_target, hf_draft = e2e.hf_random_model(args.target, 0), e2e.hf_random_model(args.draft, 1)
    root = Path(tempfile.mkdtemp())
    hf_target.save_pretrained(root / "target")
    hf_draft.save_pretrained(root / "draft")
    target = e2e.loaded_from_hf(hf_target, args.target)
    draft = e2e.loaded_from_hf(hf_draft, args.draft)
    del hf_target, hf_draft
    rows = []
    # In-process (both models on the target's GPU): target-only and serial speculative rounds.
    engine = LocalEngine(target, draft, num_speculative_tokens=K, coordinator_config=CoordinatorConfig(
        max_num_seqs=256, speculation="fixed", overlap="off"), prefix_caching=False)
    e2e.REPEATS = args.repeats
    for batch in batches:  # warm-up: every batch's graphs are captured before any timed run
        e2e.run_local(engine, batch, K, 16)
        e2e.run_local(engine, batch, 0, 16)
    in_process = {}
    for batch in batches:
        row = {"mode": "target_only_in_process", "batch": batch, "k": 0, **e2e.run_local(engine, batch, 0, args.max_tokens)}
        rows.append(row)
        in_process[(batch, None)] = row
        for alpha in alphas:
            engine.verifier.synthetic_acceptance = alpha  # benchmark-only switch, labelled below
            row = {"mode": "in_process", "batch": batch, "k": K, "alpha": alpha, "acceptance": "synthetic",
                   **e2e.run_local(engine, batch, K, args.max_tokens)}
            engine.verifier.synthetic_acceptance = None
            rows.append(row)
            in_process[(batch, alpha)] = row
    del engine
    # Call costs for the bound, one call at a time on GPU 0 (GPU 1 is the same kind of card).
    costs = {batch: call_costs(draft, target, devices[0], devices[0], batch) for batch in batches}
    for alpha in alphas:
        split = split_rows(args, root / "target", root / "draft", alpha, batches, devices)
        for row in split:
            batch = row["batch"]
            reference = in_process[(batch, row["alpha"])]
            row["vs_in_process"] = row["tokens_per_s_total"] / reference["tokens_per_s_total"]
            if row["mode"] == "target_only_split" and alpha != alphas[0]:
                continue  # one target-only split row per batch is enough
            rows.append(row)
        serial = {r["batch"]: r for r in split if r["mode"] == "split_serial"}
        for row in split:
            if row["mode"] not in ("split_pipelined", "split_auto"):
                continue
            batch, c = row["batch"], costs[row["batch"]]
            rounds_s = serial[batch]["seconds"] / max(serial[batch]["rounds"] / batch, 1)
            hop = max(0.0, (rounds_s - c["t_p"] - c["t_v"]) / 2)
            row["bound"] = bound(c, hop, alpha, batch)
            row["vs_serial"] = row["tokens_per_s_total"] / serial[batch]["tokens_per_s_total"]
            row["of_bound"] = row["vs_serial"] / row["bound"]
            row.update({f"{name}_ms": 1e3 * value for name, value in c.items()}, hop_ms=1e3 * hop)
    print_table(rows, ["mode", "batch", "alpha", "tokens_per_s_total", "vs_in_process", "vs_serial", "bound",
                       "of_bound", "pre_proposed_rounds"])
    path = write_results(args.name, rows, {
        "acceptance_note": "speculative rows use the NOT-LOSSLESS synthetic acceptance mode: a coin of bias alpha per "
                           "proposal AND for the bonus guess of overlapped rounds (pre-proposal used w.p. alpha^(k+1))",
        "models": f"random-weight Qwen2.5 {args.target} target, {args.draft} draft, {args.dtype}",
        "bound": "T_off/T_on, T_off = t_p + t_v + 2h, T_on = (1-H)(t_a+h) + max(t_v+h, t_a+h), H = alpha^((k+1)B)",
        "dry_run": args.dry_run,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
