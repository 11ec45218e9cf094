"""What one benchmark request measured, as the client saw it, and how a client says the server is gone."""

import time
from dataclasses import dataclass, field


class ServerGone(ConnectionError):
    """The server cannot be reached or cannot serve (connection refused or cut, 503 / UNAVAILABLE): the run ends
    with what it has measured."""


@dataclass
class RequestRecord:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds from sending to the first piece of output
    latency: float = 0.0       # seconds from sending to the end of the answer
    itls: list[float] = field(default_factory=list)  # seconds between consecutive pieces of output (streamed chunks)
    # What this server says speculation did (None from a server that does not say): all rounds (target verifications,
    # k = 0 included), draft tokens proposed and accepted.
    rounds: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None


class RequestClock:
    """Times one request: `output()` at each piece of output that arrives, `finish()` at the end."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.start = time.perf_counter()
        self._last: float | None = None

    def output(self) -> None:
        now = time.perf_counter()
        if self._last is None:
            self.record.ttft = now - self.start
        else:
            self.record.itls.append(now - self._last)
        self._last = now

    def finish(self) -> RequestRecord:
        self.record.latency = time.perf_counter() - self.start
        return self.record
