"""`--plot FILE`: a PNG of the latencies. Several request rates: p50 / p90 / p99 of TTFT, TPOT and ITL against the
rate each run achieved (its request throughput). One rate: the distribution of each over the run's requests."""

from specsplit.bench.summary import LATENCIES


def plot_runs(path, summaries: list[dict], samples: list[dict] | None = None, title: str = "") -> None:
    """`summaries` from summarize(); `samples` ({latency: [ms, ...]} per run) for the one-rate view."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in LATENCIES if k != "e2el_ms"]
    figure, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), constrained_layout=True)
    for axis, key in zip(axes, keys):
        name = key.removesuffix("_ms").upper()
        if len(summaries) > 1:
            rates = [s["request_throughput"] for s in summaries]
            for stat, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
                axis.plot(rates, [s[key][stat] for s in summaries], style, label=stat)
            axis.set_xlabel("request throughput achieved (req/s)")
            axis.legend()
        else:
            values = sorted((samples or [{}])[0].get(key) or [])
            if values:
                axis.plot(values, [(i + 1) / len(values) for i in range(len(values))], drawstyle="steps-post")
                for stat in ("p50", "p90", "p99"):
                    axis.axvline(summaries[0][key][stat], linestyle=":", color="grey")
            axis.set_xlabel(f"{name} (ms)")
            axis.set_ylabel("fraction of samples")
        axis.set_title(f"{name}: share of samples below (p50, p90, p99 dotted)" if len(summaries) == 1 else f"{name} (ms)")
        axis.grid(True, alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=100)
    plt.close(figure)
