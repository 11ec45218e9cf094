"""The coordinator's record of one request in flight: the committed tokens and what each worker holds of them.

Invariants after every round:
- `committed` = prompt + every emitted token; the coordinator alone holds it, so any worker can be rebuilt.
- the target's KV holds `target_cached` = len(committed) - 1 tokens (all but the newest, which the next verify
  sends as its delta);
- the draft's KV holds `draft_cached` committed tokens; the delta it is sent next is `committed[draft_cached:]`:
  one token normally, two for a *bonus-token sequence* (every proposal accepted, so the last proposal's KV was
  never computed by the draft), more after rounds without the draft.
"""

import asyncio
import time
from dataclasses import dataclass, field

from specsplit.services.coordinator.generation import GenerationRequest, SpeculationStats
from specsplit.services.coordinator.speculation_policy import Acceptance
from specsplit.services.coordinator.stop_checker import StopChecker
from specsplit.services.runtime.worker_sequences import WorkerSampling


@dataclass(eq=False)
class SequenceState:
    request: GenerationRequest
    handle: str
    sampling: WorkerSampling
    stop: StopChecker
    draft_variant: str
    acceptance_method: str = "rejection"  # as the target settled it at prefill ("typical" is NOT lossless)
    committed: list[int] = field(default_factory=list)
    target: object | None = None          # the pinned target replica (a TargetClient)
    draft: object | None = None           # the pinned draft replica (a DraftClient), None = target-only
    target_cached: int = 0
    draft_cached: int = 0
    prefilled: bool = False               # the target holds this sequence's KV
    draft_prefilled: bool = False         # the draft holds it
    draft_disabled: bool = False          # the draft cannot serve this sequence (e.g. too long for it): target-only
    target_lost_since: float | None = None
    preemptions: int = 0
    bonus: bool = False
    pre_proposal: object | None = None    # overlapped rounds: the next round's proposals, drawn ahead (pre_proposals.py)
    finished: bool = False
    finish_reason: str | None = None
    error: Exception | None = None
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    acceptance: Acceptance = field(default_factory=Acceptance)  # what the speculation policy estimates from
    logprobs: list = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    trace_span: object | None = None      # the request's span while it runs (None when tracing is off)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def generated(self) -> list[int]:
        return self.committed[self.prompt_len :]
