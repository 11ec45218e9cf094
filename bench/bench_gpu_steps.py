"""The round's worker calls on one GPU, one at a time: a draft call of k steps, a verification of k proposals, a
plain decode (k = 0), each as the worker runs it (host work, one upload, one graph replay, one copy back), against
the memory-bandwidth floor measured in the same run. Random-weight Qwen2.5 shapes, bf16.

Per call it records: wall time (what the coordinator waits for, in process), the graph replay alone (CUDA events
around back-to-back replays), host time = wall - replay, and for decodes the floor = bytes that must be read
(weights + the KV of the context) / device copy bandwidth. With --profile it also writes the kernel-time breakdown
of one eager decode step and one eager draft call (torch.profiler), to see where time goes inside a step; with
--profile-modes it profiles the target's eager decode and k = 4 verification at --profile-batches in the default
kernels and in the batch-invariant mode (kernels/dispatch.py), to see where the mode's cost goes.

    python3 bench/bench_gpu_steps.py [--targets 7b] [--batches 1,8,32,64] [--contexts 64,4096,16384] [--profile]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from bench_gpu_e2e import hf_random_model, loaded_from_hf  # noqa: E402
from specsplit.services.draft.proposer import DraftPrefill, DraftProposer, ProposeItem  # noqa: E402
from specsplit.services.runtime.model_runner import ModelRunner  # noqa: E402
from specsplit.services.runtime.worker_sequences import WorkerSampling  # noqa: E402
from specsplit.services.target.verifier import TargetPrefill, TargetVerifier, VerifyItem  # noqa: E402

K = 4
ROWS: list[dict] = []
PROFILE_HOST = False


def log(*args):
    print(*args, flush=True)


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written."""
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB, far past L2
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 31) / statistics.median(times)


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(config) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # bf16 K and V


def timed(call, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


class HostClock:
    """Where a call's host time goes: worker code before the graph cache, then inside it (staging the inputs,
    the replay launch with its copies, the wait for the result). Installed on a runner's GraphCache."""

    def __init__(self, runner):
        self.samples: list[tuple[float, float, float]] = []
        cache = runner.graphs
        original = cache.run

        def run(key, program, host_inputs, wait: bool = True):
            t0 = time.perf_counter()
            step = cache.steps.get(key)
            if step is None or not wait:
                return original(key, program, host_inputs, wait)
            step.staging.numpy()[:] = host_inputs
            with torch.cuda.device(cache.device):
                stream = torch.cuda.current_stream(cache.device)
                if not step.copies_inside:
                    step.inputs.copy_(step.staging, non_blocking=True)
                t1 = time.perf_counter()
                step.graph.replay()
                if not step.copies_inside:
                    step.result.copy_(step.output, non_blocking=True)
                t2 = time.perf_counter()
                stream.synchronize()
            self.samples.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
            self.entered = t0
            return step.result.numpy()

        cache.run = run

    def summary(self, call, repeats: int) -> dict:
        """Median of: worker host work before the cache (wall - time in the cache), upload, launch, wait."""
        self.samples.clear()
        before = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            before.append(self.entered - t0)
        upload, launch, wait = (statistics.median(s[i] for s in self.samples) for i in range(3))
        return {"host_worker_ms": 1e3 * statistics.median(before), "host_upload_ms": 1e3 * upload,
                "host_launch_ms": 1e3 * launch, "wait_ms": 1e3 * wait}


def host_profile(name: str, call, repeats: int = 30) -> None:
    """cProfile of `repeats` calls: where the host time of a call goes (printed, top functions by own time)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        call()
    profiler.disable()
    log(f"host profile: {name}, {repeats} calls")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def replay_time(runner, name: str, repeats: int = 50) -> float | None:
    """Median seconds of one replay of the graph the last call of `name` used (no host work around it)."""
    keys = [key for key in runner.graphs.steps if key[0] == name] if runner.graphs is not None else []
    if not keys:
        return None
    step = runner.graphs.steps[keys[-1]]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(runner.device):
        for _ in range(3):
            step.graph.replay()
        start.record()
        for _ in range(repeats):
            step.graph.replay()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151936, (length,), generator=g).tolist()


def bench_verifier(size, loaded, batches, contexts, bandwidth, sampling, repeats, steps=(0, K)):
    weights = weight_bytes(loaded.model)
    for context in contexts:
        for batch in batches:
            runner = ModelRunner(loaded, num_blocks=batch * (context // 16 + 4) + 8, prefix_caching=False)
            clock = HostClock(runner)
            verifier = TargetVerifier(runner)
            handles = [f"s{i}" for i in range(batch)]
            verifier.prefill([TargetPrefill(h, prompt(context, i), sampling) for i, h in enumerate(handles)])
            for k in steps:
                # Proposals from the target's own distribution would be accepted; any tokens do for timing, and the
                # KV is rewound to the context every call so each call does the same work.
                drafts = prompt(k, 99)
                q = (torch.tensor([drafts] * 1).T.reshape(k, 1), torch.ones(k, 1)) if k else (None, None)
                items = [VerifyItem(h, context, [7], drafts, q[0], q[1]) for h in handles]
                call = lambda: verifier.verify(items)  # noqa: E731
                call()
                wall = timed(call, repeats)
                replay = replay_time(runner, "verify")
                breakdown = clock.summary(call, repeats)
                if PROFILE_HOST and batch in (1, 32) and context == contexts[0]:
                    host_profile(f"{size} verify k={k} batch {batch}", call)
                row = {"model": size, "call": "decode" if k == 0 else f"verify k={k}", "batch": batch,
                       "context": context, "sampling": "greedy" if sampling.greedy else "sampled",
                       "wall_ms": 1e3 * wall, "replay_ms": 1e3 * replay if replay else None,
                       "host_ms": 1e3 * (wall - replay) if replay else None, **breakdown}
                if k == 0:
                    floor = (weights + batch * (context + 1) * kv_bytes_per_token(loaded.config)) / bandwidth
                    row.update(floor_ms=1e3 * floor, share_of_floor=floor / replay if replay else None,
                               tokens_per_s=batch / wall)
                ROWS.append(row)
                log(row)
            del verifier, runner
            torch.cuda.empty_cache()


def bench_proposer(size, loaded, batches, bandwidth, sampling, repeats, context=64):
    for batch in batches:
        runner = ModelRunner(loaded, num_blocks=batch * (context // 16 + 4) + 8, prefix_caching=False)
        clock = HostClock(runner)
        proposer = DraftProposer(runner)
        handles = [f"s{i}" for i in range(batch)]
        proposer.prefill([DraftPrefill(h, prompt(context, i), sampling) for i, h in enumerate(handles)])
        items = [ProposeItem(h, context, [7], K) for h in handles]
        call = lambda: proposer.propose(items)  # noqa: E731
        call()
        wall = timed(call, repeats)
        replay = replay_time(runner, "draft")
        breakdown = clock.summary(call, repeats)
        if PROFILE_HOST and batch == 1:
            host_profile(f"{size} draft k={K} batch {batch}", call)
        floor = weight_bytes(loaded.model) / bandwidth
        row = {"model": size, "call": f"draft k={K}", "batch": batch, "context": context,
               "sampling": "greedy" if sampling.greedy else "sampled", "wall_ms": 1e3 * wall,
               "replay_ms": 1e3 * replay if replay else None, "host_ms": 1e3 * (wall - replay) if replay else None,
               "per_step_ms": 1e3 * (replay or wall) / K, "floor_ms_per_step": 1e3 * floor, **breakdown}
        ROWS.append(row)
        log(row)
        del proposer, runner
        torch.cuda.empty_cache()


def profile(loaded, name: str, program_call) -> list[dict]:
    """Kernel time by kernel name for one eager call (graphs off), largest first."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        program_call()
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            entry = totals.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            entry[1] += 1
    rows = sorted(({"kernel": k, "us": v[0], "count": v[1]} for k, v in totals.items()), key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    log(f"profile {name}: {sum(r['count'] for r in rows)} kernels, {total:.0f} us of kernel time")
    for r in rows[:20]:
        log(f"  {r['us']:8.1f} us  x{r['count']:4d}  {r['kernel']}")
    return [{"profile": name, **r} for r in rows[:40]] + [{"profile": name, "kernel": "TOTAL", "us": total,
                                                            "count": sum(r["count"] for r in rows)}]


def profile_modes(size, loaded, batches: list[int], sampling) -> list[dict]:
    """Eager kernel profiles of the target's decode and k = 4 verification, default kernels then the batch-invariant
    mode's, at each batch (64-token contexts)."""
    import os

    from specsplit.kernels.dispatch import set_batch_invariant

    profiles = []
    os.environ["SPECSPLIT_CUDA_GRAPHS"] = "0"
    try:
        for mode in (False, True):
            set_batch_invariant(mode)
            label = "batch-invariant" if mode else "default"
            for batch in batches:
                runner = ModelRunner(loaded, num_blocks=batch * 9 + 8, prefix_caching=False)
                verifier = TargetVerifier(runner)
                handles = [f"p{i}" for i in range(batch)]
                verifier.prefill([TargetPrefill(h, prompt(64, i), sampling) for i, h in enumerate(handles)])
                drafts = prompt(K, 99)
                q = torch.tensor([drafts]).T.reshape(K, 1), torch.ones(K, 1)
                for call_name, items in (("decode", [VerifyItem(h, 64, [7]) for h in handles]),
                                         (f"verify k={K}", [VerifyItem(h, 64, [7], drafts, *q) for h in handles])):
                    call = lambda: verifier.verify(items)  # noqa: E731
                    call()
                    call()
                    profiles += profile(loaded, f"{size} {call_name} batch {batch} {label} (eager)", call)
                del verifier, runner
                torch.cuda.empty_cache()
    finally:
        set_batch_invariant(False)
        del os.environ["SPECSPLIT_CUDA_GRAPHS"]
    return profiles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", default="7b")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--draft-batches", default="1,8,32")
    parser.add_argument("--contexts", default="64")
    parser.add_argument("--long-contexts", default="4096,16384", help="decode at batch 1 with these contexts too")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-host", action="store_true", help="cProfile the host side of some calls")
    parser.add_argument("--profile-modes", action="store_true",
                        help="profile the target's decode and verification in the default and batch-invariant modes")
    parser.add_argument("--profile-batches", default="1,32")
    parser.add_argument("--skip-timing", action="store_true", help="profiles only")
    parser.add_argument("--name", default="")
    args = parser.parse_args()
    global PROFILE_HOST
    PROFILE_HOST = args.profile_host
    batches = [int(b) for b in args.batches.split(",") if b]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    extra = {"copy_bandwidth_bytes_per_s": bandwidth, "k": K, "dtype": "bfloat16",
             "models": "random-weight Qwen2.5 shapes"}
    greedy, sampled = WorkerSampling(0.0, 0, 1.0, 1), WorkerSampling(1.0, 0, 1.0, 1)
    profiles = []

    draft = loaded_from_hf(hf_random_model("0.5b", seed=1), "random-qwen2.5-0.5b")
    if not args.skip_timing:
        bench_proposer("0.5b", draft, [int(b) for b in args.draft_batches.split(",") if b], bandwidth, greedy,
                       args.repeats)
        bench_proposer("0.5b", draft, [1], bandwidth, sampled, args.repeats)
    if args.profile:
        import os
        os.environ["SPECSPLIT_CUDA_GRAPHS"] = "0"
        runner = ModelRunner(draft, num_blocks=64, prefix_caching=False)
        del os.environ["SPECSPLIT_CUDA_GRAPHS"]
        proposer = DraftProposer(runner)
        proposer.prefill([DraftPrefill("p", prompt(64, 0), greedy)])
        call = lambda: proposer.propose([ProposeItem("p", 64, [7], K)])  # noqa: E731
        call()
        profiles += profile(draft, "0.5b draft call k=4 batch 1 (eager)", call)
        del proposer, runner

    for size in filter(None, args.targets.split(",")):  # "": the draft alone
        hf = hf_random_model(size, seed=2)
        target = loaded_from_hf(hf, f"random-qwen2.5-{size}")
        del hf
        torch.cuda.empty_cache()
        extra.setdefault("weight_bytes", {})[size] = weight_bytes(target.model)
        if not args.skip_timing:
            bench_verifier(size, target, batches, contexts, bandwidth, greedy, args.repeats)
            long_contexts = [int(c) for c in args.long_contexts.split(",") if c]
            if long_contexts:
                bench_verifier(size, target, [1], long_contexts, bandwidth, greedy, args.repeats, steps=(0,))
            bench_verifier(size, target, [1, 8], contexts[:1], bandwidth, sampled, args.repeats)
        if args.profile_modes:
            profiles += profile_modes(size, target, [int(b) for b in args.profile_batches.split(",") if b], greedy)
        if args.profile:
            import os
            os.environ["SPECSPLIT_CUDA_GRAPHS"] = "0"
            runner = ModelRunner(target, num_blocks=64, prefix_caching=False)
            del os.environ["SPECSPLIT_CUDA_GRAPHS"]
            verifier = TargetVerifier(runner)
            verifier.prefill([TargetPrefill("p", prompt(64, 0), greedy)])
            call = lambda: verifier.verify([VerifyItem("p", 64, [7])])  # noqa: E731
            call()
            profiles += profile(target, f"{size} decode batch 1 (eager)", call)
            del verifier, runner
        del target
        torch.cuda.empty_cache()
    extra["profiles"] = profiles
    write_results(f"gpu_steps{args.name}", ROWS, extra)
    print_table(ROWS, ["model", "call", "batch", "context", "sampling", "wall_ms", "replay_ms", "host_ms",
                       "host_worker_ms", "host_upload_ms", "host_launch_ms", "wait_ms", "floor_ms", "share_of_floor",
                       "per_step_ms"])


if __name__ == "__main__":
    main()
