"""Whether a round overlaps the draft with the target: while the target verifies round r, the draft already proposes
round r+1 from the optimistic continuation (every proposal of round r accepted, plus a guess of the bonus token).

The bound. At batch B with k proposals per sequence, let
  t_p  = the draft's call for k proposals (a normal round),
  t_a  = the draft's call for k+1 proposals (k and the bonus guess; what an overlapped round asks for),
  t_v  = the target's verification of k proposals,
  h    = the chance one sequence's pre-proposal is used = a^k * g (all k accepted, a its acceptance rate, and the
         guessed bonus right, g the measured guess rate),
  H    = prod over the batch of h (every sequence's pre-proposal used, so no draft call precedes the verification).
Without overlap a round costs   T_off = t_p + t_v.
With overlap a round costs      T_on  = (1 - H) * t_a + max(t_v, t_a):
the sequences whose pre-proposal missed propose first (at most a full draft call), then the target verifies while
the draft proposes ahead. Both yield the same tokens per round (the same k, the same verdicts), so T_off / T_on is
the speedup bound of overlapping. `max(t_v, t_a)` assumes the two workers really run at once; where they share a
device (one GPU, or CPU cores) the concurrent phase costs nearer t_v + t_a and overlapping loses. So `auto` measures
that phase (least of the last few, like every cost here) and compares T_on with the measured phase in place of the
max against T_off; it overlaps only when that wins by a margin, and never for in-process workers (their calls run
one after the other on the event loop). Every `refresh_interval` rounds it tries the other choice once, so the
costs it compares stay fresh.
"""

from collections import deque
from dataclasses import dataclass, field

from specsplit.services.coordinator.speculation_policy import COST_SAMPLES, bucket_of

OVERLAP_MODES = ("auto", "on", "off")
MARGIN = 0.03           # overlap must be predicted at least this much faster
GUESS_PRIOR_WEIGHT = 4.0


def serial_round_time(t_propose: float, t_verify: float) -> float:
    """T_off: a round without overlap."""
    return t_propose + t_verify


def overlapped_round_time(t_ahead: float, t_verify: float, all_hit: float, phase: float | None = None) -> float:
    """T_on: a round with overlap; `phase` = the measured concurrent phase (None: the ideal max(t_v, t_a))."""
    concurrent = max(t_verify, t_ahead) if phase is None else phase
    return (1.0 - all_hit) * t_ahead + concurrent


def hit_rate(alpha: float, k: int, guess_rate: float) -> float:
    """h: one sequence's pre-proposal is used."""
    return alpha ** k * guess_rate


def overlap_speedup_bound(alpha: float, k: int, guess_rate: float, batch: int, t_propose: float, t_ahead: float,
                          t_verify: float) -> float:
    """T_off / T_on for a batch of `batch` sequences of the same acceptance rate (what benchmarks print per row)."""
    all_hit = hit_rate(alpha, k, guess_rate) ** batch
    return serial_round_time(t_propose, t_verify) / overlapped_round_time(t_ahead, t_verify, all_hit)


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
               concurrent: bool) -> bool:
        """Overlap this round? `rates`: the speculating sequences' acceptance; t_propose / t_verify: the measured
        serial costs at this batch bucket and k (None until measured); `concurrent`: the workers are separate
        processes that can compute at the same time."""
        if self.mode == "off" or k <= 0 or not rates:
            return False
        if self.mode == "on":
            return True
        if not concurrent or t_propose is None or t_verify is None:
            return False  # in-process workers never overlap; remote ones first measure the serial round
        costs = self.buckets.setdefault(bucket_of(batch), OverlapCosts())
        costs.rounds += 1
        prior = sum(rates) / len(rates)
        guess = self.guess_rate(prior)
        all_hit = 1.0
        for rate in rates:
            all_hit *= hit_rate(rate, k, guess)
        serial = serial_round_time(t_propose, t_verify)
        # The bound: ideal concurrency, and k+1 proposals cost (k+1)/k of k.
        bound = overlapped_round_time(t_propose * (k + 1) / k, t_verify, all_hit)
        phase, ahead = costs.phase.get(k), costs.ahead.get(k)
        measured = overlapped_round_time(min(ahead), t_verify, all_hit, min(phase)) if phase else None
        self.last_estimate = dict(batch=batch, k=k, serial=serial, bound=bound, measured=measured, all_hit=all_hit,
                                  guess_rate=guess)
        if bound >= serial * (1.0 - MARGIN):
            return False  # not even the ideal overlap pays
        # Measured: the concurrent phase as it really runs (about t_v + t_a where the workers share a device).
        choice = True if measured is None else measured < serial * (1.0 - MARGIN)
        if costs.rounds - costs.last_flip >= self.refresh_interval:
            costs.last_flip = costs.rounds
            return not choice  # one round the other way keeps the losing side's costs fresh
        return choice
