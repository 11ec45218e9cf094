"""A `specsplit serve` in its own process for benchmarks and tests: started with free ports, its addresses read
from what it prints (the gRPC address, the OpenAI API's URL, each service's metrics URL), stopped with SIGTERM.

    with ServeProcess(["--target", TARGET, "--draft", DRAFT]) as served:
        run `specsplit bench serve --url {served.http_url}` or `--grpc {served.address}`
"""

import os
import signal
import subprocess
import sys
import threading
import time


class ServeProcess:
    def __init__(self, serve_args: list[str], env: dict | None = None, http: bool = True, metrics: bool = True,
                 startup_timeout: float = 900.0):
        self.argv = [sys.executable, "-m", "specsplit", "serve", "--host", "127.0.0.1", "--port", "0",
                     "--http-port", "0" if http else "-1", "--metrics-port", "0" if metrics else "-1", *serve_args]
        self.env = {**os.environ, **env} if env else None
        self.wants_http = http
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self.lines: list[str] = []  # everything it printed (stdout and stderr), as it came
        self._changed = threading.Condition()
        self._reading = True

    def start(self) -> "ServeProcess":
        self.process = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=self.env)
        threading.Thread(target=self._read, daemon=True).start()  # drains the pipe for the process's whole life
        deadline = time.monotonic() + self.startup_timeout
        with self._changed:
            while not self._ready():
                if self.process.poll() is not None and not self._reading:
                    raise RuntimeError(f"`specsplit serve` exited with {self.process.returncode} before serving:\n"
                                       + "\n".join(self.lines[-30:]))
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"`specsplit serve` not serving after {self.startup_timeout:.0f}s")
                self._changed.wait(0.5)
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._reading = False
            self._changed.notify_all()

    def _ready(self) -> bool:
        return self._found(" serving on ") is not None and (not self.wants_http or self._found(" OpenAI API on ") is not None)

    def _found(self, marker: str, prefix: str = "specsplit") -> str | None:
        for line in self.lines:
            if line.startswith(prefix) and marker in line:
                return line.rsplit(" ", 1)[-1]
        return None

    @property
    def address(self) -> str:
        """The coordinator's gRPC HOST:PORT."""
        return self._found(" serving on ")

    @property
    def http_url(self) -> str | None:
        """The OpenAI API's base URL (http://HOST:PORT/v1)."""
        return self._found(" OpenAI API on ")

    def metrics_url(self, role: str = "coordinator") -> str | None:
        """http://HOST:PORT of a service's metrics (role: coordinator, target or draft)."""
        found = self._found(" metrics on ", prefix=f"specsplit {role} ")
        return found.removesuffix("/metrics") if found else None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (serve stops its services in order), then SIGKILL after `timeout`; returns the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
