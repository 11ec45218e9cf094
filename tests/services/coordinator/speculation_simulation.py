"""A deterministic stand-in for a deployment, for testing the speculation policy against a brute-force sweep of fixed
k on the same workload: cost models of the worker calls measured on real hardware, and acceptance by a coin of fixed
bias per position (as the synthetic-acceptance benchmark mode draws it).

The loop follows the coordinator's (services/coordinator/coordinator.py): sequences get their draft KV beside the
target's prefill when the policy says speculation is likely; later, when it becomes likely or a probe is due and no
sequence has a draft to probe with (then one), paying a draft prefill in that round, whose costs then go unmeasured.
Each sequence's cap is its tokens left; the policy picks k from the attached sequences' rates; the round costs
propose(B, k) + verify(B, k), with seeded interference that only ever adds time; verdicts update the acceptance
records; clean rounds of one k report their costs.
"""

import random
from dataclasses import dataclass
from typing import Callable

from specsplit.services.coordinator.speculation_policy import Acceptance, SpeculationPolicy

MS = 1e-3


@dataclass
class CostModel:
    name: str
    verify: Callable[[int, int], float]     # (batch, k) -> seconds of the target's call (k = 0: plain decoding)
    propose: Callable[[int, int], float]    # (batch, k) -> seconds of the draft's call of k steps
    draft_prefill: Callable[[int], float]   # sequences attached at once -> seconds
    interference: float = 0.05              # a round's cost is multiplied by 1 + this x |gaussian|


def _h100_verify(batch: int, k: int) -> float:
    """7B target on an H100 (bench/results/gpu_steps_h100.json: decode 6.45 ms at batch 1, 7.2 at 64; a k = 4
    verification 6.4 / 6.6 / 7.8 / 10.3 ms at batch 1 / 8 / 32 / 64), plus the coordinator's host work."""
    rows = batch * (k + 1)
    return 6.4 * MS + 0.0125 * MS * batch + 0.0134 * MS * max(0, rows - 48) + 0.3 * MS


def _h100_propose(batch: int, k: int) -> float:
    """0.5B draft call on an H100: ~1.1 ms a step at batch 1, 1.26 at 64, 0.25 ms per call, host work."""
    return 0.25 * MS + k * (1.1 * MS + 0.0025 * MS * batch) + 0.2 * MS


# The real 1.5B target in float32 on a 2-core Xeon (bench/results/cpu_weight_formats_matrix.json, scaled to its
# ~285 ms decode): one row dense, more rows packed (the layout for the row mix), a matmul's cost by its rows.
_CPU_ROWS = {1: 1.0, 2: 1.23, 5: 1.52, 7: 1.69, 16: 2.16, 64: 5.18}


def _cpu_rows_cost(rows: int) -> float:
    points = sorted(_CPU_ROWS)
    if rows >= points[-1]:
        return _CPU_ROWS[points[-1]] * rows / points[-1]
    hi = min(p for p in points if p >= rows)
    lo = max(p for p in points if p <= rows)
    return _CPU_ROWS[lo] if hi == lo else _CPU_ROWS[lo] + (_CPU_ROWS[hi] - _CPU_ROWS[lo]) * (rows - lo) / (hi - lo)


GPU_7B = CostModel("h100 7b/0.5b", _h100_verify, _h100_propose, lambda n: 2 * MS + 0.05 * MS * n)
CPU_REAL_PAIR = CostModel(
    "xeon 1.5b/0.5b",
    lambda b, k: 285 * MS * _cpu_rows_cost(b * (k + 1)),
    lambda b, k: k * 41 * MS * _cpu_rows_cost(b) + 2 * MS,
    lambda n: 600 * MS * n,
)
CPU_TINY = CostModel(
    "tiny models on a cpu",
    lambda b, k: 1.8 * MS + 0.02 * MS * b * (k + 1),
    lambda b, k: 0.3 * MS + k * (1.0 * MS + 0.01 * MS * b),
    lambda n: 1.5 * MS + 0.1 * MS * n,
)


@dataclass
class Sequence:
    left: int
    position: int
    coins: list[float]  # per position: a proposal there is accepted when its coin is below alpha
    acceptance: Acceptance
    attached: bool = False


def simulate(policy: SpeculationPolicy, model: CostModel, alpha: float, batch: int, tokens: int, waves: int,
             seed: int = 0, variant: str = "draft") -> dict:
    """`waves` of `batch` requests of `tokens` new tokens each, all of a wave decoding together. Returns the
    seconds, tokens, rounds per k and draft prefills of all waves."""
    noise = random.Random(seed)
    drafting = policy.max_k > 0
    seconds, produced, prefills = 0.0, 0, 0
    rounds_per_k: dict[int, int] = {}
    for wave in range(waves):
        sequences = []
        for i in range(batch):
            coins = random.Random(seed * 1_000_003 + wave * 1009 + i)
            sequences.append(Sequence(tokens - 1, 0, [coins.random() for _ in range(tokens + policy.max_k + 1)],
                                      Acceptance()))  # the first token comes from the target's prefill
        produced += batch
        first = True
        while True:
            live = [s for s in sequences if s.left > 0]
            if not live:
                break
            n = len(live)
            attach = [s for s in live if drafting and not s.attached and policy.worth_drafting(variant, n)]
            if drafting and not attach and not any(s.attached for s in live) and policy.probe_due(n):
                attach = [next(s for s in live if not s.attached)]
            for s in attach:
                s.attached = True
            if attach:
                seconds += model.draft_prefill(len(attach))
                prefills += len(attach)
            if first:  # the wave's prefills: drafts attached beside the target's prefill, before the first round
                first, attach = False, []
            attached = {id(s) for s in live if s.attached and s not in attach}
            limits = {id(s): min(policy.max_k, s.left - 1) if id(s) in attached else 0 for s in live}
            rates = [policy.rate(s.acceptance, variant) if limits[id(s)] > 0 else 0.0 for s in live]
            evidence = [s.acceptance.evidence if limits[id(s)] > 0 else 0.0 for s in live]
            k, probe = policy.choose_round(rates, n, max(limits.values()), evidence)
            ks = {id(s): min(k, limits[id(s)]) for s in live}
            proposing = any(ks.values())
            propose = model.propose(n, k) if proposing else 0.0
            verify = model.verify(n, k if proposing else 0)
            slow = 1.0 + model.interference * abs(noise.gauss(0.0, 1.0))
            seconds += (propose + verify) * slow
            rounds_per_k[k] = rounds_per_k.get(k, 0) + 1
            for s in live:
                proposed = ks[id(s)]
                accepted = 0
                while accepted < proposed and s.coins[s.position + accepted] < alpha:
                    accepted += 1
                if proposed:
                    policy.record_acceptance(s.acceptance, variant, proposed, accepted, probe)
                emitted = min(accepted + 1, s.left)
                s.left -= emitted
                s.position += emitted
                produced += emitted
            if not attach and all(v in (0, k) for v in ks.values()):
                policy.record_costs(n, k if proposing else 0, propose * slow, verify * slow)
    return {"seconds": seconds, "tokens": produced, "tokens_per_s": produced / seconds,
            "rounds_per_k": dict(sorted(rounds_per_k.items())), "draft_prefills": prefills}


def sweep(model: CostModel, alpha: float, batch: int, tokens: int, waves: int, max_k: int = 8,
          warm_up_waves: int = 1, seed: int = 0) -> dict:
    """Target-only, fixed k = 1..max_k and the adaptive policy on the same workload (the same coins per sequence and
    wave), each after `warm_up_waves` untimed waves of its own (as a benchmark warms up)."""
    def run(policy):
        if warm_up_waves:
            simulate(policy, model, alpha, batch, tokens, warm_up_waves, seed=seed + 1)
        return simulate(policy, model, alpha, batch, tokens, waves, seed=seed)

    out = {"target_only": run(SpeculationPolicy(0, fixed=True))}
    for k in range(1, max_k + 1):
        out[k] = run(SpeculationPolicy(k, fixed=True))
    out["adaptive"] = run(SpeculationPolicy(max_k))
    return out
