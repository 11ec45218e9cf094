"""The coordinator: admits requests and drives speculative rounds over draft and target replicas.

One loop, `schedule -> prefill newcomers + one round for the decoding batch -> commit -> release finished`. A round
sends one Propose per draft replica carrying all its sequences, then one Verify per target replica, so batching
happens at both ends (workers also merge calls from several coordinators). The same loop serves the in-process
engine (local clients) and the gRPC coordinator service (remote clients).
"""

import asyncio
import logging
import random
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from specsplit.services.coordinator.admission import apply_model_limits, check_encodable, new_handle, new_request_id
from specsplit.services.coordinator.call_deadlines import DeadlineSettings
from specsplit.services.coordinator.generation import GenerationRequest, GenerationResult, TokenEvent
from specsplit.services.coordinator.overlap_policy import OverlapPolicy
from specsplit.services.coordinator.pre_proposals import PreProposal, split_guess
from specsplit.services.coordinator.replica_health import ReplicaHealth
from specsplit.services.coordinator.replica_pools import ReplicaPool, pick_variant
from specsplit.services.coordinator.sequence_state import SequenceState
from specsplit.services.coordinator.speculation_policy import SpeculationPolicy, bucket_of
from specsplit.services.coordinator.stop_checker import StopChecker
from specsplit.services.draft.proposer import DraftPrefill, Proposal, ProposeItem
from specsplit.services.errors import InvalidArgument, KVCacheFull, ResourceExhausted, Unavailable, UnknownSequence
from specsplit.services.runtime.worker_sequences import WorkerSampling
from specsplit.services.target.synthetic_acceptance import synthetic_guess_right
from specsplit.services.target.verifier import TargetPrefill, VerifyItem
from specsplit.services.telemetry import round_timeline
from specsplit.services.telemetry.coordinator_telemetry import CoordinatorTelemetry

log = logging.getLogger(__name__)


SPECULATION_MODES = ("adaptive", "fixed")
RELEASE_AT_CLOSE_SECONDS = 2.0  # how long a closing coordinator waits for a replica marked down to free its sequences
CLOSE_ROUND_SECONDS = 5.0  # how long a closing coordinator lets the round in flight answer before releasing


# A burst's requests each come within this fraction of the arrival window of the last (CoordinatorConfig).
ARRIVAL_GAPS_PER_WINDOW = 8
# Times the gaps: a thread's sleep is precise where the loop's timers wake in whole milliseconds. Its own thread,
# so no other work queued on the loop's default executor delays a gap's end.
_ARRIVAL_TIMER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arrival-gap")


@dataclass
class CoordinatorConfig:
    num_speculative_tokens: int = 4         # adaptive: the most a round proposes; fixed: what every round proposes
    speculation: str = "adaptive"           # "adaptive": k per round from live acceptance and measured costs (0 =
                                            # plain decoding when speculating would be slower); "fixed": always k
    max_speculative_tokens: int = 16
    max_num_seqs: int = 256                 # sequences decoding at once
    max_waiting: int = 1024                 # admitted but not yet running; beyond it, RESOURCE_EXHAUSTED
    arrival_window_seconds: float = 0.0     # an idle coordinator's first prefill waits up to this long for the
                                            # requests arriving with the first (a burst prefilled in one step);
                                            # 0 = at once
    disable_speculation_batch_size: int = 0  # 0 = never; else speculation is off while this many decode
    replica_recovery_seconds: float = 30.0   # how long a sequence waits for a target replica before UNAVAILABLE
    probe_interval_seconds: float = 2.0      # how often replicas marked down are asked whether they are back
    logprobs_while_speculating: bool = True  # False: a speculating request may not ask for logprobs (README)
    overlap: str = "auto"                    # draft proposes round r+1 while the target verifies round r:
                                             # "auto" where measured costs say it pays (overlap_policy.py), "on", "off"
    call_deadlines: DeadlineSettings = field(default_factory=DeadlineSettings)  # when a slow replica counts as hung


class Coordinator:
    def __init__(self, targets: ReplicaPool, drafts: list[ReplicaPool], tokenizer, eos_token_ids, config=None, seed=None):
        self.targets = targets
        self.drafts = drafts
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.config = config or CoordinatorConfig()
        self.id = uuid.uuid4().hex[:12]
        self._rng = random.Random(seed)
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self._loop_task: asyncio.Task | None = None
        self._bound_loop = None
        self.observers = []  # callables(event, records) for metrics and canary statistics, called once per batch
        self.telemetry = CoordinatorTelemetry(self)  # request spans and worker-call timings
        if self.config.arrival_window_seconds < 0:
            raise ValueError(f"the arrival window must be >= 0 seconds, not {self.config.arrival_window_seconds}")
        if self.config.max_num_seqs < 1 or self.config.max_waiting < 0:  # no sequence could ever run
            raise ValueError(f"max_num_seqs must be >= 1 and max_waiting >= 0, not {self.config.max_num_seqs} and "
                             f"{self.config.max_waiting}")
        if self.config.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, not {self.config.speculation!r}")
        self.policy = SpeculationPolicy(self.config.max_speculative_tokens, fixed=self.config.speculation == "fixed")
        self.overlap = OverlapPolicy(self.config.overlap)
        self._releases: dict = {}  # worker client -> handles to release after this iteration
        self._releasing: set[asyncio.Future] = set()  # releases in flight, sent behind the next round
        self.health = ReplicaHealth(self.config.call_deadlines, self.config.probe_interval_seconds)
        self._round_alone = True
        self._waited = False  # whether this iteration of the loop has waited on another process (others ran meanwhile)

    # ---- public API -------------------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> SequenceState:
        params = request.params.validate(self.config.max_speculative_tokens)
        if params.logprobs is not None and not self.config.logprobs_while_speculating and self._may_speculate(params):
            raise InvalidArgument(
                "this deployment computes no logprobs while speculating (--no-logprobs-while-speculating): ask without "
                "logprobs, or turn speculation off for this request (num_speculative_tokens 0, SPECULATION_MODE_OFF) "
                "to get logprobs from the target alone"
            )
        if not request.prompt_token_ids:
            raise InvalidArgument("prompt must not be empty")
        max_len = self.max_model_len  # checked first: it is O(1), the vocabulary check reads every token
        if max_len and len(request.prompt_token_ids) >= max_len:
            raise InvalidArgument(f"prompt of {len(request.prompt_token_ids)} tokens exceeds the context of {max_len}")
        vocab = self.targets.replicas[0].vocab_size if self.targets.replicas else None
        if vocab is not None and any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise InvalidArgument(f"prompt token ids must be in [0, {vocab})")
        apply_model_limits(params, vocab)
        if len(self.waiting) >= self.config.max_waiting:
            raise ResourceExhausted(f"queue full ({self.config.max_waiting} requests waiting); retry later")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        handle = new_handle()
        sequence = SequenceState(
            request=request,
            handle=handle,
            sampling=WorkerSampling(params.temperature, params.top_k, params.top_p, seed, params.acceptance_method or "",
                                    params.posterior_threshold, params.posterior_alpha),
            stop=StopChecker(params, self.tokenizer, self.eos_token_ids, max_len or 1 << 62, len(request.prompt_token_ids)),
            draft_variant="",
            committed=list(request.prompt_token_ids),
        )
        check_encodable(sequence.sampling)
        if not request.request_id:
            request.request_id = new_request_id()
        log.debug("admitted %s (%d prompt tokens, max %s new)", handle, len(request.prompt_token_ids), params.max_tokens)
        self.telemetry.request_started(sequence)
        self.waiting.append(sequence)
        self._ensure_loop()
        self._idle.clear()
        self._wake.set()
        return sequence

    async def stream(self, request: GenerationRequest):
        """Yield TokenEvents as tokens commit, then the GenerationResult. Leaving early aborts the request."""
        sequence = self.submit(request)
        try:
            while True:
                event = await sequence.events.get()
                if isinstance(event, Exception):
                    raise event
                yield event
                if isinstance(event, GenerationResult):
                    return
        finally:
            if not sequence.finished:
                self.abort(sequence)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = None
        async for event in self.stream(request):
            result = event
        return result

    def abort(self, sequence: SequenceState) -> None:
        """Stop a request (client cancelled or deadline passed); its KV is released on every worker."""
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        if not sequence.finished:
            self._finish(sequence, "abort")
            if self._bound_loop is not None:
                self._wake.set()

    async def wait_idle(self) -> None:
        """Return once no request is queued or running and every finished one is released on its workers."""
        self._bind()
        await self._idle.wait()

    @property
    def max_model_len(self) -> int:
        lens = [r.max_model_len for r in self.targets.replicas]
        return min(lens) if lens else 0

    async def close(self) -> None:
        for sequence in list(self.running) + list(self.waiting):
            self.abort(sequence)
        await self._end_round_in_flight()
        for sequence in list(self.running) + list(self.waiting):  # any submitted while the round ended
            self.abort(sequence)
        await self._release_finished()
        await self._releases_sent()
        # Replicas marked down may only have been slow (a loaded host): before this coordinator goes, it tells each
        # of them, briefly, which of its sequences to free, rather than leave their KV to the workers' lease.
        calls = [self._release_now(client, handles) for client, handles in self.health.moved_away_handles().items()]
        if calls:
            await asyncio.gather(*calls)

    async def _end_round_in_flight(self) -> None:
        """Let the round in flight end, within a bound, then stop the loop. Its calls are on the wire already (a
        cancelled await does not withdraw a sent message): a release sent before their answers could reach a worker
        ahead of them, and a prefill run after its release would hold that KV until the worker's lease. The loop
        releases the aborted sequences once their calls have answered, then goes idle."""
        task = self._loop_task
        if task is None or task.done():
            return
        if self._bound_loop is asyncio.get_running_loop():
            try:
                async with asyncio.timeout(CLOSE_ROUND_SECONDS):
                    await self._idle.wait()
            except TimeoutError:
                log.warning("the round in flight did not end within %.1f s of close; releasing without it",
                            CLOSE_ROUND_SECONDS)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    async def _release_now(self, client, handles: list[str]) -> None:
        try:
            async with asyncio.timeout(RELEASE_AT_CLOSE_SECONDS):
                await client.release(handles)
        except Exception as error:  # gone for good: the lease frees them
            log.warning("release on %s at close failed: %s", client.name, error)

    # ---- the loop ---------------------------------------------------------------------------------------------

    def _bind(self) -> None:
        """Tie the loop's events to the running event loop (an engine may serve several `asyncio.run` calls)."""
        loop = asyncio.get_running_loop()
        if self._bound_loop is not loop:
            self._bound_loop = loop
            self._wake = asyncio.Event()
            self._idle = asyncio.Event()
            self._loop_task = None
            if not self.waiting and not self.running:
                self._idle.set()

    def _ensure_loop(self) -> None:
        self._bind()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            if not self.waiting and not self.running and self._releasing:
                await self._releases_sent()  # idle means every finished sequence is released on its workers
            if not self.waiting and not self.running:
                self._idle.set()
                self._wake.clear()
                await self.health.idle_until(self._wake, [self.targets, *self.drafts])
                self._idle.clear()
            if not self.running and self.waiting and self.config.arrival_window_seconds > 0:
                await self._gather_arrivals()
            self._admit()
            self.health.probe_down([self.targets, *self.drafts])
            live = [s for s in self.running if not s.finished]
            self._leave_down_replicas(live)
            needs_target = [s for s in live if not s.prefilled]
            needs_draft = self._drafts_to_attach(live)
            decoding = [s for s in live if s.prefilled]
            try:
                self._round_alone = not needs_target and not needs_draft  # its timing is the round's own cost
                phases = [phase(group) for phase, group in ((self._prefill_targets, needs_target),
                                                            (self._attach_drafts, needs_draft), (self._round, decoding))
                          if group]
                await _all(phases)
            except Exception:  # a bug in one round must not take every request down with the loop
                log.exception("round failed")
                for sequence in live:
                    self._fail(sequence, Unavailable("internal error in the coordinator round"))
            await self._release_finished()
            if not decoding and not any(s.prefilled for s in needs_target):
                await asyncio.sleep(0.005)  # waiting for KV room or for a replica to come back: do not spin
            elif not self._waited:
                # A round whose calls all ran in this process (the co-located target, no draft call) never let the
                # loop turn: the client streams, probes and APIs get their turn here.
                await asyncio.sleep(0)
            self._waited = False

    async def _gather_arrivals(self) -> None:
        """Before an idle coordinator's first prefill: wait while requests keep arriving (each within an eighth of
        the window of the last), up to the window in all, so that a burst whose requests reach this process a few
        hundred microseconds apart is prefilled in one step rather than one request first and the rest a
        prefill later (a prefill's time hardly depends on how many short prompts it holds). A lone request pays
        the eighth (0.5 ms of a 4 ms window). Each gap is timed by a thread's sleep, woken early by an arrival: the
        loop's own timers wake in whole milliseconds (epoll), which made a 0.5 ms gap cost a lone request about
        1.1 ms on a GPU host."""
        loop = asyncio.get_running_loop()
        window = self.config.arrival_window_seconds
        gap = window / ARRIVAL_GAPS_PER_WINDOW
        last = loop.time()
        deadline = last + window
        seen = len(self.waiting)
        timer = None
        while seen < self.config.max_num_seqs and (now := loop.time()) < deadline and now - last < gap:
            if timer is None or timer.done():  # one sleep at a time: an arrival does not start another
                timer = loop.run_in_executor(_ARRIVAL_TIMER, time.sleep, min(gap - (now - last), deadline - now))
            self._wake.clear()
            arrival = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait((arrival, timer), return_when=asyncio.FIRST_COMPLETED)
            arrival.cancel()
            if len(self.waiting) != seen:
                seen, last = len(self.waiting), loop.time()

    def _admit(self) -> None:
        room = self.config.max_num_seqs - len(self.running)
        while self.waiting and room > 0:
            self.running.append(self.waiting.popleft())
            room -= 1

    def _may_speculate(self, params) -> bool:
        return bool(self.drafts) and self.config.num_speculative_tokens > 0 and params.num_speculative_tokens != 0

    def _wants_draft(self, sequence: SequenceState) -> bool:
        return (
            bool(self.drafts)
            and not sequence.draft_disabled
            and sequence.request.params.num_speculative_tokens != 0
            and self.config.num_speculative_tokens > 0
        )

    def _drafts_to_attach(self, live: list[SequenceState]) -> list[SequenceState]:
        """Sequences whose draft KV is built now (beside the target's prefill for new ones): those the speculation
        policy expects to speculate at this batch size (a request that fixes its k always does), else, when a probe
        is due and no sequence has a draft to probe with, the one with the most tokens left to speculate with. A
        draft that never helps costs no prefills."""
        waiting = [s for s in live if not s.draft_prefilled and self._wants_draft(s)
                   and self._variant_pool(s) is not None]
        if not waiting:
            return []
        worth = {}  # per draft variant, not per sequence
        for s in waiting:
            if s.draft_variant not in worth:
                worth[s.draft_variant] = self.policy.worth_drafting(s.draft_variant, len(live))
        attach = [s for s in waiting if worth[s.draft_variant] or not _follows_policy(s.request.params)]
        if not attach and self.policy.probe_due(len(live)) and not any(
                s.draft_prefilled and _follows_policy(s.request.params) for s in live):
            attach = [max(waiting, key=lambda s: s.stop.max_tokens - (len(s.committed) - s.prompt_len))]
        return attach

    async def _prefill_targets(self, sequences: list[SequenceState]) -> None:
        """Prefill new, preempted and orphaned sequences on a target; the target samples their next token."""
        ready = []
        for sequence in sequences:
            if sequence.target is None:
                sequence.target = self.targets.pick()
            if sequence.target is not None:
                ready.append(sequence)
                continue
            # No live target: wait for one to come back, within a bound.
            now = time.monotonic()
            sequence.target_lost_since = sequence.target_lost_since or now
            if now - sequence.target_lost_since > self.config.replica_recovery_seconds:
                self._fail(sequence, Unavailable("no target replica is available"))
        calls = [
            self._call(client, "prefill", [TargetPrefill(s.handle, list(s.committed), s.sampling, s.request.params.logprobs) for s in group], group)
            for client, group in _group(ready, lambda s: s.target)
        ]
        prefilled, rounds = [], []
        round_timeline.mark("prefill.start")
        # A lone call is awaited in this task, so its message is on the wire before the round beside it (the next
        # task of the loop's phases) sends its own: a worker takes new requests' prefills before the round, as the
        # one process does, rather than make them wait a step.
        answered = await _all(calls)
        round_timeline.mark("prefill.answered")
        for group_results in answered:
            for sequence, verdict in group_results:
                if sequence.finished:
                    continue
                if isinstance(verdict, Exception):
                    self._on_target_error(sequence, verdict)
                    continue
                resumed = bool(sequence.generated)
                sequence.prefilled = True
                sequence.target_lost_since = None
                sequence.target_cached = verdict.num_cached
                sequence.acceptance_method = verdict.acceptance_method or sequence.acceptance_method
                self._commit(sequence, verdict, 0 if resumed else None, rounds if resumed else prefilled)
        self._notify("prefill", prefilled)
        self._notify("round", rounds)

    async def _attach_drafts(self, sequences: list[SequenceState]) -> None:
        """Give sequences a draft replica of their variant and run their committed tokens into its KV. Without a
        live replica a sequence decodes target-only until one returns."""
        ready = []
        for sequence in sequences:
            pool = self._variant_pool(sequence)
            if pool is None or sequence.finished:  # e.g. its target refused it at prefill, just before this
                continue
            if sequence.draft is None:
                sequence.draft = pool.pick()
            if sequence.draft is not None:
                ready.append(sequence)
        calls = [
            self._call(client, "prefill", [DraftPrefill(s.handle, _draft_prefix(s), s.sampling) for s in group], group)
            for client, group in _group(ready, lambda s: s.draft)
        ]
        for group_results in await asyncio.gather(*calls):
            for sequence, result in group_results:
                if sequence.finished:
                    continue
                if isinstance(result, Exception):
                    self._on_draft_error(sequence, result)
                else:
                    sequence.draft_prefilled = True
                    sequence.draft_cached = result
                    sequence.pre_proposal = None

    def _variant_pool(self, sequence: SequenceState) -> ReplicaPool | None:
        """The sequence's draft variant, chosen by weight on first need and kept for the request's life."""
        if not sequence.draft_variant:
            pool = pick_variant(self.drafts, self._rng)
            if pool is None:
                return None
            sequence.draft_variant = pool.name
        return next((p for p in self.drafts if p.name == sequence.draft_variant), None)

    async def _round(self, sequences: list[SequenceState]) -> None:
        if not sequences:
            return
        round_timeline.mark("round.start")
        batch = len(sequences)
        # k for the round: each sequence's cap (its request, its room, its draft), then, for the sequences that leave
        # it to the policy, its choice for the batch from their acceptance and the costs measured at this batch size.
        limits = {s: self._speculation_length(s, batch) for s in sequences}
        adaptive = {s: limits[s] > 0 and _follows_policy(s.request.params) for s in sequences}
        rate_of = {s: self.policy.rate(s.acceptance, s.draft_variant) for s in sequences if limits[s] > 0}
        k, probe = self.policy.choose_round(
            [rate_of[s] if adaptive[s] else 0.0 for s in sequences], batch,
            max((limits[s] for s in sequences if adaptive[s]), default=0),
            [s.acceptance.evidence if adaptive[s] else 0.0 for s in sequences])
        k_of = {s: min(k, limits[s]) if adaptive[s] else limits[s] for s in sequences}
        # Overlap (pre_proposals.py): proposals made ahead last round whose continuation came true need no draft call.
        proposals = self._take_pre_proposals(sequences, k_of)
        pre_proposed = bool(proposals)
        overlap = self._overlap_this_round(sequences, k_of, batch, rate_of)
        # An overlapped round never waits for the draft where it need not: a sequence without proposals made ahead
        # decodes alone this round while its draft catches up beside the verification (pre_proposals.py); one whose
        # output depends on how its rounds are cut (seeded sampling) proposes first, as in a serial round.
        catching_up = {s for s in sequences
                       if overlap and k_of[s] > 0 and s not in proposals and _rounds_may_be_cut(s.request.params)}
        proposing = [s for s in sequences if k_of[s] > 0 and s not in proposals and s not in catching_up]
        started = time.perf_counter()
        propose_calls = [
            self._call(client, "propose", [ProposeItem(s.handle, s.draft_cached, s.committed[s.draft_cached :],
                                                       k_of[s] + self._guesses(s, k_of[s], overlap)) for s in group], group)
            for client, group in _group(proposing, lambda s: s.draft)
        ]
        for group_results in await _all(propose_calls):
            for sequence, proposal in group_results:
                if isinstance(proposal, Exception):
                    self._on_draft_error(sequence, proposal)  # this round goes on without proposals
                else:
                    proposals[sequence] = split_guess(proposal, k_of[sequence])
        proposed = time.perf_counter()
        live = [s for s in sequences if not s.finished]
        verify_calls = []
        for client, group in _group(live, lambda s: s.target):
            ahead = self._decoding_ahead(group, limits, batch)
            verify_calls.append(self._call(client, "verify", [
                self._verify_item(s, *proposals.get(s, (None, None)), s in ahead) for s in group], group))
        # While the target verifies, the draft proposes the next round from the optimistic continuation: after this
        # round's proposals and bonus guess, or, catching up, after its guess of the one token this round decodes.
        ahead = {s: self._ahead_length(s, batch, k_of[s], k_of[s] + 1) for s in live
                 if overlap and s in proposals and proposals[s][1] is not None}
        ahead.update({s: self._ahead_length(s, batch, k_of[s], 1) for s in live if s in catching_up})
        ahead = {s: n for s, n in ahead.items() if n > 0}
        ahead_calls = [
            self._call(client, "propose", [self._ahead_item(s, proposals, ahead[s], s in catching_up) for s in group],
                       group)
            for client, group in _group(list(ahead), lambda s: s.draft)
        ]
        verify_results, ahead_results, verify_seconds, ahead_seconds = await self._verify_and_propose_ahead(
            verify_calls, ahead_calls)
        verified = time.perf_counter()
        pre_proposals = {s: p for group_results in ahead_results for s, p in group_results}
        records = []
        for group_results in verify_results:
            for sequence, verdict in group_results:
                if sequence.finished:
                    continue
                if isinstance(verdict, Exception):
                    self._on_target_error(sequence, verdict)
                    continue
                proposal, guess = proposals.get(sequence, (None, None))
                committed_len = len(sequence.committed)
                caught_up = pre_proposals.get(sequence) if sequence in catching_up else None
                if isinstance(caught_up, Exception):
                    caught_up = None  # handled with the other draft errors below
                if caught_up is not None:
                    verdict = self._check_catch_up_guess(sequence, verdict, caught_up)
                if proposal is not None:
                    # The draft's KV is valid up to the accepted proposals it computed.
                    sequence.draft_cached = min(proposal.num_cached, committed_len + verdict.num_accepted)
                    sequence.bonus = verdict.num_accepted == len(proposal.token_ids) > 0
                    if proposal.token_ids:
                        self.policy.record_acceptance(sequence.acceptance, sequence.draft_variant,
                                                      len(proposal.token_ids), verdict.num_accepted,
                                                      probe if adaptive[sequence] else None)
                sequence.target_cached = verdict.num_cached
                self._commit(sequence, verdict, len(proposal.token_ids) if proposal else 0, records)
                if guess is not None and verdict.num_accepted == len(proposal.token_ids):
                    self._keep_pre_proposal(sequence, verdict, guess, committed_len, pre_proposals.get(sequence))
                elif caught_up is not None:
                    self._keep_catch_up(sequence, verdict, committed_len, caught_up)
        self._notify("round", records)
        for sequence, pre_proposal in pre_proposals.items():
            if isinstance(pre_proposal, Exception) and not sequence.finished:
                self._on_draft_error(sequence, pre_proposal)
        # A clean round of one k measures its cost; not one where a proposer sent fewer than asked (an n-gram
        # lookup without a match): that verification cost less than k proposals do.
        short = any(len(proposal.token_ids) < k_of[s] for s, (proposal, _) in proposals.items())
        clean = self._round_alone and not short and all(n in (0, k) for n in k_of.values())
        if clean and not overlap and not pre_proposed:  # a serial round of one k: its cost
            self.policy.record_costs(batch, k, proposed - started, verified - proposed)
        elif clean and ahead_calls and _ran_in_full(ahead, k_of, live):
            self.overlap.record_phase(batch, k, verified - proposed, ahead_seconds)
            # The speculation policy's costs too (up to k+2 proposals ahead: k of them its propose cost), so that k
            # stays adaptive while every round overlaps; concurrent calls only ever look slower, never faster.
            self.policy.record_costs(batch, k, ahead_seconds * k / max(ahead.values()), verify_seconds)
        self.telemetry.round_chosen(k, batch)
        round_timeline.mark("round.committed")

    # ---- overlapped rounds (overlap_policy.py, pre_proposals.py) -------------------------------------------------

    def _overlap_this_round(self, sequences: list[SequenceState], k_of: dict, batch: int, rate_of: dict) -> bool:
        """`rate_of`: the round's acceptance estimates, of every sequence that may speculate."""
        speculating = [s for s in sequences if k_of[s] > 0]
        if not speculating or self.overlap.mode == "off":
            return False
        k = max(k_of[s] for s in speculating)
        costs = self.policy.buckets.get(bucket_of(batch))
        t_propose, t_verify = costs.costs_near(k) if costs else (None, None)
        concurrent = all(getattr(s.draft, "concurrent", True) and getattr(s.target, "concurrent", True)
                         for s in speculating)
        rates = [rate_of[s] for s in speculating]
        may_catch_up = [_rounds_may_be_cut(s.request.params) for s in speculating]
        return self.overlap.decide(batch, k, rates, t_propose, t_verify, concurrent, may_catch_up)

    def _guesses(self, sequence: SequenceState, k: int, overlap: bool) -> int:
        """1 when the propose call also samples the bonus guess (an overlapped round with room for one more)."""
        if not overlap or k <= 0 or k + 1 > self.config.max_speculative_tokens:
            return 0
        return int(k + 1 <= sequence.draft.max_model_len - len(sequence.committed) + 1)

    def _ahead_length(self, sequence: SequenceState, batch: int, k: int, ahead: int) -> int:
        """Proposals (with their own guess when there is room) of the next round, drawn ahead from the optimistic
        continuation `ahead` tokens past the committed ones: the k that round gets if it comes true, at most this
        round's k (seeded requests keep theirs). Catching up (ahead = 1), the guess of this round's token comes first,
        within the draft call's bound."""
        bound = self.config.max_speculative_tokens - (1 if ahead == 1 else 0)
        next_k = min(k, bound, self._speculation_length(sequence, batch, ahead=ahead))
        if next_k <= 0:
            return 0
        room = sequence.draft.max_model_len - (len(sequence.committed) + ahead) + 1
        return next_k + int(next_k + 1 <= min(room, bound))

    def _ahead_item(self, sequence: SequenceState, proposals: dict, length: int, catching_up: bool) -> ProposeItem:
        """The draft's call beside the verification: from the proposals and their bonus guess, or, catching up, from
        the committed tokens it has not run yet, with one more proposal first (the guess of this round's token)."""
        if catching_up:
            return ProposeItem(sequence.handle, sequence.draft_cached, sequence.committed[sequence.draft_cached :],
                               1 + length)
        proposal, guess = proposals[sequence]
        return ProposeItem(sequence.handle, proposal.num_cached, [guess], length)

    def _take_pre_proposals(self, sequences: list[SequenceState], k_of: dict) -> dict:
        """The pre-proposals whose continuation came true, cut to this round's k (their next token the new guess)."""
        ready = {}
        for sequence in sequences:
            pre, sequence.pre_proposal = sequence.pre_proposal, None
            if (pre is None or k_of[sequence] <= 0 or pre.client is not sequence.draft or not sequence.draft_prefilled
                    or pre.valid_at != len(sequence.committed)):
                continue
            k_of[sequence] = min(k_of[sequence], len(pre.proposal.token_ids))
            ready[sequence] = split_guess(pre.proposal, k_of[sequence])
            sequence.stats.pre_proposed_rounds += 1
        return ready

    def _keep_pre_proposal(self, sequence: SequenceState, verdict, guess: int, committed_len: int, pre) -> None:
        """After a verdict that accepted every proposal: the bonus guess was right or wrong; when right (and the draft
        proposed ahead), the pre-proposal is the next round's proposal and the draft's KV holds every committed token."""
        matched = verdict.token_ids[-1] == guess
        self.overlap.record_guess(matched)
        if (not matched or pre is None or isinstance(pre, Exception) or sequence.finished or not pre.token_ids
                or len(sequence.committed) != committed_len + len(verdict.token_ids)):
            return
        sequence.draft_cached = len(sequence.committed)
        sequence.pre_proposal = PreProposal(pre, sequence.draft, len(sequence.committed))

    def _check_catch_up_guess(self, sequence: SequenceState, verdict, caught_up):
        """A sequence that decoded alone while its draft caught up: whether the draft's first token guessed the
        target's. In the synthetic-acceptance benchmark mode (NOT lossless) a coin of the target's alpha says so, at
        that position's synthetic stream, and a right guess replaces the target's token, as the verifier does for a
        bonus guess (synthetic_acceptance.py)."""
        if not caught_up.token_ids or len(verdict.token_ids) != 1:
            return verdict
        guess = caught_up.token_ids[0]
        alpha = getattr(sequence.target, "synthetic_acceptance", None)
        if alpha is not None and verdict.token_ids[0] != guess:
            if synthetic_guess_right(alpha, sequence.sampling.seed, len(sequence.committed)):
                return replace(verdict, token_ids=[guess], logprobs=None)
        return verdict

    def _keep_catch_up(self, sequence: SequenceState, verdict, committed_len: int, caught_up) -> None:
        """After a round that decoded one token while the draft caught up: the draft's KV holds every token committed
        before it; when its guess was that token, the proposals it drew beyond are the next round's."""
        sequence.draft_cached = min(caught_up.num_cached, committed_len)
        if not caught_up.token_ids:
            return
        matched = verdict.token_ids[:1] == caught_up.token_ids[:1]
        self.overlap.record_guess(matched)
        beyond = caught_up.token_ids[1:]
        if (not matched or not beyond or sequence.finished or len(sequence.committed) != committed_len + 1
                or caught_up.num_cached < committed_len + 1):
            return
        sequence.draft_cached = committed_len + 1
        ahead = Proposal(beyond, caught_up.q_token_ids[1:], caught_up.q_probs[1:], caught_up.num_cached)
        sequence.pre_proposal = PreProposal(ahead, sequence.draft, len(sequence.committed))

    async def _verify_and_propose_ahead(self, verify_calls: list, ahead_calls: list):
        """The verification and the proposals ahead at once; returns both results and each side's seconds."""
        if not ahead_calls:
            return await _all(verify_calls), [], None, None
        started = time.perf_counter()

        async def timed(calls):
            results = await _all(calls)
            return results, time.perf_counter() - started

        # The proposals ahead start first: a verification in this process (the co-located target) runs on this
        # thread and holds it until done, so the draft's request must be on its way before it starts.
        (ahead_results, ahead_seconds), (verify_results, verify_seconds) = await asyncio.gather(
            timed(ahead_calls), timed(verify_calls))
        return verify_results, ahead_results, verify_seconds, ahead_seconds

    # ---- faults: lost replicas, lost worker state, KV pressure --------------------------------------------------

    def _on_draft_error(self, sequence: SequenceState, error: Exception) -> None:
        sequence.pre_proposal = None
        if isinstance(error, KVCacheFull):
            return  # no proposals this round; the target decodes alone
        pool = self._variant_pool(sequence)
        if isinstance(error, Unavailable):
            log.warning("draft %s unavailable: %s", sequence.draft.name if sequence.draft else "?", error)
            if pool is not None and sequence.draft is not None:
                pool.mark_down(sequence.draft)
                pool.unpin(sequence.draft)
                self.health.moved_away(sequence.draft, [sequence.handle])  # released there once it answers again
            sequence.draft = None  # re-attached to another replica, or target-only until one returns
            sequence.draft_prefilled = False
        elif isinstance(error, UnknownSequence):
            sequence.draft_prefilled = False  # the replica lost our KV (restart): run the tokens in again
        else:
            log.warning("draft failed for %s, decoding target-only: %s", sequence.handle, error)
            self._drop_draft(sequence)
            sequence.draft_disabled = True

    def _on_target_error(self, sequence: SequenceState, error: Exception) -> None:
        if isinstance(error, KVCacheFull) and len(self.running) + len(self.waiting) > 1:
            # Back-pressure: recompute later, when others have freed blocks. A sequence alone always fits (the
            # served context never exceeds the cache), so this cannot loop forever.
            self._preempt(sequence)
        elif isinstance(error, Unavailable):
            log.warning("target %s unavailable: %s", sequence.target.name if sequence.target else "?", error)
            if sequence.target is not None:
                self.targets.mark_down(sequence.target)
                self.targets.unpin(sequence.target)
                self.health.moved_away(sequence.target, [sequence.handle])  # released there once it answers again
            sequence.target = None  # re-prefilled from the committed tokens on another target
            sequence.prefilled = False
        elif isinstance(error, UnknownSequence):
            sequence.prefilled = False  # the replica lost our KV (restart): prefill it again there
        else:
            self._fail(sequence, error)

    def _leave_down_replicas(self, sequences: list[SequenceState]) -> None:
        """Sequences pinned to a replica that was marked down (a call of another sequence found it hung) move on
        now, before a call of theirs waits for it again."""
        down = Unavailable("replica marked down")
        for sequence in sequences:
            if sequence.target is not None and sequence.target.name in self.targets.down:
                self._on_target_error(sequence, down)
            pool = self._variant_pool(sequence) if sequence.draft is not None else None
            if pool is not None and sequence.draft.name in pool.down:
                self._on_draft_error(sequence, down)

    def _decoding_ahead(self, group: list[SequenceState], limits: dict, batch: int) -> set[SequenceState]:
        """The sequences of one target's call whose next step that target may run ahead (target/decode_ahead.py):
        where the whole call decodes plainly now and next round with nothing joining it (no prefill beside this
        round), every sequence that does not end this round. None where the next call would still run a step of
        its own (proposals, a new sequence): the step ahead would then be extra work."""
        if not self._round_alone or any(limits[s] > 0 or self._speculation_length(s, batch, ahead=1) > 0
                                        for s in group):
            return set()
        return {s for s in group if s.stop.max_tokens - (len(s.committed) - s.prompt_len) >= 2}

    def _verify_item(self, sequence: SequenceState, proposal, guess: int | None = None,
                     decode_ahead: bool = False) -> VerifyItem:
        item = VerifyItem(
            sequence.handle,
            sequence.target_cached,
            sequence.committed[sequence.target_cached :],
            logprobs=sequence.request.params.logprobs,
            decode_ahead=decode_ahead,
        )
        if proposal is not None and proposal.token_ids:
            item.draft_token_ids = proposal.token_ids
            item.q_token_ids = proposal.q_token_ids
            item.q_probs = proposal.q_probs
            item.bonus_guess = guess  # only the synthetic-acceptance benchmark mode reads it
        return item

    def _speculation_length(self, sequence: SequenceState, batch: int, ahead: int = 0) -> int:
        """The most proposals the sequence may get this round (`ahead`: as if that many more tokens were committed)."""
        if sequence.draft is None or not sequence.draft_prefilled:
            return 0
        params = sequence.request.params
        k = params.num_speculative_tokens if params.num_speculative_tokens is not None else self.config.num_speculative_tokens
        if self.config.disable_speculation_batch_size and batch >= self.config.disable_speculation_batch_size:
            return 0
        length = len(sequence.committed) + ahead
        remaining = sequence.stop.max_tokens - len(sequence.generated) - ahead - 1
        room = min(sequence.target.max_model_len - length, sequence.draft.max_model_len - length + 1)
        return max(0, min(k, remaining, room))

    # ---- commit, finish, release ------------------------------------------------------------------------------

    def _commit(self, sequence: SequenceState, verdict, num_draft: int | None, records: list) -> None:
        """Commit the verdict's tokens; `records` collects what the observers hear of it, once per batch."""
        kept, text = sequence.stop.add(verdict.token_ids)
        sequence.committed.extend(kept)
        if num_draft is not None:
            if num_draft > 0:
                sequence.stats.record(num_draft, verdict.num_accepted)
            else:
                sequence.stats.rounds += 1
        logprobs = verdict.logprobs[: len(kept)] if verdict.logprobs is not None else None
        if logprobs:
            sequence.logprobs.extend(logprobs)
        if sequence.first_token_at is None:
            sequence.first_token_at = time.perf_counter()
        if num_draft is not None:
            records.append((sequence, num_draft, verdict.num_accepted if num_draft > 0 else 0))
        else:
            records.append(sequence)
        if kept or text:
            sequence.events.put_nowait(TokenEvent(kept, text, logprobs))
        if sequence.stop.finish_reason:
            self._finish(sequence, sequence.stop.finish_reason)

    def _notify(self, event: str, records: list) -> None:
        """Observers (metrics, canary statistics) hear of a whole batch at once: nothing per sequence on the loop."""
        if records:
            for observer in self.observers:
                observer(event, records)

    def _finish(self, sequence: SequenceState, reason: str) -> None:
        sequence.finished = True
        sequence.finish_reason = reason
        now = time.perf_counter()
        params = sequence.request.params
        result = GenerationResult(
            request_id=sequence.request.request_id,
            token_ids=sequence.generated,
            text=sequence.stop.text,
            finish_reason=reason,
            prompt_tokens=sequence.prompt_len,
            stats=sequence.stats,
            time_to_first_token=(sequence.first_token_at or now) - sequence.started,
            total_time=now - sequence.started,
            logprobs=sequence.logprobs if params.logprobs is not None else None,
            draft_variant=sequence.draft_variant,
            preemptions=sequence.preemptions,
            acceptance_method=sequence.acceptance_method,
        )
        self._notify("finish", [sequence])
        self.telemetry.request_ended(sequence)
        sequence.events.put_nowait(result)

    def _fail(self, sequence: SequenceState, error: Exception) -> None:
        if sequence.finished:
            return
        sequence.finished = True
        sequence.finish_reason = "error"
        sequence.error = error
        self._notify("error", [sequence])
        self.telemetry.request_ended(sequence)
        sequence.events.put_nowait(error)

    def _preempt(self, sequence: SequenceState) -> None:
        """Free the sequence's KV everywhere and queue it first in line; it resumes from its committed tokens."""
        self._unpin(sequence)
        self.running.remove(sequence)
        sequence.target = sequence.draft = None
        sequence.prefilled = sequence.draft_prefilled = False
        sequence.pre_proposal = None
        sequence.preemptions += 1
        self.waiting.appendleft(sequence)

    def _drop_draft(self, sequence: SequenceState) -> None:
        for pool in self.drafts:
            if pool.name == sequence.draft_variant:
                pool.unpin(sequence.draft)
        if sequence.draft is not None:
            self._pending_release(sequence.draft, sequence.handle)
        sequence.draft = None
        sequence.draft_prefilled = False
        sequence.pre_proposal = None

    def _unpin(self, sequence: SequenceState) -> None:
        self.targets.unpin(sequence.target)
        for pool in self.drafts:
            if pool.name == sequence.draft_variant:
                pool.unpin(sequence.draft)
        for client in (sequence.target, sequence.draft):
            if client is not None:
                self._pending_release(client, sequence.handle)

    def _pending_release(self, client, handle: str) -> None:
        self._releases.setdefault(client, []).append(handle)

    async def _release_finished(self) -> None:
        """Another process's releases go out behind the next round (a task of `_releasing`), which so waits neither
        for their answers nor for the finished requests' last stream writes, run on the loop meanwhile: the worker
        has answered every call of these sequences already, and a release touches no other sequence's KV. Releases on
        an in-process worker run now (no wait to save), before a caller that saw its result can end the event loop."""
        local, remote = [], []
        for client, handles in self._finished_releases().items():
            (local if getattr(client, "in_process", False) else remote).append(self._release(client, handles))
        if remote:
            sent = asyncio.gather(*remote)
            self._releasing.add(sent)
            sent.add_done_callback(self._releasing.discard)
        if local:
            await asyncio.gather(*local)

    async def _releases_sent(self) -> None:
        while self._releasing:
            sent = list(self._releasing)
            self._releasing.difference_update(sent)  # their done callbacks may not have run yet
            await asyncio.gather(*sent)

    def _finished_releases(self) -> dict:
        done = [s for s in self.running if s.finished]
        for sequence in done:
            self.running.remove(sequence)
            self._unpin(sequence)
        releases, self._releases = self._releases, {}
        return releases

    async def _release(self, client, handles: list[str]) -> None:
        pool = next((p for p in [self.targets, *self.drafts] if client in p.replicas), None)
        if pool is not None and client.name in pool.down:
            self.health.moved_away(client, handles)  # released when it answers again
            return
        try:
            await self.health.call(client, "release", handles)
        except Exception as error:  # the worker's lease on idle sequences frees them anyway
            log.warning("release on %s failed: %s", client.name, error)
            if isinstance(error, Unavailable) and pool is not None:
                pool.mark_down(client)
                self.health.moved_away(client, handles)

    async def _call(self, client, method: str, items: list, sequences: list[SequenceState]):
        """One batched worker call; a failure of the whole call becomes that error for each of its sequences."""
        self._waited |= not getattr(client, "in_process", False)  # another process's: the loop turns while it waits
        try:
            with self.telemetry.worker_call(client, method, items, sequences) as call:
                results = call.results = await self.health.call(client, method, items)
        except Exception as error:
            results = [error] * len(items)
        return list(zip(sequences, results))


def _draft_prefix(sequence: SequenceState) -> list[int]:
    """What a draft's prefill caches: the prompt, or every committed token but the last once the target has
    committed one (beside this prefill or earlier), since a propose call's delta must hold the last token."""
    if len(sequence.committed) > sequence.prompt_len:
        return sequence.committed[:-1]
    return list(sequence.committed)


async def _all(coroutines: list) -> list:
    """Await one phase's calls: a lone call directly (a task per call costs event-loop turns every round), several
    concurrently."""
    if len(coroutines) == 1:
        return [await coroutines[0]]
    return await asyncio.gather(*coroutines)


def _follows_policy(params) -> bool:
    """Whether the speculation policy picks this request's k (at most its num_speculative_tokens). A request that
    asks for a fixed k gets exactly it, and so does a seeded sampled one: its tokens depend on how many were proposed
    each round, so a fixed k keeps the promise that a seed reproduces its output whatever else is batched. Greedy
    output never depends on k."""
    return not params.fixed_speculation and _rounds_may_be_cut(params)


def _ran_in_full(ahead: dict, k_of: dict, live: list[SequenceState]) -> bool:
    """Whether every speculating sequence's draft call ran in full beside the verification. Only such a round
    measures the overlapped phase: near a request's end the call shrinks or is skipped, and such a phase (the least of
    the last few is what the policy compares) would make overlap look cheaper than it is."""
    return all(ahead.get(s, 0) > k_of[s] for s in live if k_of[s] > 0 and not s.finished)


def _rounds_may_be_cut(params) -> bool:
    """Whether a request's output is the same however its rounds are cut (how many proposals each verifies): greedy
    output always is; a seeded sampled one's tokens depend on it (its seed must reproduce them), an unseeded one
    promises no particular tokens."""
    return params.greedy or params.seed is None


def _group(sequences: list[SequenceState], key) -> list[tuple[object, list[SequenceState]]]:
    groups: dict = {}
    for sequence in sequences:
        groups.setdefault(key(sequence), []).append(sequence)
    return list(groups.items())
