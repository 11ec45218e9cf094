"""One run's numbers, as `vllm bench serve` and SGLang's bench_serving report them, plus what this server says
speculation did:

- request_throughput: completed requests per second of the run; output_tokens_per_s: their generated tokens per second;
- ttft_ms: time to the first piece of output; tpot_ms: per request, (latency - ttft) / (output tokens - 1);
  itl_ms: the gaps between consecutive pieces of output (a streamed chunk may carry several tokens: with
  speculation, a round's accepted tokens arrive together); e2el_ms: request latency. Each {mean, p50, p90, p99};
- acceptance_rate: accepted / drafted tokens; tokens_per_round: tokens per target verification
  ((accepted + rounds) / rounds, the first token, from prefill, not counted; every round, k = 0 ones included: the
  dashboard's "tokens per speculative round" counts only rounds that verified proposals). None from other servers.
"""

import math
from collections import Counter

from specsplit.bench.load_generator import LoadRun
from specsplit.bench.percentiles import distribution

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def latency_samples(run: LoadRun) -> dict[str, list[float]]:
    """{latency: [ms, ...]} of the run's completed requests: what the percentiles (and the plot's curves) are of."""
    done = [r for r in run.records if r.ok]
    timed = [r for r in done if r.ttft is not None]
    return {
        "ttft_ms": [1e3 * r.ttft for r in timed],
        "tpot_ms": [1e3 * (r.latency - r.ttft) / (r.output_tokens - 1) for r in timed if r.output_tokens > 1],
        "itl_ms": [1e3 * gap for r in done for gap in r.itls],
        "e2el_ms": [1e3 * r.latency for r in done],
    }


def summarize(run: LoadRun) -> dict:
    done = [r for r in run.records if r.ok]
    failed = [r for r in run.records if not r.ok]
    duration = run.duration or math.nan
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens for r in done)
    reporting = [r for r in done if r.rounds is not None]
    rounds = sum(r.rounds for r in reporting)
    drafted = sum(r.drafted_tokens for r in reporting)
    accepted = sum(r.accepted_tokens for r in reporting)
    return {
        "request_rate": "inf" if math.isinf(run.request_rate) else run.request_rate,
        "max_concurrency": run.max_concurrency,
        "duration_s": run.duration,
        "completed": len(done),
        "failed": len(failed),
        "errors": dict(Counter(r.error for r in failed).most_common(5)),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (input_tokens + output_tokens) / duration,
        **{name: distribution(samples) for name, samples in latency_samples(run).items()},
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_round": (accepted + rounds) / rounds if rounds else None,
        "interrupted": run.interrupted or None,
    }
