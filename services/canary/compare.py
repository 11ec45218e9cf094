"""`specsplit canary compare`: the same prompts, greedy, through the target with each draft (in-process), one
request at a time so latencies are clean; then which draft is better and how sure we are.

The target decides every token, so outputs must be identical whichever draft serves: the run checks it
token-for-token (and against the target alone unless --no-baseline); a draft can only change speed.
"""

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from specsplit.services.coordinator.generation import SpeculationStats
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.telemetry.canary_stats import VariantTotals
from specsplit.services.telemetry.confidence_intervals import newcombe_difference, paired_t_difference, wilson

BASELINE = "target only"


@dataclass
class RequestRun:
    prompt_index: int
    token_ids: list[int]
    seconds: float
    time_to_first_token: float
    stats: SpeculationStats

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class DraftRun:
    label: str
    model: str | None              # None = the target alone
    requests: list[RequestRun] = field(default_factory=list)

    def totals(self) -> VariantTotals:
        totals = VariantTotals()
        for r in self.requests:
            # Speculative rounds: every one of them drafted position 0.
            totals.rounds += r.stats.drafted_per_position[0] if r.stats.drafted_per_position else 0
            totals.drafted += r.stats.draft_tokens
            totals.accepted += r.stats.accepted_tokens
            for i, (d, a) in enumerate(zip(r.stats.drafted_per_position, r.stats.accepted_per_position)):
                while len(totals.drafted_per_position) <= i:
                    totals.drafted_per_position.append(0)
                    totals.accepted_per_position.append(0)
                totals.drafted_per_position[i] += d
                totals.accepted_per_position[i] += a
            totals.add_request("length" if r.token_ids else "stop", len(r.token_ids), r.seconds)
        return totals


@dataclass
class Comparison:
    target: str
    prompts: list[str]
    max_tokens: int
    num_speculative_tokens: int
    runs: list[DraftRun]

    @property
    def identical_outputs(self) -> bool:
        first = self.runs[0]
        return all(
            [r.token_ids for r in run.requests] == [r.token_ids for r in first.requests] for run in self.runs[1:]
        )

    def mismatched_prompts(self) -> list[int]:
        first = [r.token_ids for r in self.runs[0].requests]
        return sorted({i for run in self.runs[1:] for i, r in enumerate(run.requests) if r.token_ids != first[i]})

    def drafts(self) -> list[DraftRun]:
        return [run for run in self.runs if run.model is not None]

    def baseline(self) -> DraftRun | None:
        return next((run for run in self.runs if run.model is None), None)

    def to_json(self) -> dict:
        out = {"target": self.target, "max_tokens": self.max_tokens, "num_speculative_tokens": self.num_speculative_tokens,
               "identical_outputs": self.identical_outputs, "runs": []}
        for run in self.runs:
            totals = run.totals()
            ci = wilson(totals.accepted, totals.drafted)
            tps = totals.tokens_per_second
            out["runs"].append({
                "label": run.label, "model": run.model, "requests": len(run.requests),
                "drafted_tokens": totals.drafted, "accepted_tokens": totals.accepted,
                "acceptance_rate": totals.acceptance_rate, "acceptance_rate_ci95": list(ci) if ci else None,
                "acceptance_per_position": totals.acceptance_per_position(),
                "mean_accepted_length": totals.mean_accepted_length, "system_efficiency": totals.system_efficiency,
                "tokens_per_second": tps.mean if tps.n else None,
                "tokens_per_second_ci95": list(tps.interval()) if tps.interval() else None,
                "latency_seconds": [r.seconds for r in run.requests],
                "time_to_first_token_seconds": [r.time_to_first_token for r in run.requests],
            })
        return out


def pairwise(a: DraftRun, b: DraftRun) -> dict:
    """b against a: acceptance difference (Newcombe) and paired per-prompt tokens/s difference (t)."""
    ta, tb = a.totals(), b.totals()
    acceptance = newcombe_difference(ta.accepted, ta.drafted, tb.accepted, tb.drafted)
    speed, speed_ci = paired_t_difference([r.tokens_per_second for r in a.requests], [r.tokens_per_second for r in b.requests])
    return {
        "acceptance_difference": (tb.acceptance_rate or 0.0) - (ta.acceptance_rate or 0.0) if acceptance else None,
        "acceptance_difference_ci95": acceptance,
        "tokens_per_second_difference": speed,
        "tokens_per_second_difference_ci95": speed_ci,
    }


def read_prompts(path: str) -> list[str]:
    """One prompt per line, or a .jsonl file with a "prompt" field per line (blank lines skipped)."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.endswith(".jsonl"):
        return [json.loads(line)["prompt"] for line in lines]
    return [line.replace("\\n", "\n") for line in lines]


def draft_labels(drafts: list[str]) -> list[str]:
    """Short names for the report: the model's last path component, made unique."""
    labels = []
    for draft in drafts:
        label = Path(draft.rstrip("/")).name or draft
        while label in labels:
            label += "'"
        labels.append(label)
    return labels


def run_comparison(target: str, drafts: list[str], prompts: list[str], max_tokens: int = 64,
                   num_speculative_tokens: int = 4, baseline: bool = True, dtype: str = "float32",
                   device: str = "cpu", chat: bool = False, ignore_eos: bool = False, num_kv_blocks: int | None = None,
                   block_size: int = 16, prefix_caching: bool = True) -> Comparison:
    from specsplit.services.models.loader import load_model

    target_model = load_model(target, dtype, device)
    plan = [(label, draft) for label, draft in zip(draft_labels(drafts), drafts)]
    if baseline:
        plan.append((BASELINE, None))
    runs = []
    for label, draft in plan:
        draft_model = load_model(draft, dtype, device) if draft is not None else None
        engine_options = dict(dtype=dtype, device=device, num_kv_blocks=num_kv_blocks, block_size=block_size,
                              prefix_caching=prefix_caching)
        runs.append(asyncio.run(_run_one(
            label, draft, target_model, draft_model, prompts, max_tokens, num_speculative_tokens, chat, ignore_eos, engine_options
        )))
    return Comparison(target, prompts, max_tokens, num_speculative_tokens, runs)


async def _run_one(label, draft, target_model, draft_model, prompts, max_tokens, k, chat, ignore_eos, engine_options) -> DraftRun:
    from specsplit.services.local_engine import LocalEngine

    # Every round proposes k: comparing drafts means measuring each one's acceptance at every position.
    engine = LocalEngine(target_model, draft_model, num_speculative_tokens=k if draft_model else 0,
                         speculation="fixed", **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    run = DraftRun(label, draft)
    try:
        await engine.generate(prompts[0], params, chat)  # warm-up: first calls pay one-time costs
        await engine.coordinator.wait_idle()
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            result = await engine.generate(prompt, params, chat)
            seconds = time.perf_counter() - start
            await engine.coordinator.wait_idle()
            run.requests.append(RequestRun(i, result.token_ids, seconds, result.time_to_first_token, result.stats))
    finally:
        await engine.close()
    return run
