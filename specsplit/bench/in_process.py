"""`specsplit bench latency` and `bench throughput`: the target alone against speculation, in this process, on one
engine (the same models and KV cache; the target alone is a request with num_speculative_tokens 0). Prefix caching
is off, so the mode that runs second does not find the first one's prompts cached.

- latency: a batch of `batch_size` requests at once, `num_iters` times, the two modes taking turns per iteration;
- throughput: `num_prompts` requests at once (at most `max_concurrency` in flight), each mode once.
Each mode's summary has the fields of `specsplit bench serve`; `speedup` divides speculative by target-only.
"""

import math

from specsplit.bench.engine_client import EngineClient
from specsplit.bench.load_generator import LoadRun, run_load, warm_up
from specsplit.bench.percentiles import distribution
from specsplit.bench.summary import summarize

MODES = {"target_only": 0, "speculative": None}  # per-request k: 0 = the target alone, None = the engine's


def build_engine(args):
    from specsplit.services.coordinator.coordinator import CoordinatorConfig
    from specsplit.services.local_engine import LocalEngine

    return LocalEngine(
        args.target, args.draft, num_speculative_tokens=args.num_speculative_tokens, dtype=args.dtype,
        device=args.device, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, prefix_caching=False,
        target_weights=args.target_weights, draft_weights=args.draft_weights,
        coordinator_config=CoordinatorConfig(speculation=args.speculation, overlap=args.overlap),
    )


async def measure_latency(engine, requests: list, batch_size: int, num_iters: int, num_warmup: int,
                          temperature: float, progress: bool) -> dict:
    clients = {mode: EngineClient(engine, temperature, k) for mode, k in MODES.items()}
    batch = requests[:batch_size]
    for client in clients.values():
        for _ in range(num_warmup):
            await warm_up(client, batch[:1])
    runs = {mode: LoadRun(math.inf, batch_size) for mode in MODES}
    batch_seconds = {mode: [] for mode in MODES}
    for iteration in range(num_iters):
        for mode, client in clients.items():
            run = await run_load(client, batch, progress=False)
            runs[mode].records += run.records
            runs[mode].duration += run.duration
            batch_seconds[mode].append(run.duration)
        if progress:
            print(f"iteration {iteration + 1}/{num_iters}: " + ", ".join(
                f"{mode} {batch_seconds[mode][-1]:.3f}s" for mode in MODES), flush=True)
    summaries = {mode: {**summarize(run), "batch_latency_s": distribution(batch_seconds[mode])}
                 for mode, run in runs.items()}
    return with_speedup(summaries)


async def measure_throughput(engine, requests: list, max_concurrency: int | None, num_warmup: int,
                             temperature: float, progress: bool) -> dict:
    summaries = {}
    for mode, k in MODES.items():
        client = EngineClient(engine, temperature, k)
        await warm_up(client, requests[:num_warmup])
        run = await run_load(client, requests, math.inf, max_concurrency, progress=progress, label=mode)
        summaries[mode] = summarize(run)
    return with_speedup(summaries)


def with_speedup(summaries: dict) -> dict:
    base, fast = summaries["target_only"], summaries["speculative"]

    def ratio(a, b):
        return a / b if a and b else None

    return {**summaries, "speedup": {
        "output_tokens_per_s": ratio(fast["output_tokens_per_s"], base["output_tokens_per_s"]),
        "tpot_p50": ratio(base["tpot_ms"]["p50"], fast["tpot_ms"]["p50"]),
        "e2el_p50": ratio(base["e2el_ms"]["p50"], fast["e2el_ms"]["p50"]),
    }}
