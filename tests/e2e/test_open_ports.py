"""What a service shows on the network by default, with real processes: metrics and canary HTTP on loopback unless
--metrics-host says otherwise, and a worker open to unauthenticated callers tells them its model's name, not where
its files are."""

import urllib.request

import pytest

from specsplit.services.service_commands import spawn_service
from test_worker_auth import _describe


@pytest.fixture(scope="module")
def open_worker(tiny_pair):
    worker, address = spawn_service(["target", "--model", str(tiny_pair["target"]), "--dtype", "float64", "--host", "0.0.0.0",
                                     "--port", "0", "--allow-unauthenticated", "--metrics-port", "0", "--num-kv-blocks", "64"])
    coordinator, _ = spawn_service(["coordinator", "--target", address.replace("0.0.0.0", "127.0.0.1"), "--host", "127.0.0.1",
                                    "--port", "0", "--metrics-port", "0", "--metrics-host", "0.0.0.0",
                                    "--tokenizer", str(tiny_pair["target"])])
    try:
        yield {"worker": worker, "address": address.replace("0.0.0.0", "127.0.0.1"), "coordinator": coordinator,
               "tiny": tiny_pair}
    finally:
        for p in (worker, coordinator):
            p.terminate()
            p.wait(timeout=20)


def _metrics_port(process) -> tuple[str, int]:
    line = next(l for l in process.startup_lines if " metrics on " in l)
    host, port = line.rsplit("/", 2)[-2].rsplit(":", 1)
    return host, int(port)


def test_metrics_listen_on_loopback_by_default(open_worker, other_host):
    host, port = _metrics_port(open_worker["worker"])
    assert host == "127.0.0.1"
    assert b"specsplit_" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    assert other_host.reach(port) == "refused"


def test_metrics_host_opens_them_where_asked(open_worker, other_host):
    _, port = _metrics_port(open_worker["coordinator"])
    assert other_host.reach(port, "/v1/canary") == "200"


def test_an_open_worker_describes_its_model_by_name_only(open_worker):
    info = _describe(open_worker["address"])
    assert info.model_path == ""
    assert info.model == open_worker["tiny"]["target"].name and "/" not in info.model
