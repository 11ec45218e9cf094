"""A `specsplit serve` in its own process for benchmarks and tests: started with free ports, its addresses read
from what it prints (the gRPC address, the OpenAI API's URL, each service's metrics URL), stopped with SIGTERM.

    with ServeProcess(["--target", TARGET, "--draft", DRAFT]) as served:
        run `specsplit bench serve --url {served.http_url}` or `--grpc {served.address}`
"""

import os
import subprocess
import threading

from specsplit.services.service_commands import printed, spawn_service, stop_processes


class ServeProcess:
    def __init__(self, serve_args: list[str], env: dict | None = None, http: bool = True, metrics: bool = True,
                 startup_timeout: float = 900.0):
        self.argv = ["serve", "--host", "127.0.0.1", "--port", "0", "--http-port", "0" if http else "-1",
                     "--metrics-port", "0" if metrics else "-1", *serve_args]
        self.env = {**os.environ, **env} if env else None
        self.wants_http = http
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self.lines: list[str] = []  # everything it printed (stdout and stderr), as it came
        self.address: str | None = None  # the coordinator's gRPC HOST:PORT
        self._changed = threading.Condition()
        self._reading = True

    def start(self) -> "ServeProcess":
        self.process, self.address = spawn_service(self.argv, self.env, stderr=subprocess.STDOUT,
                                                   timeout=self.startup_timeout)
        self.lines = self.process.startup_lines
        threading.Thread(target=self._read, daemon=True).start()  # drains the pipe for the process's whole life
        with self._changed:  # serve prints the API's URL just after its address
            self._changed.wait_for(lambda: not self.wants_http or self.http_url or not self._reading,
                                   self.startup_timeout)
        if self.wants_http and not self.http_url:
            status = self.stop()
            raise RuntimeError(f"`specsplit serve` printed no OpenAI API URL (exit status {status}):\n"
                               + "\n".join(self.lines[-30:]))
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._reading = False
            self._changed.notify_all()

    @property
    def http_url(self) -> str | None:
        """The OpenAI API's base URL (http://HOST:PORT/v1)."""
        return printed(self.lines, " OpenAI API on ")

    def metrics_url(self, role: str = "coordinator") -> str | None:
        """http://HOST:PORT of a service's metrics (role: coordinator, target or draft)."""
        found = printed(self.lines, " metrics on ", prefix=f"specsplit {role} ")
        return found.removesuffix("/metrics") if found else None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (serve stops its services in order), then SIGKILL after `timeout`; returns the exit status."""
        if self.process is None:
            return None
        stop_processes([self.process], timeout)
        return self.process.returncode

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
