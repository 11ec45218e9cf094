"""One compute thread per worker: concurrent RPCs of the same kind merge into one batch.

gRPC handlers run on the event loop; model work runs here, off the loop, so the server keeps accepting calls while
the device computes. Every call queued while a step runs joins the next step of its kind (several coordinators'
propose calls become one forward). All KV state changes happen on this thread, so none need locks.
"""

import asyncio
import logging
import threading
from collections import deque
from typing import Callable

from specsplit.services.telemetry import round_timeline

log = logging.getLogger(__name__)


class StepBatcher:
    def __init__(self, handlers: dict[str, Callable[[list], list]], name: str = "worker"):
        self._handlers = handlers
        self._pending: deque = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._name = name
        self._thread = threading.Thread(target=self._loop, name=f"{name}-compute", daemon=True)
        self._thread.start()
        self.steps = 0

    @property
    def queue_depth(self) -> int:
        """Items waiting for a step (not counting the step in progress)."""
        with self._cond:
            return sum(len(items) for _, items, _, _ in self._pending)

    async def submit(self, kind: str, items: list) -> list:
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

    def _take_batch(self):
        with self._cond:
            while not self._pending and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None, []
            kind = self._pending[0][0]
            calls = [call for call in self._pending if call[0] == kind]
            self._pending = deque(call for call in self._pending if call[0] != kind)
            return kind, calls

    def _loop(self) -> None:
        while True:
            kind, calls = self._take_batch()
            if kind is None:
                return
            merged = [item for _, items, _, _ in calls for item in items]
            round_timeline.mark(f"{self._name}.step_start")
            try:
                results = self._handlers[kind](merged)
            except Exception as error:  # a failed step fails its calls, not the worker
                log.exception("%s step failed", kind)
                results = [error] * len(merged)
            self.steps += 1
            round_timeline.mark(f"{self._name}.step_end")
            start = 0
            for _, items, future, loop in calls:
                part = results[start : start + len(items)] if isinstance(results, list) else results
                start += len(items)
                loop.call_soon_threadsafe(_resolve, future, part)


def _resolve(future, value) -> None:
    if not future.cancelled():
        future.set_result(value)
