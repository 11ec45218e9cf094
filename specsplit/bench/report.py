"""Printing a run's summary as a block of lines (one run), or several runs side by side as a table."""

from specsplit.bench.records import print_table
from specsplit.bench.summary import LATENCIES

_LABELS = {"ttft_ms": "Time to first token", "tpot_ms": "Time per output token", "itl_ms": "Inter-token latency",
           "e2el_ms": "End-to-end latency"}


def print_summary(summary: dict, title: str, file=None) -> None:
    line = "=" * 58

    def row(label, value, unit=""):
        shown = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label + unit + ':':<44}{shown:>14}", file=file)

    print(f"{(' ' + title + ' '):=^58}", file=file)
    row("Request rate", summary["request_rate"], " (req/s)")
    row("Max concurrency", summary["max_concurrency"] or "none")
    row("Successful requests", summary["completed"])
    row("Failed requests", summary["failed"])
    row("Benchmark duration", summary["duration_s"], " (s)")
    row("Total input tokens", summary["total_input_tokens"])
    row("Total generated tokens", summary["total_output_tokens"])
    row("Request throughput", summary["request_throughput"], " (req/s)")
    row("Output token throughput", summary["output_tokens_per_s"], " (tok/s)")
    row("Acceptance rate", summary["acceptance_rate"])
    row("Tokens per round", summary["tokens_per_round"])
    for key in LATENCIES:
        print(f"{(' ' + _LABELS[key] + ' '):-^58}", file=file)
        for stat in ("mean", "p50", "p90", "p99"):
            row(f"{stat.capitalize() if stat == 'mean' else stat.upper()} {key.removesuffix('_ms').upper()}",
                summary[key][stat], " (ms)")
    for error, count in summary["errors"].items():
        print(f"failed x{count}: {error}", file=file)
    if summary["interrupted"]:
        print(f"INTERRUPTED: {summary['interrupted']}", file=file)
    print(line, file=file)


def print_side_by_side(summaries: dict[str, dict], file=None) -> None:
    """{name: summary} as one row each: throughputs and the p50 / p99 latencies."""
    rows = []
    for name, s in summaries.items():
        rows.append({"run": name, "req/s": s["request_throughput"], "out tok/s": s["output_tokens_per_s"],
                     "ttft p50": s["ttft_ms"]["p50"], "ttft p99": s["ttft_ms"]["p99"],
                     "tpot p50": s["tpot_ms"]["p50"], "itl p50": s["itl_ms"]["p50"], "itl p99": s["itl_ms"]["p99"],
                     "accept": s["acceptance_rate"], "tok/round": s["tokens_per_round"]})
    print_table(rows, list(rows[0]), file=file)
