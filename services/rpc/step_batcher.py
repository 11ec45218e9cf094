"""How a worker runs its steps: inline for a lone caller, else on one compute thread that merges concurrent calls.

gRPC handlers run on the event loop. A round's call from the only coordinator a worker serves, arriving while the
worker is idle, runs its step right there on the loop's thread: handing it to another thread and back costs two
thread wake-ups (tens to hundreds of microseconds) per call, which is most of what a round's hop costs beyond the
wire. So does such a caller's prefill when the pace of the last prefill says it ends within INLINE_PREFILL_SECONDS
(a request's first token waits on it; a long one would hold the loop, which must stay free to answer a Describe).
Calls from several coordinators, longer prefills and everything arriving while a step runs go to the compute thread
instead, where every call queued while a step runs joins the next step of its kind (several coordinators' propose
calls become one forward). One step runs at a time, inline or on the thread, so KV state changes need no locks.
"""

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Callable

from specsplit.services.telemetry import round_timeline

log = logging.getLogger(__name__)

INLINE_KINDS = ("propose", "verify")  # a round's calls; prefills only when short (below)
INLINE_PREFILL_SECONDS = 0.02        # a prefill this short at the last prefill's pace runs inline too
LONE_CALLER_SECONDS = 1.0            # a caller is alone when no other called within this long

_threads_at_work = [0]  # compute threads of this process running a step now (a spinning loop must let them have the GIL)


def compute_threads_busy() -> bool:
    """Whether a compute thread of this process is running a step: its host work needs the GIL, which a spinning
    event loop would hold nearly all the time (round_channel.LoopSpinner checks this)."""
    return _threads_at_work[0] > 0


class StepBatcher:
    def __init__(self, handlers: dict[str, Callable[[list], list]], name: str = "worker"):
        self._handlers = handlers
        self._marks = (f"{name}.step_start", f"{name}.step_end")  # the round timeline's names for a step
        self._pending: deque = deque()
        self._cond = threading.Condition()
        self._busy = False                 # a step is running, inline or on the compute thread
        self._stopped = False
        self._callers: dict[str, float] = {}  # caller -> when it last called
        self._thread = threading.Thread(target=self._loop, name=f"{name}-compute", daemon=True)
        self._thread.start()
        self.steps = 0
        self.inline_steps = 0
        self._prefill_pace: float | None = None  # seconds per token of the last prefill step (None: none yet)

    @property
    def queue_depth(self) -> int:
        """Items waiting for a step (not counting the step in progress)."""
        with self._cond:
            return sum(len(items) for _, items, _, _ in self._pending)

    async def submit(self, kind: str, items: list, caller: str | None = None, inline: bool = True) -> list:
        """The step's results for `items` (a list, one per item, or one value for the call). `caller` names who
        asks (a coordinator's id): a lone caller's round calls may run inline, unless `inline` is False (the caller
        has other work for this thread meanwhile)."""
        if inline and self._try_inline(kind, caller, items):
            try:
                return self._run(kind, items)
            finally:
                with self._cond:
                    self._busy = False
                    if self._pending:  # woken for nothing, the compute thread would take the GIL from this answer
                        self._cond.notify()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            self._pending.append((kind, items, future, loop))
            self._cond.notify()
        return await future

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _try_inline(self, kind: str, caller: str | None, items: list) -> bool:
        """Claim the worker for an inline step: a round call (or a short prefill) of the only recent caller, nothing
        queued or running."""
        if caller is None:
            return False
        now = time.monotonic()
        short_prefill = (kind == "prefill" and self._prefill_pace is not None
                         and self._prefill_pace * _tokens(items) <= INLINE_PREFILL_SECONDS)
        with self._cond:
            self._callers[caller] = now
            if (kind not in INLINE_KINDS and not short_prefill) or self._busy or self._pending or self._stopped:
                return False
            if len(self._callers) > 1:
                for other, last in list(self._callers.items()):
                    if other != caller and now - last > LONE_CALLER_SECONDS:
                        del self._callers[other]
                if len(self._callers) > 1:
                    return False
            self._busy = True
            self.inline_steps += 1
            return True

    def _run(self, kind: str, items: list):
        round_timeline.mark(self._marks[0])
        started = time.perf_counter()
        try:
            results = self._handlers[kind](items)
        except Exception as error:  # a failed step fails its calls, not the worker
            log.exception("%s step failed", kind)
            results = [error] * len(items)
        if kind == "prefill":
            self._prefill_pace = (time.perf_counter() - started) / max(_tokens(items), 1)
        self.steps += 1
        round_timeline.mark(self._marks[1])
        return results

    def _take_batch(self):
        with self._cond:
            while (not self._pending or self._busy) and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None, []
            kind = self._pending[0][0]
            calls = [call for call in self._pending if call[0] == kind]
            self._pending = deque(call for call in self._pending if call[0] != kind)
            self._busy = True
            return kind, calls

    def _loop(self) -> None:
        while True:
            kind, calls = self._take_batch()
            if kind is None:
                return
            merged = [item for _, items, _, _ in calls for item in items]
            _threads_at_work[0] += 1
            try:
                results = self._run(kind, merged)
            finally:
                _threads_at_work[0] -= 1
                with self._cond:
                    self._busy = False
            start = 0
            for _, items, future, loop in calls:
                part = results[start : start + len(items)] if isinstance(results, list) else results
                start += len(items)
                loop.call_soon_threadsafe(_resolve, future, part)


def _tokens(items: list) -> int:
    """The tokens a prefill call's items carry (an item that failed to decode carries none)."""
    return sum(len(getattr(item, "token_ids", None) or ()) for item in items)


def _resolve(future, value) -> None:
    if not future.cancelled():
        future.set_result(value)
