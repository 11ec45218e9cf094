"""The canary comparison written out: report.md (tables, the verdict, the output check), report.png (per-position
acceptance per draft; per-request latency per run) and report.json (the numbers behind both)."""

import json
from pathlib import Path

from specsplit.services.canary.compare import Comparison, DraftRun, pairwise
from specsplit.services.telemetry.confidence_intervals import wilson


def write_report(comparison: Comparison, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "report.md", "plot": out / "report.png", "json": out / "report.json"}
    paths["markdown"].write_text(render_markdown(comparison), encoding="utf-8")
    render_plot(comparison, paths["plot"])
    paths["json"].write_text(json.dumps(comparison.to_json(), indent=2) + "\n", encoding="utf-8")
    return paths


def _ci(interval, fmt: str) -> str:
    return f"[{format(interval[0], fmt)}, {format(interval[1], fmt)}]" if interval else "–"


def _value(value, fmt: str) -> str:
    return format(value, fmt) if value is not None else "–"


def render_markdown(c: Comparison) -> str:
    lines = [
        "# Draft canary comparison",
        "",
        f"Target `{c.target}`; {len(c.prompts)} prompts, greedy, up to {c.max_tokens} tokens, k = {c.num_speculative_tokens}; "
        "one request at a time, in-process. Intervals are 95%: Wilson for acceptance (over drafted tokens), "
        "Student's t for the mean tokens/s (over requests).",
        "",
    ]
    if c.identical_outputs:
        lines.append(f"**Outputs identical:** yes: all {len(c.prompts)} prompts gave the same tokens, token for token, "
                     f"with every run ({', '.join(run.label for run in c.runs)}). The target decides every token, "
                     "so a draft can only change speed.")
    else:
        lines.append(f"**Outputs identical:** NO: prompts {c.mismatched_prompts()} differ between runs. The target "
                     "decides every token, so this points at numerics (near-ties under a low-precision dtype) or a bug.")
    lines += ["", "| run | requests | acceptance (95% CI) | mean accepted length | system efficiency | tokens/s (95% CI) | mean latency s | mean TTFT s |",
              "|---|---:|---|---:|---:|---|---:|---:|"]
    for run in c.runs:
        t = run.totals()
        tps = t.tokens_per_second
        latency = sum(r.seconds for r in run.requests) / len(run.requests) if run.requests else None
        ttft = sum(r.time_to_first_token for r in run.requests) / len(run.requests) if run.requests else None
        acceptance = f"{t.acceptance_rate:.3f} {_ci(wilson(t.accepted, t.drafted), '.3f')}" if t.drafted else "–"
        lines.append(
            f"| {run.label} | {len(run.requests)} | {acceptance} | {_value(t.mean_accepted_length, '.2f')} | "
            f"{_value(t.system_efficiency, '.3f')} | {_value(tps.mean if tps.n else None, '.1f')} {_ci(tps.interval(), '.1f')} | "
            f"{_value(latency, '.3f')} | {_value(ttft, '.3f')} |"
        )
    drafts = c.drafts()
    width = max((len(run.totals().drafted_per_position) for run in drafts), default=0)
    if width:
        lines += ["", "Acceptance per proposal position (accepted / drafted at that position):", "",
                  "| draft | " + " | ".join(f"pos {i + 1}" for i in range(width)) + " |",
                  "|---|" + "---:|" * width]
        for run in drafts:
            rates = run.totals().acceptance_per_position()
            lines.append(f"| {run.label} | " + " | ".join(f"{r:.3f}" for r in rates + [0.0] * (width - len(rates))) + " |")
    lines += ["", "## Verdict", ""] + _verdict_lines(c)
    return "\n".join(lines) + "\n"


def _verdict_lines(c: Comparison) -> list[str]:
    drafts = c.drafts()
    lines = []
    if len(drafts) >= 2:
        reference = drafts[0]
        for other in drafts[1:]:
            lines.append(_pair_sentence(reference, other))
    baseline = c.baseline()
    if baseline is not None:
        base_tps = baseline.totals().tokens_per_second.mean
        for run in drafts:
            d = pairwise(baseline, run)
            tps = run.totals().tokens_per_second.mean
            lines.append(f"- {run.label} vs the target alone: {tps / base_tps:.2f}x tokens/s "
                         f"(paired difference {d['tokens_per_second_difference']:+.1f} tok/s, 95% CI "
                         f"{_ci(d['tokens_per_second_difference_ci95'], '+.1f')}).")
    return lines or ["- one draft only: nothing to compare against."]


def _pair_sentence(a: DraftRun, b: DraftRun) -> str:
    d = pairwise(a, b)
    parts = []
    acc, acc_ci = d["acceptance_difference"], d["acceptance_difference_ci95"]
    if acc_ci is not None:
        sure = _direction(acc_ci, b.label, a.label, "accepts more")
        parts.append(f"acceptance {acc:+.3f} (95% CI {_ci(acc_ci, '+.3f')}): {sure}")
    tps, tps_ci = d["tokens_per_second_difference"], d["tokens_per_second_difference_ci95"]
    sure = _direction(tps_ci, b.label, a.label, "is faster") if tps_ci else "too few prompts to tell"
    parts.append(f"tokens/s {tps:+.1f} per prompt (paired, 95% CI {_ci(tps_ci, '+.1f')}): {sure}")
    return f"- **{b.label} vs {a.label}**: " + "; ".join(parts) + "."


def _direction(interval, b: str, a: str, verb: str) -> str:
    low, high = interval
    if low > 0:
        return f"{b} {verb} (the interval excludes 0)"
    if high < 0:
        return f"{a} {verb} (the interval excludes 0)"
    return "no significant difference (the interval contains 0)"


def render_plot(c: Comparison, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    drafts = c.drafts()
    width = 0.8 / max(len(drafts), 1)
    for j, run in enumerate(drafts):
        t = run.totals()
        rates = t.acceptance_per_position()
        intervals = [wilson(a, d) or (0.0, 0.0) for a, d in zip(t.accepted_per_position, t.drafted_per_position)]
        xs = [i + 1 + (j - (len(drafts) - 1) / 2) * width for i in range(len(rates))]
        errors = [[max(r - lo, 0.0) for r, (lo, _) in zip(rates, intervals)], [max(hi - r, 0.0) for r, (_, hi) in zip(rates, intervals)]]
        left.bar(xs, rates, width=width, yerr=errors, capsize=3, label=run.label)
    positions = max((len(run.totals().drafted_per_position) for run in drafts), default=0)
    left.set_xticks(range(1, positions + 1))
    left.set_xlabel("proposal position")
    left.set_ylabel("acceptance rate")
    left.set_ylim(0, 1.05)
    left.set_title("Acceptance per position (95% Wilson CI)")
    if drafts:
        left.legend()
    right.boxplot([[r.seconds for r in run.requests] for run in c.runs], showmeans=True)
    right.set_xticks(range(1, len(c.runs) + 1), [run.label for run in c.runs])
    right.set_ylabel("seconds per request")
    right.set_title(f"Latency per request ({c.max_tokens} tokens max)")
    status = "identical" if c.identical_outputs else "DIFFERENT"
    fig.suptitle(f"Draft canary comparison, target {Path(c.target).name}: outputs {status} across runs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
