"""What the split costs per round, and where it goes: the same requests in one process (LocalEngine) and through the
services (`split`: target, draft and coordinator processes over loopback gRPC; `colocated`: the coordinator in the
target's process, the draft its own), at each batch size and k, with per-stage timestamps of the round's path
through the processes.

Rows (per mode, batch, k): tokens/s over the batch, rounds (the batch loop's), seconds per round, TTFT and TPOT at
the client (in one process: at the engine's stream), and for the services modes `extra_ms_per_round` = (their seconds
per round - one process's) * 1000, the goal's measure. The services run with SPECSPLIT_ROUND_TIMELINE set
(services/telemetry/round_timeline.py), and a breakdown row per (mode, batch, k) gives the median of each stage
across the rounds: coordinator build, send, worker receive and unpack, hand-off to the compute step, model, hand
back, answer, coordinator receive and unpack, commit, and the time between rounds.

CPU: tiny random-weight models (tests/tiny_models.py) with a close draft (real acceptance, greedy), every process on
one torch thread. GPU: random-weight Qwen2.5 shapes (bf16), target on --devices[0], draft on --devices[1]; k > 0 rows
there use the SYNTHETIC ACCEPTANCE benchmark mode (--alphas, NOT lossless: a coin of bias alpha per proposal; emitted
tokens are real target samples).

    python bench/bench_split_breakdown.py                          # CPU, tiny models
    python3 bench/bench_split_breakdown.py --device cuda --target 7b --draft 0.5b --alphas 0.7,0.9 \
        --modes in_process,colocated,split,split_stream,split_pipelined,split_auto
"""

import argparse
import asyncio
import contextlib
import gc
import gzip
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import torch  # noqa: E402

from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.rpc.step_batcher import LONE_CALLER_SECONDS  # noqa: E402
from specsplit.services.target.decode_ahead import DECODE_AHEAD_MODES  # noqa: E402

STAGES = [  # (name, from mark, to mark): consecutive marks of one round; a worker's marks lie inside its call
    ("coordinator_build_propose", "round.start", "propose.built"),
    ("propose_send", "propose.built", "draft.received"),
    ("draft_unpack", "draft.received", "draft.unpacked"),
    ("draft_hand_off", "draft.unpacked", "draft.step_start"),
    ("draft_model", "draft.step_start", "draft.step_end"),
    ("draft_hand_back", "draft.step_end", "draft.resumed"),
    ("draft_answer", "draft.resumed", "draft.answered"),
    ("propose_return", "draft.answered", "propose.answered"),
    ("coordinator_unpack_propose", "propose.answered", "propose.unpacked"),
    ("coordinator_build_verify", "propose.unpacked", "verify.built"),
    ("verify_send", "verify.built", "target.received"),
    ("target_unpack", "target.received", "target.unpacked"),
    ("target_hand_off", "target.unpacked", "target.step_start"),
    ("target_model", "target.step_start", "target.step_end"),
    ("target_hand_back", "target.step_end", "target.resumed"),
    ("target_answer", "target.resumed", "target.answered"),
    ("verify_return", "target.answered", "verify.answered"),
    ("coordinator_unpack_verify", "verify.answered", "verify.unpacked"),
    ("colocated_verify_call", "verify.built", "verify.unpacked"),  # the co-located mode's in-process verification
    ("coordinator_commit", "verify.unpacked", "round.committed"),
    ("between_rounds", "round.committed", "next.round.start"),
]
# A request's first token through the split (consecutive marks after the coordinator receives it; a lone request's
# are unambiguous, so batch 1 rows only): the prefill's hop, the target's hand-off, its step and the way back.
FIRST_TOKEN_STAGES = [
    ("request_to_prefill", "request.received", "prefill.start"),
    ("prefill_send", "prefill.start", "target.prefill.received"),
    ("target_prefill_unpack", "target.prefill.received", "target.prefill.unpacked"),
    ("target_prefill_hand_off", "target.prefill.unpacked", "target.step_start"),
    ("target_prefill_model", "target.step_start", "target.step_end"),
    ("target_prefill_hand_back", "target.step_end", "target.prefill.resumed"),
    ("target_prefill_answer", "target.prefill.resumed", "target.prefill.answered"),
    ("prefill_return", "target.prefill.answered", "prefill.answered"),
    ("commit_and_stream", "prefill.answered", "client.streamed"),
]
PROMPT_WORDS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:", "The answer is", "for i in range(",
                "SELECT * FROM", "#include <stdio.h>", "Once upon a time"]


# ---- models ---------------------------------------------------------------------------------------------------

def build_models(args, root: Path):
    """-> (target folder, draft folder, in-process target, in-process draft): the services load the folders, the
    one-process engine gets the same weights."""
    if args.device == "cpu":
        from tiny_models import build_model, perturbed_copy, save_model

        target = build_model("qwen2", seed=0)
        target_dir = save_model(target, root / "target")
        draft_dir = save_model(perturbed_copy(target, noise=0.01), root / "draft")
        return target_dir, draft_dir, str(target_dir), str(draft_dir)
    import bench_gpu_e2e as e2e

    hf_target, hf_draft = e2e.hf_random_model(args.target, 0), e2e.hf_random_model(args.draft, 1)
    hf_target.save_pretrained(root / "target")
    hf_draft.save_pretrained(root / "draft")
    target, draft = e2e.loaded_from_hf(hf_target, args.target), e2e.loaded_from_hf(hf_draft, args.draft)
    del hf_target, hf_draft
    torch.cuda.empty_cache()  # the services' processes need the memory the transformers copies held
    return root / "target", root / "draft", target, draft


def prompts(batch: int, device: str) -> list:
    if device == "cpu":
        return [PROMPT_WORDS[i % len(PROMPT_WORDS)] + " " * (i // len(PROMPT_WORDS)) for i in range(batch)]
    import bench_gpu_e2e as e2e

    return e2e.prompts(batch)


# ---- one process ----------------------------------------------------------------------------------------------

def in_process_rows(args, target, draft, batches, ks, alphas) -> dict:
    """(alpha, batch, k) -> the median run in one process (k = 0 rows once, under the first alpha)."""
    from specsplit.services.coordinator.coordinator import CoordinatorConfig
    from specsplit.services.local_engine import LocalEngine

    engine = LocalEngine(target, draft, num_speculative_tokens=max(ks), dtype=args.dtype, device=args.devices[0],
                         num_kv_blocks=args.kv_blocks, prefix_caching=False, synthetic_acceptance=alphas[0],
                         coordinator_config=CoordinatorConfig(max_num_seqs=256, speculation="fixed", overlap="off"),
                         decode_ahead=args.decode_ahead)
    out = {}
    for batch in batches:
        for k in ks:
            _run_local(engine, args, batch, k, warm_up=True)
    for alpha in alphas:
        engine.verifier.synthetic_acceptance = alpha  # the benchmark-only switch (labelled in the results)
        for batch in batches:
            for k in ks:
                if k == 0 and alpha != alphas[0]:
                    continue
                out[(alpha, batch, k)] = _median_run([_run_local(engine, args, batch, k) for _ in range(args.repeats)])
    return out


def _run_local(engine, args, batch: int, k: int, warm_up: bool = False) -> dict:
    from specsplit.services.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=args.max_tokens if not warm_up else 8, ignore_eos=True,
                             num_speculative_tokens=k, temperature=0.0, seed=i) for i in range(batch)]

    async def main():
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts(batch, args.device), params)))
        elapsed = time.perf_counter() - start
        await engine.coordinator.wait_idle()
        return results, elapsed

    results, elapsed = asyncio.run(main())
    return _summary(elapsed, [(len(r.token_ids), r.stats.rounds, r.time_to_first_token, r.total_time,
                               r.time_to_first_token) for r in results],
                    [r.stats.pre_proposed_rounds for r in results])


# ---- services -------------------------------------------------------------------------------------------------

# How each services mode's coordinator runs: in the target's process ("colocated*": one hop per round) or as its own
# process over the same target and draft ("split*"), with its overlap setting and worker transport.
SERVICE_MODES = {
    "colocated": ("colocated", ["--overlap", "off"]),
    "colocated_pipelined": ("colocated", ["--overlap", "on"]),
    "colocated_auto": ("colocated", ["--overlap", "auto"]),
    "split": ("split", ["--overlap", "off"]),
    "split_stream": ("split", ["--overlap", "off", "--worker-transport", "stream"]),
    "split_pipelined": ("split", ["--overlap", "on"]),
    "split_auto": ("split", ["--overlap", "auto"]),
}


def services_rows(args, modes: list[str], target_dir, draft_dir, batches, ks, alphas, timeline_prefix: str):
    """One draft for the whole run; per alpha one target (its synthetic acceptance is a process setting), serving
    the co-located mode's coordinator (at most one per run) and the split modes' coordinator processes.
    -> ({(mode, alpha, batch, k): median run}, {same key: (start ns, end ns) of that run})."""
    from specsplit.client import Client
    from specsplit.services.service_commands import address_after, spawn_service, stop_processes

    env = {**os.environ, "SPECSPLIT_ROUND_TIMELINE": timeline_prefix}
    threads = []
    if args.device == "cpu":  # like the one process: one torch thread each
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        threads = ["--threads", "1"]
    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--dtype", args.dtype,
              "--no-prefix-caching"]
    kv = ["--num-kv-blocks", str(args.kv_blocks)] if args.kv_blocks else []
    coordinating = ["-k", str(max(ks)), "--speculation", "fixed", "--http-port", "-1",
                    *(["--arrival-window-ms", str(args.arrival_window_ms)] if args.arrival_window_ms is not None else [])]
    colocated = [m for m in modes if SERVICE_MODES[m][0] == "colocated"]
    if len(colocated) > 1:
        raise SystemExit(f"one co-located mode per run (its coordinator lives in the target): {colocated}")
    out, windows, spans, procs = {}, {}, {}, []
    draft_cores, target_cores = _worker_cores(args.pin_workers)
    try:
        with _started_on(draft_cores):
            draft, d_addr = spawn_service(["draft", "--model", str(draft_dir), "--device", args.devices[1], *common,
                                           *kv, *threads, "--warm-up-k", str(max(ks) + 1)], env=env)
        procs.append(draft)
        for alpha in alphas:
            synthetic = ["--synthetic-acceptance", str(alpha)] if alpha is not None else []
            target_argv = ["target", "--model", str(target_dir), "--device", args.devices[0], *common, *kv,
                           *synthetic, *threads, "--warm-up-k", str(max(ks)), "--decode-ahead", args.decode_ahead]
            addresses, started = {}, []
            if colocated:
                target_argv += ["--coordinate", "--draft", d_addr, "--coordinator-port", "0",
                                "--coordinator-metrics-port", "-1", *coordinating, *SERVICE_MODES[colocated[0]][1]]
            with _started_on(target_cores):
                target, t_addr = spawn_service(target_argv, env=env)
            started.append(target)
            if colocated:
                addresses[colocated[0]] = address_after(target, "coordinator")
            for mode in modes:
                if SERVICE_MODES[mode][0] == "split":
                    coordinator, addresses[mode] = spawn_service(
                        ["coordinator", "--target", t_addr, "--draft", d_addr, "--host", "127.0.0.1", "--port", "0",
                         "--metrics-port", "-1", *coordinating, *SERVICE_MODES[mode][1]], env=env)
                    started.append(coordinator)
            try:
                for mode in modes:
                    # The workers serve every mode's coordinator: let the last one's calls age out, so this one is
                    # its workers' lone caller (rpc/step_batcher.py), as a one-coordinator deployment is.
                    time.sleep(LONE_CALLER_SECONDS + 0.2)
                    with Client(addresses[mode], timeout=1200) as client:
                        for batch in batches:  # warm-up: graphs of every shape, the auto policy's measurements
                            for k in ks:
                                _run_client(client, args, batch, k, warm_up=True)
                        for batch in batches:
                            for k in ks:
                                if k == 0 and alpha != alphas[0]:
                                    continue
                                runs = [_run_client(client, args, batch, k) for _ in range(args.repeats)]
                                median = _median_run(runs)
                                windows[(mode, alpha, batch, k)] = median.pop("window")
                                for run in runs:
                                    run.pop("window", None)
                                spans[(mode, alpha, batch, k)] = (runs[0]["started_ns"], runs[-1]["ended_ns"])
                                out[(mode, alpha, batch, k)] = median
            finally:
                stop_processes(started)
    finally:
        stop_processes(procs)
    return out, windows, spans


def _worker_cores(spec: str) -> tuple[set[int] | None, set[int] | None]:
    """--pin-workers "DRAFT_CORES:TARGET_CORES" (e.g. 0:1) -> the two core sets; "" -> no pinning."""
    if not spec:
        return None, None
    draft, target = spec.split(":")
    return tuple({int(c) for c in part.split(",")} for part in (draft, target))


@contextlib.contextmanager
def _started_on(cores: set[int] | None):
    """A process started inside runs on `cores` (a child inherits its parent's affinity), and so do its threads."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _run_client(client, args, batch: int, k: int, warm_up: bool = False) -> dict:
    if args.client == "async":
        return asyncio.run(_run_async_client(client, args, batch, k, warm_up))
    return _run_threaded_client(client, args, batch, k, warm_up)


async def _run_async_client(client, args, batch: int, k: int, warm_up: bool = False) -> dict:
    """The batch's streams started from one asyncio loop, as `specsplit bench`'s load generator sends them (the
    coordinator sees them arrive within a few hundred microseconds); `client`: the Client whose address is used."""
    import grpc

    from specsplit.proto.v1 import generation_pb2_grpc
    from specsplit.services.coordinator import public_messages as pm
    from specsplit.services.sampling_params import SamplingParams

    async with grpc.aio.insecure_channel(client.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await channel.channel_ready()

        async def one(i, prompt):
            params = SamplingParams(max_tokens=args.max_tokens if not warm_up else 8, ignore_eos=True,
                                    num_speculative_tokens=k, temperature=0.0, seed=i)
            tally = _StreamTally()
            async for chunk in stub.GenerateStream(pm.request_pb(prompt, params), timeout=1200):
                tally.add(chunk)
            return tally.result()

        requests = [one(i, prompt) for i, prompt in enumerate(prompts(batch, args.device))]
        started_ns = time.monotonic_ns()
        start = time.perf_counter()
        results = await asyncio.gather(*requests)
        elapsed = time.perf_counter() - start
        ended_ns = time.monotonic_ns()
    return {**_summary(elapsed, [r for r, _ in results], [p for _, p in results]), "window": (started_ns, ended_ns),
            "started_ns": started_ns, "ended_ns": ended_ns}


def _run_threaded_client(client, args, batch: int, k: int, warm_up: bool = False) -> dict:
    def one(i_prompt):
        i, prompt = i_prompt
        tally = _StreamTally()
        for chunk in client.generate_stream(prompt, max_tokens=args.max_tokens if not warm_up else 8,
                                            ignore_eos=True, num_speculative_tokens=k, temperature=0.0, seed=i):
            tally.add(chunk)
        return tally.result()

    with ThreadPoolExecutor(batch) as pool:
        started_ns = time.monotonic_ns()
        start = time.perf_counter()
        results = list(pool.map(one, enumerate(prompts(batch, args.device))))
        elapsed = time.perf_counter() - start
        ended_ns = time.monotonic_ns()
    return {**_summary(elapsed, [r for r, _ in results], [p for _, p in results]), "window": (started_ns, ended_ns),
            "started_ns": started_ns, "ended_ns": ended_ns}


class _StreamTally:
    """One request's stream as the client sees it: tokens, its first token's time, and what the last message says
    (rounds, pre-proposed rounds, the coordinator's time to first token)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first, self.tokens, self.rounds, self.pre, self.coordinator_first = None, 0, 0, 0, None

    def add(self, chunk) -> None:
        self.tokens += len(chunk.token_ids)
        if self.first is None and chunk.token_ids:
            self.first = time.perf_counter() - self.start
        if chunk.finish_reason:
            self.rounds, self.pre = chunk.speculation.rounds, chunk.speculation.pre_proposed_rounds
            self.coordinator_first = chunk.timings.time_to_first_token_s

    def result(self) -> tuple[tuple, int]:
        """((tokens, rounds, ttft s, total s, the coordinator's ttft s), pre-proposed rounds): _summary's input."""
        return (self.tokens, self.rounds, self.first, time.perf_counter() - self.start, self.coordinator_first), self.pre


def _summary(elapsed: float, results: list[tuple], pre_proposed: list[int]) -> dict:
    """results: (tokens, rounds, ttft s, total s, the coordinator's ttft s) per request. Two times to first token:
    `ttft_ms` where the caller sees it (for the services, the client: its two gRPC hops to and from the coordinator
    included, which the one process has no counterpart for) and `coordinator_ttft_ms`, from the coordinator's receipt
    of the request to the commit of its first token (the one process's own definition: the same interval)."""
    tokens = sum(r[0] for r in results)
    rounds = max(r[1] for r in results)
    tpot = [(r[3] - r[2]) / (r[0] - 1) for r in results if r[0] > 1 and r[2] is not None]
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed, "rounds": rounds,
            "ms_per_round": 1e3 * elapsed / max(rounds, 1), "tokens_per_round": tokens / max(rounds, 1) / len(results),
            "ttft_ms": 1e3 * statistics.median(r[2] for r in results if r[2] is not None),
            "coordinator_ttft_ms": 1e3 * statistics.median(r[4] for r in results if r[4] is not None),
            "tpot_ms": 1e3 * statistics.median(tpot) if tpot else None, "pre_proposed_rounds": sum(pre_proposed)}


def _median_run(runs: list[dict]) -> dict:
    runs = sorted(runs, key=lambda r: r["tokens_per_s"])
    median = dict(runs[len(runs) // 2])
    median["repeats_tokens_per_s"] = [round(r["tokens_per_s"], 2) for r in runs]
    return median


# ---- the timeline ---------------------------------------------------------------------------------------------

def read_timeline(prefix: str) -> list[tuple[str, int]]:
    """Every process's marks, merged in time order (one clock for the host)."""
    marks = []
    for path in glob.glob(prefix + ".*.json"):
        marks.extend(tuple(m) for m in json.loads(Path(path).read_text())["marks"])
    return sorted(marks, key=lambda m: m[1])


def breakdown(timeline: dict, window: tuple[int, int]) -> dict:
    """Median milliseconds of each stage over the rounds inside `window` (ns), and the rounds counted."""
    start_ns, end_ns = window
    inside = [m for m in timeline if start_ns <= m[1] <= end_ns]
    coordinator = [m for m in inside if not m[0].startswith(("draft.", "target."))]
    workers = {role: [m for m in inside if m[0].startswith(role + ".")] for role in ("draft", "target")}
    starts = [i for i, (stage, _) in enumerate(coordinator) if stage == "round.start"]
    samples: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for n, i in enumerate(starts[:-1]):
        marks = {}
        for stage, ns in coordinator[i : starts[n + 1]]:
            marks.setdefault(stage, ns)
        marks["next.round.start"] = coordinator[starts[n + 1]][1]
        for role, call in (("draft", "propose"), ("target", "verify")):
            sent, answered = marks.get(f"{call}.built"), marks.get(f"{call}.answered", marks.get(f"{call}.unpacked"))
            if sent is None or answered is None:
                continue
            for stage, ns in workers[role]:
                if sent <= ns <= answered and stage.startswith(role + "."):
                    marks.setdefault(stage, ns)
        if "propose.built" not in marks:  # a target-only round: its verify follows the round's start
            marks["propose.unpacked"] = marks["round.start"]
        for name, a, b in STAGES:
            if name == "colocated_verify_call" and "target.received" in marks:
                continue  # verified over gRPC: the detailed stages say it all
            if a in marks and b in marks and marks[b] >= marks[a]:
                samples[name].append((marks[b] - marks[a]) / 1e6)
    row = {name: round(statistics.median(v), 4) for name, v in samples.items() if v}
    row.update({f"{name}_mean": round(statistics.fmean(v), 4) for name, v in samples.items() if v})
    row["rounds_timed"] = max(0, len(starts) - 1)
    model = row.get("draft_model", 0.0) + row.get("target_model", 0.0)
    row["model_ms"] = round(model, 4)
    row["stages_sum_ms"] = round(sum(v for k, v in row.items() if k in samples), 4)
    row["stages_sum_mean_ms"] = round(sum(v for k, v in row.items() if k[:-5] in samples and k.endswith("_mean")), 4)
    return row


def arrival_spread_ms(timeline: list, window: tuple[int, int]) -> float | None:
    """Milliseconds from the first request's arrival at the coordinator to the last's, inside `window` (ns): the
    one process gets its batch at once, the services as the client's streams reach them."""
    received = [ns for stage, ns in timeline if stage == "request.received" and window[0] <= ns <= window[1]]
    return round((max(received) - min(received)) / 1e6, 3) if received else None


def first_token_breakdown(timeline: list, window: tuple[int, int]) -> dict:
    """Median microseconds of each first-token stage over the requests inside `window` (ns), and the requests
    counted: from each `request.received`, the first mark of each stage's name after the previous one."""
    start_ns, end_ns = window
    inside = [m for m in timeline if start_ns <= m[1] <= end_ns]
    received = [i for i, (stage, _) in enumerate(inside) if stage == "request.received"]
    samples: dict[str, list[float]] = {name: [] for name, _, _ in FIRST_TOKEN_STAGES}
    for n, i in enumerate(received):
        following = inside[i: received[n + 1] if n + 1 < len(received) else len(inside)]
        at, cursor = {"request.received": inside[i][1]}, 0
        for _, _, mark in FIRST_TOKEN_STAGES:
            found = next((k for k in range(cursor, len(following)) if following[k][0] == mark), None)
            if found is None:
                break
            at[mark], cursor = following[found][1], found + 1
        for name, a, b in FIRST_TOKEN_STAGES:
            if a in at and b in at:
                samples[name].append((at[b] - at[a]) / 1e3)
    row = {name: round(statistics.median(v), 1) for name, v in samples.items() if v}
    row["requests_timed"] = len(samples["request_to_prefill"])
    return row


def timeline_events(path: str, key: str) -> dict:
    """From a saved timeline (`$OUT/NAME_timeline.json.gz`) and one row's window ("mode alpha batch k"): the gaps
    from a round's commit to the next round's start that exceed 0.3 ms, with the coordinator marks inside each (ms),
    and each target prefill step's span (ms, from its step's start to end)."""
    with gzip.open(path, "rt") as f:
        saved = json.load(f)
    start, end = saved["windows"][key]
    inside = [m for m in saved["marks"] if start <= m[1] <= end]
    coordinator = [m for m in inside if not m[0].startswith(("draft.", "target."))]
    gaps, committed = [], None
    for i, (stage, ns) in enumerate(coordinator):
        if stage == "round.start" and committed is not None and ns - committed[1] > 300_000:
            between = [m[0] for m in coordinator[committed[0] + 1 : i]]
            gaps.append({"at_ms": round((ns - start) / 1e6, 2), "gap_ms": round((ns - committed[1]) / 1e6, 2),
                         "marks": {m: between.count(m) for m in sorted(set(between))}})
        if stage == "round.committed":
            committed = (i, ns)
    target = [m for m in inside if m[0].startswith("target.")]
    prefills = []
    for i, (stage, ns) in enumerate(target):
        if stage == "target.prefill.received":
            steps = [m for m in target[i + 1:] if m[0] in ("target.step_start", "target.step_end")][:2]
            if len(steps) == 2:
                prefills.append({"at_ms": round((steps[0][1] - start) / 1e6, 2),
                                 "step_ms": round((steps[1][1] - steps[0][1]) / 1e6, 2)})
    return {"round_gaps": gaps, "target_prefill_steps": prefills}


# ---- main -----------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--target", default="7b")
    parser.add_argument("--draft", default="0.5b")
    parser.add_argument("--devices", default=None, help="target's device, draft's device (GPU: cuda:0,cuda:1)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--ks", default="0,4")
    parser.add_argument("--alphas", default="", help="synthetic acceptance per run (NOT lossless; GPU: random "
                        "weights never agree); empty: real acceptance (the CPU's close tiny draft)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="in_process,split,colocated",
                        help=f"in_process and any of {', '.join(SERVICE_MODES)} (one co-located mode at most)")
    parser.add_argument("--kv-blocks", type=int, default=None)
    parser.add_argument("--client", default="async", choices=["async", "threads"],
                        help="the services' client: the batch's streams from one asyncio loop, or a thread each "
                        "(a blocking client per thread: their starts spread over ~0.3 ms a request on a GPU host)")
    parser.add_argument("--arrival-window-ms", type=float, default=None,
                        help="the services' coordinators' --arrival-window-ms (default: theirs; the one process gets "
                        "its batch at once)")
    parser.add_argument("--decode-ahead", default="auto", choices=DECODE_AHEAD_MODES,
                        help="the target's decode ahead, in one process and in the target service alike")
    parser.add_argument("--pin-workers", default="", metavar="DRAFT_CORES:TARGET_CORES",
                        help="start the draft and the target pinned to these cores (e.g. 0:1); the coordinator, the "
                             "client and the one process stay unpinned")
    parser.add_argument("--label", default="", help="names this code's rows (e.g. before / after)")
    parser.add_argument("--name", default="split_breakdown_cpu")
    parser.add_argument("--read-timeline", nargs=2, metavar=("FILE", "ROW"),
                        help='print a saved timeline\'s round gaps and target prefill steps for one row, e.g. '
                        '"split 0.7 8 0" (mode alpha batch k), and run nothing')
    args = parser.parse_args()
    if args.read_timeline:
        print(json.dumps(timeline_events(*args.read_timeline), indent=1))
        return
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    args.devices = (args.devices or ("cpu,cpu" if args.device == "cpu" else "cuda:0,cuda:1")).split(",")
    if args.device == "cpu":
        torch.set_num_threads(1)
        args.kv_blocks = args.kv_blocks or 4096
    else:
        os.environ.setdefault("SPECSPLIT_BENCH_DEVICE", "cuda")
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")] if args.alphas else [None]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m != "in_process" and m not in SERVICE_MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from in_process, {', '.join(SERVICE_MODES)}")
    root = Path(tempfile.mkdtemp())
    target_dir, draft_dir, target, draft = build_models(args, root)
    local = in_process_rows(args, target, draft, batches, ks, alphas) if "in_process" in modes else {}
    del target, draft
    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()  # the one-process engine's models and KV go before the services start
    rows = [{"label": args.label, "mode": "in_process", "alpha": alpha, "batch": batch, "k": k, **run}
            for (alpha, batch, k), run in local.items()]
    services = [m for m in modes if m != "in_process"]
    if services:
        prefix = str(root / "timeline")
        measured, windows, spans = services_rows(args, services, target_dir, draft_dir, batches, ks, alphas, prefix)
        timeline = read_timeline(prefix)
        if os.environ.get("OUT"):  # the raw marks, for other readings of the same run
            with gzip.open(Path(os.environ["OUT"]) / f"{args.name}_timeline.json.gz", "wt") as out:
                json.dump({"marks": timeline, "windows": {" ".join(map(str, k)): v for k, v in windows.items()}}, out)
        for (mode, alpha, batch, k), run in measured.items():
            row = {"label": args.label, "mode": mode, "alpha": alpha, "batch": batch, "k": k,
                   "pin_workers": args.pin_workers, **run}
            reference = local.get((alpha, batch, k))
            if reference is not None:
                row["vs_in_process"] = run["tokens_per_s"] / reference["tokens_per_s"]
                row["extra_ms_per_round"] = run["ms_per_round"] - reference["ms_per_round"]
                row["ttft_vs_in_process"] = run["ttft_ms"] / reference["ttft_ms"]
                row["coordinator_ttft_vs_in_process"] = run["coordinator_ttft_ms"] / reference["coordinator_ttft_ms"]
                if run["tpot_ms"] and reference["tpot_ms"]:
                    row["tpot_vs_in_process"] = run["tpot_ms"] / reference["tpot_ms"]
                    # The decode phase alone (staggered arrivals make the services' first tokens later): the extra
                    # time per round from the time per output token.
                    row["decode_extra_ms_per_round"] = (run["tpot_ms"] - reference["tpot_ms"]) * run["tokens_per_round"]
            serial = measured.get((mode.replace("_pipelined", "").replace("_auto", ""), alpha, batch, k))
            if serial is not None and serial is not run:
                row["vs_serial"] = run["tokens_per_s"] / serial["tokens_per_s"]
            row["breakdown_ms"] = breakdown(timeline, windows[(mode, alpha, batch, k)])
            row["arrival_spread_ms"] = arrival_spread_ms(timeline, windows[(mode, alpha, batch, k)])
            if batch == 1 and mode.startswith("split"):
                row["first_token_us"] = first_token_breakdown(timeline, spans[(mode, alpha, batch, k)])  # all repeats
            rows.append(row)
    print_table(rows, ["label", "mode", "alpha", "batch", "k", "tokens_per_s", "ms_per_round", "tokens_per_round",
                       "extra_ms_per_round", "decode_extra_ms_per_round", "vs_in_process", "vs_serial",
                       "pre_proposed_rounds", "ttft_ms", "coordinator_ttft_ms", "tpot_ms", "arrival_spread_ms"])
    for row in rows:
        if "breakdown_ms" in row:
            print(row["label"], row["mode"], row["alpha"], row["batch"], row["k"], json.dumps(row["breakdown_ms"]))
        if "first_token_us" in row:
            print(row["label"], row["mode"], row["alpha"], row["batch"], row["k"], "first token (us):",
                  json.dumps(row["first_token_us"]))
    path = write_results(args.name, rows, {
        "models": ("tiny random-weight qwen2 pair (close draft), float32, CPU, one torch thread per process"
                   if args.device == "cpu" else f"random-weight Qwen2.5 {args.target} target on {args.devices[0]}, "
                   f"{args.draft} draft on {args.devices[1]} (one process: both on {args.devices[0]}), bf16"),
        "acceptance": "synthetic (NOT lossless) where alpha is set" if args.alphas else "real (greedy)",
        "max_tokens": args.max_tokens, "repeats": args.repeats, "client": args.client,
        "arrival_window_ms": args.arrival_window_ms if args.arrival_window_ms is not None else "the services' default",
        "decode_ahead": args.decode_ahead,
        "load_average": open("/proc/loadavg").read().split()[:3],
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
