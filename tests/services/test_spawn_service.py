"""Starting a service process (services/service_commands.spawn_service): a start that never listens is stopped the
way stop_processes stops one, SIGTERM first, so a `serve` given up on stops the services it started."""

import queue
import subprocess

import pytest

from specsplit.services import service_commands


class NeverListens:
    """A started process that prints nothing until it is stopped; notes how it was stopped."""

    def __init__(self, *args, **kwargs):
        self.lines: queue.Queue = queue.Queue()
        self.signals: list[str] = []
        self.returncode = None
        self.stdout = iter(self.lines.get, None)

    def _end(self, how: str, code: int) -> None:
        self.signals.append(how)
        self.returncode = code
        self.lines.put(None)

    def terminate(self):
        self._end("SIGTERM", 0)

    def kill(self):
        self._end("SIGKILL", -9)

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            raise subprocess.TimeoutExpired("specsplit", timeout)
        return self.returncode


def test_a_start_that_never_listens_is_terminated_not_killed(monkeypatch):
    started = []
    monkeypatch.setattr(service_commands.subprocess, "Popen", lambda *a, **k: started.append(NeverListens()) or started[-1])
    with pytest.raises(TimeoutError, match="not listening after 0.2s"):
        service_commands.spawn_service(["serve"], timeout=0.2)
    assert started[0].signals == ["SIGTERM"]  # serve's own handler then stops its target, draft and coordinator
