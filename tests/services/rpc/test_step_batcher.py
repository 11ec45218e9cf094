"""How a worker runs its steps (rpc/step_batcher.py): a lone caller's round calls on the calling thread, several
callers' calls merged on the compute thread, prefills there unless the last prefill's pace says they are short, and
the compute thread's work visible to a spinning loop."""

import asyncio
import threading
import time
from types import SimpleNamespace

from specsplit.services.rpc import step_batcher
from specsplit.services.rpc.step_batcher import StepBatcher


class Recorder:
    """Step handlers that note which thread ran them and how many items each step had."""

    def __init__(self, hold: threading.Event | None = None):
        self.steps: list[tuple[str, str, int]] = []
        self.hold = hold
        self.busy_seen: list[bool] = []

    def handler(self, kind):
        def step(items):
            if self.hold is not None:
                self.busy_seen.append(step_batcher.compute_threads_busy())
                self.hold.wait(5)
            self.steps.append((kind, threading.current_thread().name, len(items)))
            return [f"{kind}:{i}" for i in items]

        return step

    def handlers(self):
        return {kind: self.handler(kind) for kind in ("propose", "verify", "prefill")}


def run_calls(batcher: StepBatcher, calls):
    """Run the coroutine function `calls` against `batcher`, then stop it."""
    try:
        return asyncio.run(calls())
    finally:
        batcher.stop()


def test_a_lone_callers_round_call_runs_on_the_calling_thread():
    recorder = Recorder()
    batcher = StepBatcher(recorder.handlers(), name="test")

    async def main():
        return [await batcher.submit("verify", [1, 2], caller="alice") for _ in range(3)]

    results = run_calls(batcher, main)
    assert results == [["verify:1", "verify:2"]] * 3
    assert {name for _, name, _ in recorder.steps} == {threading.current_thread().name}
    assert batcher.inline_steps == 3


def test_prefills_and_unnamed_callers_go_to_the_compute_thread():
    recorder = Recorder()
    batcher = StepBatcher(recorder.handlers(), name="test")

    async def main():
        await batcher.submit("prefill", [1], caller="alice")
        await batcher.submit("verify", [1])
        await batcher.submit("verify", [1], caller="alice", inline=False)

    run_calls(batcher, main)
    assert [name for _, name, _ in recorder.steps] == ["test-compute"] * 3
    assert batcher.inline_steps == 0


def test_a_lone_callers_prefill_runs_inline_when_the_last_prefills_pace_says_it_is_short():
    """A first token waits on its prefill: a short one skips the two thread hand-offs, a long one (at the pace the
    last prefill measured: here 0.5 ms a token) goes to the compute thread, where it does not hold the loop. The
    first prefill may measure 40 times slow and the second still runs inline."""
    ran = []

    def prefill(items):
        time.sleep(0.0005 * sum(len(i.token_ids) for i in items))
        ran.append(threading.current_thread().name)
        return [None] * len(items)

    batcher = StepBatcher({"prefill": prefill}, name="test")

    def tokens(n):
        return [SimpleNamespace(token_ids=[0] * n)]

    async def main():
        await batcher.submit("prefill", tokens(40), caller="alice")   # no pace known yet: the thread
        await batcher.submit("prefill", tokens(1), caller="alice")    # 0.5 ms at that pace: inline
        await batcher.submit("prefill", tokens(100), caller="alice")  # 50 ms at least: the thread
        await batcher.submit("prefill", tokens(1))                  # nobody named: the thread

    run_calls(batcher, main)
    assert ran == ["test-compute", threading.current_thread().name, "test-compute", "test-compute"]
    assert batcher.inline_steps == 1


def test_several_callers_are_merged_on_the_compute_thread():
    """While a step runs on the compute thread, calls of two coordinators queue and become one step."""
    hold = threading.Event()
    recorder = Recorder(hold)
    batcher = StepBatcher(recorder.handlers(), name="test")
    try:
        async def main():
            first = asyncio.ensure_future(batcher.submit("prefill", ["p"], caller="alice"))
            while not recorder.busy_seen:  # the prefill holds the compute thread
                await asyncio.sleep(0.001)
            alice = asyncio.ensure_future(batcher.submit("verify", ["a"], caller="alice"))
            bob = asyncio.ensure_future(batcher.submit("verify", ["b1", "b2"], caller="bob"))
            await asyncio.sleep(0.01)
            hold.set()
            return await first, await alice, await bob

        first, alice, bob = asyncio.run(main())
    finally:
        hold.set()
        batcher.stop()
    assert (first, alice, bob) == (["prefill:p"], ["verify:a"], ["verify:b1", "verify:b2"])
    assert recorder.steps[1] == ("verify", "test-compute", 3)  # one step for both callers
    assert recorder.busy_seen[0] is True and not step_batcher.compute_threads_busy()


def test_a_second_caller_ends_inline_steps_until_it_has_been_quiet():
    recorder = Recorder()
    batcher = StepBatcher(recorder.handlers(), name="test")

    async def main():
        await batcher.submit("verify", [1], caller="alice")
        await batcher.submit("verify", [1], caller="bob")
        await batcher.submit("verify", [1], caller="alice")

    run_calls(batcher, main)
    assert [name for _, name, _ in recorder.steps] == [threading.current_thread().name, "test-compute", "test-compute"]
