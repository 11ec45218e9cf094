"""The failure throttle's decisions, on an injected clock: how long each failed authentication waits, per address,
side by side, over time; the bounds on what it holds; and its one summary line per window."""

import asyncio
import logging

import pytest

from specsplit.services.rpc.auth_throttle import FailureThrottle, peer_address


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


def answered_one_by_one(throttle, clock, address, count, round_trip=0.05):
    """A client that retries as soon as it is answered, `round_trip` seconds later: the delay of each of its
    `count` failures."""
    delays = []
    for _ in range(count):
        delay = throttle.failed(address)
        clock.now += delay + round_trip
        if delay > 0:
            throttle.answered(address)
        delays.append(delay)
    return delays


def test_a_client_retrying_a_bad_secret_waits_longer_and_longer_up_to_the_cap(clock):
    throttle = FailureThrottle(clock=clock)
    delays = answered_one_by_one(throttle, clock, "10.0.0.7", 12)
    # 3 at once; then 0.1 s doubling, capped at 2 s.
    assert delays == pytest.approx([0, 0, 0, 0.1, 0.2, 0.4, 0.8, 1.6, 2, 2, 2, 2], abs=1e-9)
    assert answered_one_by_one(throttle, clock, "10.0.0.8", 1) == [0]  # another address is not slowed
    # Nor is one retrying at once: answers still come at most 20 a second.
    assert answered_one_by_one(throttle, clock, "10.0.0.9", 3, round_trip=0) == pytest.approx([0, 0.05, 0.05])


def test_failures_sent_side_by_side_are_answered_at_most_20_a_second(clock):
    throttle = FailureThrottle(clock=clock)
    delays = [throttle.failed("10.0.0.7") for _ in range(60)]  # all at the same instant
    answers = sorted(delays)
    assert all(b - a >= 1 / 20 - 1e-9 for a, b in zip(answers, answers[1:]))
    assert sum(d < 1.0 for d in delays) <= 20
    assert max(delays) <= throttle.max_delay + 60 / 20
    assert throttle.waiting == 59  # the first was answered at once


def test_waiting_is_bounded_per_address_and_in_all(clock):
    throttle = FailureThrottle(clock=clock, max_waiting_per_address=8, max_waiting=12)
    first = [throttle.failed("10.0.0.7") for _ in range(20)]
    assert sum(d > 0 for d in first) == 8 and first[9:] == [0.0] * 11  # beyond 8 waiting: answered at once
    other = [throttle.failed("10.0.0.8") for _ in range(10)]
    assert sum(d > 0 for d in other) == 12 - 8 and throttle.waiting == 12  # beyond 12 in all: at once
    for _ in range(8):
        throttle.answered("10.0.0.7")
    assert throttle.waiting == 4 and throttle.failed("10.0.0.7") > 0  # room again


def test_a_quiet_address_is_forgiven(clock):
    throttle = FailureThrottle(clock=clock)
    answered_one_by_one(throttle, clock, "10.0.0.7", 10)
    clock.now += 10 * 60  # ten half-lives: a score of ~10 is down to ~0.01
    assert answered_one_by_one(throttle, clock, "10.0.0.7", 3) == [0, 0, 0]
    assert throttle.failed("10.0.0.7") == pytest.approx(0.1, rel=0.2)


def test_memory_stays_bounded_under_a_spray_of_addresses(clock):
    throttle = FailureThrottle(clock=clock, max_addresses=1000)
    for i in range(20_000):
        throttle.failed(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
        clock.now += 0.001
    assert throttle.tracked_addresses() == 1000
    assert len(throttle._window_failures) <= 1000 and throttle._window_others == 19_000
    assert "19000 from addresses beyond the 1000" in throttle.summary()


def test_one_summary_line_per_window_says_how_many_failed_from_where(clock, caplog):
    throttle = FailureThrottle(clock=clock)
    with caplog.at_level(logging.WARNING, logger="specsplit.services.rpc.auth_throttle"):
        for address, count in (("10.0.0.7", 40), ("10.0.0.8", 3), ("::1", 1)):
            for _ in range(count):
                throttle.failed(address)
                clock.now += 0.01
        assert caplog.records == []  # nothing per failure
        clock.now += 60
        throttle.failed("10.0.0.9")  # the first failure of the next window logs the last one's line
        assert [r.getMessage() for r in caplog.records] == [
            "44 failed authentication attempts in the last 60 s: 40 from 10.0.0.7, 3 from 10.0.0.8, 1 from ::1"]
        clock.now += 120
        throttle.log_summary(clock.now)
        assert caplog.records[-1].getMessage() == "1 failed authentication attempts in the last 60 s: 1 from 10.0.0.9"
        clock.now += 120
        throttle.log_summary(clock.now)
        assert len(caplog.records) == 2  # a window without failures says nothing


def test_on_a_server_the_line_comes_when_the_window_ends(caplog):
    async def main():
        throttle = FailureThrottle(log_window=0.2)
        throttle.failed("10.0.0.7")
        throttle.failed("10.0.0.7")
        await asyncio.sleep(0.5)

    with caplog.at_level(logging.WARNING, logger="specsplit.services.rpc.auth_throttle"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == [
        "2 failed authentication attempts in the last 0.2 s: 2 from 10.0.0.7"]


def test_the_wait_is_an_asyncio_sleep_that_frees_its_place_when_the_caller_leaves():
    async def main():
        throttle = FailureThrottle(free_failures=0, first_delay=0.5)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.ensure_future(ticker())
        waiting = asyncio.ensure_future(throttle.slow_down("10.0.0.7"))
        await asyncio.sleep(0.2)
        assert not waiting.done() and throttle.waiting == 1 and ticks >= 5  # the loop went on meanwhile
        waiting.cancel()  # the caller hung up
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert throttle.waiting == 0
        ticking.cancel()

    asyncio.run(main())


@pytest.mark.parametrize("peer,address", [("ipv4:10.0.0.7:51234", "10.0.0.7"), ("ipv6:[::1]:51234", "::1"),
                                          ("ipv6:[2001:db8::7]:443", "2001:db8::7"), ("", "?"), (None, "?")])
def test_a_peer_is_its_address_without_the_port(peer, address):
    assert peer_address(peer) == address
