"""What the coordinator's loop sends when, with workers in other processes: a new request's prefill reaches its
target before the round beside it, a finished request's release never holds up the next round, a loop that just
prefilled goes straight on to decode, and with an arrival window a burst of requests is prefilled in one step. The workers are the tiny models' in-process workers behind a wrapper
that says it is not in process and answers in a later turn of the event loop, as a network client does (real
processes over gRPC are the e2e tests'; the order of messages is this file's)."""

import asyncio

import pytest

from specsplit.services.coordinator import coordinator as coordinator_module
from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams


class OverTheNetwork:
    """A worker client that is not in process: each call is logged when sent and when answered, and answers a
    loop turn later; releases can be held back by a gate."""

    in_process = False

    def __init__(self, client, log: list, role: str):
        self.client, self.log, self.role = client, log, role
        self.release_gate: asyncio.Event | None = None

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def _call(self, method: str, items, handles: list[str]):
        self.log.append(("sent", self.role, method, handles))
        await asyncio.sleep(0)
        result = await getattr(self.client, method)(items)
        self.log.append(("answered", self.role, method, handles))
        return result

    async def prefill(self, items):
        return await self._call("prefill", items, [i.handle for i in items])

    async def verify(self, items):
        return await self._call("verify", items, [i.handle for i in items])

    async def propose(self, items):
        return await self._call("propose", items, [i.handle for i in items])

    async def release(self, handles):
        self.log.append(("sent", self.role, "release", list(handles)))
        if self.release_gate is not None:
            await self.release_gate.wait()
        return await self.client.release(handles)


@pytest.fixture
def engine(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=2, dtype="float64")
    engine.log = []
    pools = {"target": engine.coordinator.targets, "draft": engine.coordinator.drafts[0]}
    for role, pool in pools.items():
        pool.replicas[0] = OverTheNetwork(pool.replicas[0], engine.log, role)
    engine.target_client = pools["target"].replicas[0]
    return engine


def _request(engine, prompt: str, max_tokens: int, k: int | None = None):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k)
    return engine.request(prompt, params)


def test_a_new_requests_prefill_reaches_the_target_before_the_round_beside_it(engine):
    async def main():
        first = engine.request("def f(x):", SamplingParams(max_tokens=30, ignore_eos=True, num_speculative_tokens=0))
        tokens = 0
        second = None
        async for event in engine.coordinator.stream(first):
            tokens += len(getattr(event, "token_ids", []) or [])
            if second is None and tokens >= 3:  # the first decodes: the second arrives mid-stream
                second = engine.request("hello", SamplingParams(max_tokens=5, ignore_eos=True, num_speculative_tokens=0))
                second_task = asyncio.ensure_future(engine.coordinator.generate(second))
        await second_task
        await engine.coordinator.wait_idle()
        return second.request_id

    asyncio.run(main())
    sent = [(method, handles) for kind, role, method, handles in engine.log if kind == "sent" and role == "target"]
    prefills = [i for i, (method, handles) in enumerate(sent) if method == "prefill"]
    assert len(prefills) == 2  # one per request
    second_prefill = prefills[1]
    # The round of the first request went out beside it, after it (one process runs them in that order too).
    assert sent[second_prefill + 1][0] == "verify"
    target_log = [entry for entry in engine.log if entry[1] == "target"]
    at = target_log.index(("sent", "target", "prefill", sent[second_prefill][1]))
    assert target_log[at + 1][:3] == ("sent", "target", "verify")  # both on the wire before either answered
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_a_finished_requests_release_does_not_hold_up_the_next_round(engine):
    async def main():
        gate = asyncio.Event()
        engine.target_client.release_gate = gate  # the target answers no release until the gate opens
        short = asyncio.ensure_future(engine.coordinator.generate(_request(engine, "hello", 2)))
        long = asyncio.ensure_future(engine.coordinator.generate(_request(engine, "def f(x):", 40)))
        done = await asyncio.wait_for(asyncio.gather(short, long), timeout=60)  # the old loop waited on the gate
        assert not gate.is_set() and any(e[2] == "release" for e in engine.log)
        idle = asyncio.ensure_future(engine.coordinator.wait_idle())
        await asyncio.sleep(0.2)
        assert not idle.done()  # idle means released: not while a release is unanswered
        gate.set()
        await asyncio.wait_for(idle, timeout=30)
        return done

    short, long = asyncio.run(main())
    assert len(short.token_ids) == 2 and len(long.token_ids) == 40
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_a_loop_that_prefilled_decodes_without_pausing(engine, monkeypatch):
    pauses = []
    sleep = asyncio.sleep

    async def recorded_sleep(delay, *args, **kwargs):
        pauses.append(delay)
        return await sleep(delay, *args, **kwargs)

    monkeypatch.setattr(coordinator_module.asyncio, "sleep", recorded_sleep)

    async def main():
        result = await engine.coordinator.generate(_request(engine, "def f(x):", 12))
        await engine.coordinator.wait_idle()
        return result

    assert len(asyncio.run(main()).token_ids) == 12
    # The loop's pause (5 ms) is for a loop that could do nothing (no KV room, no replica), not for one that just
    # prefilled its only request.
    assert not [delay for delay in pauses if delay > 0]
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


BURST = ["hello", "def f(x):", "1 2 3"]


@pytest.mark.parametrize("window", [0.0, 0.8])
def test_a_burst_within_the_arrival_window_is_prefilled_in_one_step(engine, window):
    engine.coordinator.config.arrival_window_seconds = window

    async def main():
        requests = []
        for i, prompt in enumerate(BURST):
            if i:
                await asyncio.sleep(0.01)  # a burst: each request 10 ms after the last (the window's gap: 100 ms)
            requests.append(asyncio.ensure_future(engine.coordinator.generate(_request(engine, prompt, 12))))
        results = await asyncio.gather(*requests)
        await engine.coordinator.wait_idle()
        return results

    burst = asyncio.run(main())
    prefills = [handles for kind, role, method, handles in engine.log
                if kind == "sent" and role == "target" and method == "prefill"]
    # At once (no window), the first request is prefilled alone; with the window, the burst in one step.
    assert len(prefills[0]) == (3 if window else 1)
    assert sum(len(p) for p in prefills) == 3
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}
    # Speculating, greedy: each output is the target alone's, one request at a time without a window.
    engine.coordinator.config.arrival_window_seconds = 0.0

    async def alone(prompt):
        return await engine.coordinator.generate(engine.request(
            prompt, SamplingParams(max_tokens=12, ignore_eos=True, num_speculative_tokens=0)))

    assert [r.token_ids for r in burst] == [asyncio.run(alone(p)).token_ids for p in BURST]
    assert sum(r.stats.draft_tokens for r in burst) > 0


def test_a_lone_request_waits_one_gap_not_the_whole_window(engine):
    """The window (0.8 s here) ends when no request comes within its eighth (0.1 s) of the last: a lone request's
    prefill waits about that gap, not the window."""
    import time

    def timed(window):
        engine.coordinator.config.arrival_window_seconds = window

        async def main():
            started = time.perf_counter()
            await engine.coordinator.generate(_request(engine, "hello", 4))
            elapsed = time.perf_counter() - started
            await engine.coordinator.wait_idle()
            return elapsed

        return asyncio.run(main())

    timed(0.0)  # warm
    at_once = min(timed(0.0) for _ in range(2))
    waited = timed(0.8)
    engine.coordinator.config.arrival_window_seconds = 0.0
    assert 0.09 <= waited - at_once < 0.5


def test_a_negative_arrival_window_is_refused(tiny_pair):
    from specsplit.services.coordinator.coordinator import CoordinatorConfig

    with pytest.raises(ValueError, match="arrival window"):
        LocalEngine(tiny_pair["target"], tiny_pair["close"], dtype="float64",
                    coordinator_config=CoordinatorConfig(arrival_window_seconds=-1.0))


@pytest.mark.parametrize("limits", [{"max_num_seqs": 0}, {"max_waiting": -1}])
def test_batch_limits_that_no_request_could_pass_are_refused(tiny_pair, limits):
    from specsplit.services.coordinator.coordinator import CoordinatorConfig

    with pytest.raises(ValueError, match="max_num_seqs must be >= 1 and max_waiting >= 0"):
        LocalEngine(tiny_pair["target"], tiny_pair["close"], dtype="float64",
                    coordinator_config=CoordinatorConfig(**limits))


def test_the_arrival_window_is_a_coordinators_flag_in_milliseconds():
    from specsplit.cli import build_parser
    from specsplit.services.service_commands import _coordinator_options

    for argv in (["coordinator", "--target", "t:1"], ["target", "--model", "m", "--coordinate", "--draft", "d:1"]):
        assert _coordinator_options(build_parser().parse_args(argv))["config"].arrival_window_seconds == 0.0
        chosen = build_parser().parse_args([*argv, "--arrival-window-ms", "1.5"])
        assert _coordinator_options(chosen)["config"].arrival_window_seconds == pytest.approx(0.0015)
    with pytest.raises(SystemExit, match="arrival-window-ms"):
        _coordinator_options(build_parser().parse_args(["coordinator", "--target", "t:1", "--arrival-window-ms", "-1"]))
