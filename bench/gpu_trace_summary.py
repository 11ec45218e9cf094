"""Where a tensor-parallel rank's decode steps spend their time, from its torch.profiler Chrome trace.

A worker call on a GPU is one CUDA-graph replay, so a step is the kernels of one `cudaGraphLaunch` (the profiler
gives each of them the launch's correlation id; traces without it fall back to "the kernels after a launch, up to
the next"). Per replay:

- compute: kernels that are not communication (matmuls, attention, norms, sampling);
- comm: NCCL kernels, torch's symmetric-memory all-reduces, the fused all-reduce + norm kernel (they include the
  time a rank waits inside them for a slower peer);
- idle: the GPU doing nothing between the replay's first and last kernel;
- gap: from the replay's last kernel to the next replay's first: host work and lockstep (the result's copy, the
  coordinator's round, the next command, the launch).

Eager kernels (a prefill) belong to no replay and are left out. Medians over the replays of the trace.
"""

import json
import re
import statistics

COMM_KERNELS = re.compile(r"nccl|one_shot|two_shot|all_reduce|allreduce|all_gather|allgather|reduce_scatter", re.I)


def summarize_trace(path: str) -> dict:
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    launches = sorted((e for e in spans if e.get("cat") in ("cuda_runtime", "cuda_driver")
                       and "GraphLaunch" in e.get("name", "")),
                      key=lambda e: e["ts"])
    kernels = sorted((e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    replays = _by_correlation(launches, kernels) or _by_launch_time(launches, kernels)
    steps = [_replay(r) for r in replays if r]
    for step, following in zip(steps, steps[1:]):
        step["gap_us"] = following["start"] - step["end"]
        step["step_us"] = following["start"] - step["start"]
    timed = steps[:-1]  # the last replay has no next one to measure a gap to
    summary = {"replays": len(steps), "kernels_per_replay": _median([s["kernels"] for s in steps])}
    for key in ("step_us", "span_us", "compute_us", "comm_us", "comm_kernels", "idle_us", "gap_us"):
        summary[key] = _median([s[key] for s in timed]) if timed else None
    comm_names: dict[str, float] = {}
    for step in timed:
        for name, us in step["comm_by_name"].items():
            comm_names[name] = comm_names.get(name, 0.0) + us / len(timed)
    summary["comm_us_by_kernel"] = {k: round(v, 1) for k, v in sorted(comm_names.items(), key=lambda kv: -kv[1])[:4]}
    return summary


def _by_correlation(launches, kernels) -> list[list[dict]]:
    ids = {e.get("args", {}).get("correlation"): i for i, e in enumerate(launches)}
    ids.pop(None, None)
    replays: list[list[dict]] = [[] for _ in launches]
    for kernel in kernels:
        index = ids.get(kernel.get("args", {}).get("correlation"))
        if index is not None:
            replays[index].append(kernel)
    return replays if any(replays) else []


def _by_launch_time(launches, kernels) -> list[list[dict]]:
    replays: list[list[dict]] = [[] for _ in launches]
    starts = [e["ts"] for e in launches]
    for kernel in kernels:
        index = sum(1 for s in starts if s <= kernel["ts"]) - 1
        if index >= 0:
            replays[index].append(kernel)
    return replays


def _replay(kernels: list[dict]) -> dict:
    start = min(k["ts"] for k in kernels)
    end = max(k["ts"] + k["dur"] for k in kernels)
    comm = [k for k in kernels if COMM_KERNELS.search(k.get("name", ""))]
    comm_by_name: dict[str, float] = {}
    for k in comm:
        short = k["name"].split("(")[0][:60]
        comm_by_name[short] = comm_by_name.get(short, 0.0) + k["dur"]
    busy, cursor = 0.0, start
    for k in kernels:  # the union of the kernels' intervals (streams may overlap)
        k_start, k_end = max(k["ts"], cursor), k["ts"] + k["dur"]
        if k_end > k_start:
            busy += k_end - k_start
            cursor = k_end
    return {"start": start, "end": end, "kernels": len(kernels), "span_us": end - start,
            "compute_us": sum(k["dur"] for k in kernels) - sum(k["dur"] for k in comm),
            "comm_us": sum(k["dur"] for k in comm), "comm_kernels": len(comm), "comm_by_name": comm_by_name,
            "idle_us": (end - start) - busy}


def _median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None
