"""Whether a round overlaps the draft with the target: while the target verifies round r, the draft already proposes
round r+1 from the optimistic continuation (every proposal of round r accepted, plus a guess of the bonus token).

A sequence whose proposals made ahead did not come true (or that has none yet) does not wait for the draft: it
*catches up*, decoding one token alone this round while its draft runs the committed tokens in, guesses that token
and proposes the next round beyond it (coordinator.py); a seeded sampled sequence, whose tokens depend on how its
rounds are cut, proposes first instead, as in a serial round. At batch B with k proposals per sequence, let
  t_p  = the draft's call for k proposals (a normal round), t_v = the target's verification of k proposals,
  t_a  = the draft's call ahead: k+1 proposals after a hit (k and the bonus guess), k+2 catching up,
  g    = the measured rate at which the draft guesses a token (a bonus, or one decoded alone),
  h    = a^k * g, the chance a sequence's proposals made ahead come true (a its acceptance rate),
  E    = (1 - a^(k+1)) / (1 - a), the tokens a round with k proposals yields.
Serial rounds: every sequence yields E per round of t_p + t_v. Overlapped: a sequence that catches up spends a share
s = g / (g + 1 - h) of its rounds verifying proposals (it leaves catching up with chance g, falls back with 1 - h),
so yields s * E + (1 - s) per round; a seeded one yields E. A round costs (1 - H) * t_p(k+1)/k + max(t_v, t_a), H
the chance every seeded sequence's proposals came true (1 with none: nothing waits for the draft). The choice
compares tokens per second. `max(t_v, t_a)` assumes the two workers really run at once; where they share a device
(one GPU, or CPU cores) the concurrent phase costs nearer t_v + t_a and overlapping loses. So `auto` measures that
phase (least of the last few, like every cost here) and uses it in place of the max; it overlaps only when that wins
by a margin, and never for in-process workers (their calls run one after the other on the event loop). Every
`refresh_interval` rounds it tries the other choice once, so the costs it compares stay fresh.
"""

from collections import deque
from dataclasses import dataclass, field

from specsplit.services.coordinator.speculation_policy import COST_SAMPLES, bucket_of

OVERLAP_MODES = ("auto", "on", "off")
MARGIN = 0.03           # overlap must be predicted at least this much faster
GUESS_PRIOR_WEIGHT = 4.0


def serial_round_time(t_propose: float, t_verify: float) -> float:
    """A round without overlap."""
    return t_propose + t_verify


def overlapped_round_time(t_ahead: float, t_verify: float, all_hit: float, phase: float | None = None,
                          t_first: float | None = None) -> float:
    """A round with overlap: the draft call that must come first unless every seeded sequence's proposals were made
    ahead (`all_hit`; `t_first` its cost, t_ahead if not given), then the concurrent phase (`phase` as measured,
    else the ideal max(t_v, t_a))."""
    concurrent = max(t_verify, t_ahead) if phase is None else phase
    return (1.0 - all_hit) * (t_ahead if t_first is None else t_first) + concurrent


def hit_rate(alpha: float, k: int, guess_rate: float) -> float:
    """h: one sequence's proposals made ahead come true."""
    return alpha ** k * guess_rate


def expected_tokens(alpha: float, k: int) -> float:
    """E: tokens a round with k proposals yields (the accepted ones and the target's own)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def overlapped_tokens(alpha: float, k: int, guess_rate: float, may_catch_up: bool = True) -> float:
    """Tokens per overlapped round of one sequence: E for one that proposes first when it missed, s * E + (1 - s)
    for one that catches up (s: the share of its rounds that verify proposals made ahead)."""
    if not may_catch_up:
        return expected_tokens(alpha, k)
    share = guess_rate / (guess_rate + 1.0 - hit_rate(alpha, k, guess_rate)) if guess_rate > 0 else 0.0
    return share * expected_tokens(alpha, k) + (1.0 - share)


def overlap_speedup_bound(alpha: float, k: int, guess_rate: float, batch: int, t_propose: float, t_ahead: float,
                          t_verify: float, may_catch_up: bool = True) -> float:
    """Overlapped over serial tokens per second for a batch of `batch` sequences of the same acceptance rate, with
    ideal concurrency (what benchmarks print per row); `t_ahead` the k+1-proposal call (k+2 costs one step more)."""
    serial = batch * expected_tokens(alpha, k) / serial_round_time(t_propose, t_verify)
    all_hit = 1.0 if may_catch_up else hit_rate(alpha, k, guess_rate) ** batch
    concurrent_ahead = t_ahead * (k + 2) / (k + 1) if may_catch_up else t_ahead
    time_on = overlapped_round_time(concurrent_ahead, t_verify, all_hit, t_first=t_ahead)
    return batch * overlapped_tokens(alpha, k, guess_rate, may_catch_up) / time_on / serial


@dataclass
class OverlapCosts:
    phase: dict[int, deque] = field(default_factory=dict)   # k -> concurrent verify + propose-ahead seconds
    ahead: dict[int, deque] = field(default_factory=dict)   # k -> propose-ahead call seconds (k+1 proposals)
    rounds: int = 0
    last_flip: int = 0


class OverlapPolicy:
    def __init__(self, mode: str = "auto", refresh_interval: int = 256):
        if mode not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAP_MODES)}, not {mode!r}")
        self.mode = mode
        self.refresh_interval = refresh_interval
        self.guess_tests = 0.0
        self.guess_hits = 0.0
        self.buckets: dict[int, OverlapCosts] = {}
        self.last_estimate: dict | None = None  # the latest auto decision's numbers (metrics, benchmarks)

    # ---- what the coordinator reports --------------------------------------------------------------------------

    def record_guess(self, matched: bool) -> None:
        """A round whose proposals were all accepted: whether the bonus guess was the target's bonus token."""
        self.guess_tests += 1
        self.guess_hits += bool(matched)

    def record_phase(self, batch: int, k: int, phase_seconds: float, ahead_seconds: float) -> None:
        costs = self.buckets.setdefault(bucket_of(batch), OverlapCosts())
        costs.phase.setdefault(k, deque(maxlen=COST_SAMPLES)).append(phase_seconds)
        costs.ahead.setdefault(k, deque(maxlen=COST_SAMPLES)).append(ahead_seconds)

    def guess_rate(self, prior: float) -> float:
        return (self.guess_hits + GUESS_PRIOR_WEIGHT * prior) / (self.guess_tests + GUESS_PRIOR_WEIGHT)

    # ---- the choice ---------------------------------------------------------------------------------------------

    def decide(self, batch: int, k: int, rates: list[float], t_propose: float | None, t_verify: float | None,
               concurrent: bool, may_catch_up: list[bool] | None = None) -> bool:
        """Overlap this round? `rates`: the speculating sequences' acceptance; `may_catch_up`: for each, whether it
        may decode alone while its draft catches up (default all); t_propose / t_verify: the measured serial costs at
        this batch bucket and k (None until measured); `concurrent`: the workers are separate processes that can
        compute at the same time."""
        if self.mode == "off" or k <= 0 or not rates:
            return False
        if self.mode == "on":
            return True
        if not concurrent or t_propose is None or t_verify is None:
            return False  # in-process workers never overlap; remote ones first measure the serial round
        may_catch_up = may_catch_up if may_catch_up is not None else [True] * len(rates)
        costs = self.buckets.setdefault(bucket_of(batch), OverlapCosts())
        costs.rounds += 1
        guess = self.guess_rate(sum(rates) / len(rates))
        seeded_hit, tokens_on, tokens_off = 1.0, 0.0, 0.0
        for rate, catches_up in zip(rates, may_catch_up):
            tokens_off += expected_tokens(rate, k)
            tokens_on += overlapped_tokens(rate, k, guess, catches_up)
            if not catches_up:
                seeded_hit *= hit_rate(rate, k, guess)
        # Seconds per token. The bound: ideal concurrency, and k+1 (k+2 catching up) proposals cost that many of k.
        serial = serial_round_time(t_propose, t_verify) / tokens_off
        ahead_steps = k + (2 if any(may_catch_up) else 1)
        bound = overlapped_round_time(t_propose * ahead_steps / k, t_verify, seeded_hit,
                                      t_first=t_propose * (k + 1) / k) / tokens_on
        phase, ahead = costs.phase.get(k), costs.ahead.get(k)
        measured = (overlapped_round_time(min(ahead), t_verify, seeded_hit, min(phase)) / tokens_on
                    if phase else None)
        self.last_estimate = dict(batch=batch, k=k, serial=serial, bound=bound, measured=measured,
                                  all_hit=seeded_hit, guess_rate=guess, tokens_on=tokens_on, tokens_off=tokens_off)
        if bound >= serial * (1.0 - MARGIN):
            return False  # not even the ideal overlap pays
        # Measured: the concurrent phase as it really runs (about t_v + t_a where the workers share a device).
        choice = True if measured is None else measured < serial * (1.0 - MARGIN)
        if costs.rounds - costs.last_flip >= self.refresh_interval:
            costs.last_flip = costs.rounds
            return not choice  # one round the other way keeps the losing side's costs fresh
        return choice
