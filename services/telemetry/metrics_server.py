"""Each service's HTTP side port: Prometheus text at /metrics, plus JSON routes (the coordinator's /v1/canary).

A small threaded HTTP server beside the gRPC event loop: scrapes never wait on model work, and what they read
(collectors, canary totals) is safe to read from another thread.
"""

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9090


class MetricsServer:
    def __init__(self, registry, host: str, port: int, json_routes: dict | None = None):
        """port 0 = any free port (see `.port`); json_routes: path -> callable returning a JSON-able object."""
        routes = dict(json_routes or {})

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/metrics":
                        self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                    elif path in routes:
                        self._send(200, "application/json", json.dumps(routes[path]()).encode())
                    elif path in ("/", "/healthz"):
                        self._send(200, "text/plain", b"ok\n")
                    else:
                        self._send(404, "text/plain", b"not found\n")
                except Exception:  # a failing collector must not kill the server thread
                    log.exception("GET %s failed", path)
                    self._send(500, "text/plain", b"internal error\n")

            def _send(self, code, content_type, body):
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes every few seconds would flood the log
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_metrics_server(role: str, registry, host: str, port: int, json_routes: dict | None = None) -> MetricsServer | None:
    """Serve a service's metrics; port < 0 disables them. Prints where, before the service says it is listening."""
    if port is None or port < 0:
        return None
    server = MetricsServer(registry, host, port, json_routes)
    print(f"specsplit {role} metrics on {server.url}/metrics", flush=True)
    return server
