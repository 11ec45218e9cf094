"""Failed authentication is slowed per address; valid credentials never are.

Behind a Kubernetes Service, an ingress or a NAT many clients arrive from a few addresses, so an address is no
identity: a call with a valid token or worker secret is served at once whatever else its address sends, and the
throttle never hears of it. Only failures reach the throttle, which says how long each waits before its
UNAUTHENTICATED answer:

- every failure adds 1 to its address's score, which halves every HALF_LIFE_SECONDS;
- while the score (rounded) is at most FREE_FAILURES the answer comes at once (a typo, a client restarted with an
  old token); then after FIRST_DELAY_SECONDS, doubling with each point of score, up to MAX_DELAY_SECONDS: a client
  retrying a bad token in a loop is answered at once 3 times, then after 0.1, 0.2, 0.4, 0.8, 1.6, 2, 2, ... s;
- below the waiting bounds, an address gets at most MAX_ANSWERS_PER_SECOND failure answers a second: a failure
  also waits for its address's next free answer slot, so failures sent side by side queue instead of coming back
  together;
- at most MAX_WAITING_PER_ADDRESS failures of one address and MAX_WAITING of all wait at a time, and at most
  MAX_ADDRESSES addresses are remembered (the one that failed longest ago is forgotten first): memory stays
  bounded under a flood or a spray of addresses. A failure beyond a waiting bound is answered at once: holding it
  would cost more than answering it.
- once per LOG_WINDOW_SECONDS, when there were failures, one log line says how many came from which addresses.

The wait is an asyncio sleep: it holds no thread, and calls with valid credentials on the same connection pass it.
Every call's credentials are compared (a valid one has to be recognised to be served at once), so what is bounded
per address is the answers to failures, not the comparisons (a few hundred nanoseconds each), and a caller that
sends guesses side by side is not slowed in guessing. That is why secrets and tokens have a minimum length
(worker_credentials.MIN_SECRET_CHARS; generated ones are 256 bits): guessing is hopeless at any rate, and what this
bounds is the work and the log lines a client with a stale token, or a hostile one, costs.
"""

import asyncio
import logging
import time

log = logging.getLogger(__name__)

HALF_LIFE_SECONDS = 60.0
FREE_FAILURES = 3
FIRST_DELAY_SECONDS = 0.1
MAX_DELAY_SECONDS = 2.0
MAX_ANSWERS_PER_SECOND = 20
MAX_WAITING_PER_ADDRESS = 64
MAX_WAITING = 1024
MAX_ADDRESSES = 10_000
LOG_WINDOW_SECONDS = 60.0
LOGGED_ADDRESSES = 5  # the summary names the addresses with the most failures; the rest are counted


def peer_address(peer: str | None) -> str:
    """'ipv4:10.0.0.7:51234' or 'ipv6:[::1]:51234' -> the address without the port."""
    if not peer:
        return "?"
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    if address.startswith("["):
        return address[1 : address.find("]")]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


class _Address:
    __slots__ = ("score", "scored_at", "next_answer", "waiting")

    def __init__(self, now: float):
        self.score, self.scored_at, self.next_answer, self.waiting = 0.0, now, now, 0


class FailureThrottle:
    """Decides how long each failed authentication waits (`failed`), waits it (`slow_down`), and logs a summary
    per window. `clock` is injectable so that the decisions can be tested without waiting."""

    def __init__(self, half_life=HALF_LIFE_SECONDS, free_failures=FREE_FAILURES, first_delay=FIRST_DELAY_SECONDS,
                 max_delay=MAX_DELAY_SECONDS, max_answers_per_second=MAX_ANSWERS_PER_SECOND,
                 max_waiting_per_address=MAX_WAITING_PER_ADDRESS, max_waiting=MAX_WAITING, max_addresses=MAX_ADDRESSES,
                 log_window=LOG_WINDOW_SECONDS, clock=time.monotonic):
        self.half_life, self.free_failures = half_life, free_failures
        self.first_delay, self.max_delay = first_delay, max_delay
        self.answer_spacing = 1.0 / max_answers_per_second
        self.max_waiting_per_address, self.max_waiting = max_waiting_per_address, max_waiting
        self.max_addresses = max_addresses
        self.log_window, self.clock = log_window, clock
        self.waiting = 0  # failures waiting now, all addresses together
        self._addresses: dict[str, _Address] = {}  # least recently failed first
        self._window_started = clock()
        self._window_failures: dict[str, int] = {}  # this log window's failures per address (at most max_addresses)
        self._window_others = 0  # failures from addresses beyond that bound
        self._window_unslowed = 0  # failures answered at once because a waiting bound was reached
        self._summary_scheduled = False

    def delay_after(self, score: float) -> float:
        """The back-off of a failure that brought its address's score to `score` (rounded to the nearest failure)."""
        failures = int(score + 0.5)
        if failures <= self.free_failures:
            return 0.0
        return min(self.max_delay, self.first_delay * 2.0 ** (failures - self.free_failures - 1))

    def failed(self, address: str) -> float:
        """Count a failure from `address`; returns the seconds to wait before answering it. A positive answer
        counts the failure as waiting until `answered(address)` is called."""
        now = self.clock()
        self._count_for_summary(address, now)
        state = self._addresses.pop(address, None) or _Address(now)
        self._addresses[address] = state  # most recently failed last
        if len(self._addresses) > self.max_addresses:
            del self._addresses[next(iter(self._addresses))]
        state.score = state.score * 0.5 ** ((now - state.scored_at) / self.half_life) + 1.0
        state.scored_at = now
        if state.waiting >= self.max_waiting_per_address or self.waiting >= self.max_waiting:
            self._window_unslowed += 1
            return 0.0
        answer_at = max(now + self.delay_after(state.score), state.next_answer)
        state.next_answer = answer_at + self.answer_spacing
        delay = answer_at - now
        if delay > 0:
            state.waiting += 1
            self.waiting += 1
        return delay

    def answered(self, address: str) -> None:
        """A waiting failure was answered (or its caller left)."""
        self.waiting -= 1
        state = self._addresses.get(address)
        if state is not None and state.waiting > 0:
            state.waiting -= 1

    async def slow_down(self, address: str) -> None:
        """Wait as long as `failed(address)` says, without holding a thread."""
        delay = self.failed(address)
        if delay > 0:
            try:
                await asyncio.sleep(delay)
            finally:
                self.answered(address)

    def tracked_addresses(self) -> int:
        return len(self._addresses)

    # ---- the summary line ---------------------------------------------------------------------------------------

    def _count_for_summary(self, address: str, now: float) -> None:
        if now - self._window_started >= self.log_window:
            self.log_summary(now)
        if not self._window_failures and not self._window_others:
            self._window_started = now
            self._schedule_summary()
        if address in self._window_failures or len(self._window_failures) < self.max_addresses:
            self._window_failures[address] = self._window_failures.get(address, 0) + 1
        else:
            self._window_others += 1

    def _schedule_summary(self) -> None:
        # On a server the line comes when the window ends, not only when a later failure arrives.
        if self._summary_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no event loop (a test driving the clock): the first failure after the window logs it
        self._summary_scheduled = True
        loop.call_later(self.log_window - (self.clock() - self._window_started), self._summary_due)

    def _summary_due(self) -> None:
        self._summary_scheduled = False
        ends = self._window_started + self.log_window
        if self.clock() >= ends - 0.01:  # a timer may fire a hair early
            self.log_summary(max(self.clock(), ends))
        elif self._window_failures or self._window_others:  # a later failure already began another window
            self._schedule_summary()

    def summary(self) -> str | None:
        """This window's failures in one line (None when there were none)."""
        total = sum(self._window_failures.values()) + self._window_others
        if total == 0:
            return None
        worst = sorted(self._window_failures.items(), key=lambda item: -item[1])[:LOGGED_ADDRESSES]
        rest = len(self._window_failures) - len(worst)
        line = (f"{total} failed authentication attempts in the last {self.log_window:g} s: "
                + ", ".join(f"{n} from {a}" for a, n in worst) + (f", and from {rest} more addresses" if rest else ""))
        if self._window_others:
            line += f", and {self._window_others} from addresses beyond the {self.max_addresses} counted one by one"
        if self._window_unslowed:
            line += f"; {self._window_unslowed} answered without waiting (too many were waiting)"
        return line

    def log_summary(self, now: float) -> None:
        """At the end of a window: log its line (when it had failures) and start the next."""
        if now - self._window_started < self.log_window:
            return
        line = self.summary()
        if line is not None:
            log.warning("%s", line)
        self._window_failures, self._window_others, self._window_unslowed = {}, 0, 0
        self._window_started = now
