"""The operator as its Deployment runs it: `kopf run` on specsplit.operator.main, in a process of its own,
with peering, a liveness endpoint, its own Prometheus metrics (those the Grafana dashboard reads), and a clean exit
on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import socket
import sys

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specsplit.operator.main import OPERATOR_COMMAND

from dashboard_queries import missing, named_metrics
from kube_harness import Cluster, base_spec, eventually

pytestmark = pytest.mark.asyncio


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_kopf_run_serves_resources_and_stops_on_sigterm(cluster: Cluster, kubeconfig: None,
                                                              tmp_path: pathlib.Path) -> None:
    port, metrics_port = free_port(), free_port()
    assert OPERATOR_COMMAND[:4] == ["kopf", "run", "--module", "specsplit.operator.main"]
    command = [sys.executable, "-m", "kopf", *OPERATOR_COMMAND[1:-1], f"--liveness=http://127.0.0.1:{port}/healthz"]
    env = {**os.environ, "SPECSPLIT_OPERATOR_TICK_SECONDS": "0.2", "SPECSPLIT_OPERATOR_PRIORITY": "7",
           "SPECSPLIT_OPERATOR_METRICS_PORT": str(metrics_port)}
    log = (tmp_path / "operator.log").open("wb")
    process = await asyncio.create_subprocess_exec(*command, env=env, stdout=log, stderr=asyncio.subprocess.STDOUT)
    try:
        async def alive() -> bool:
            assert process.returncode is None, (tmp_path / "operator.log").read_text()[-3000:]
            try:
                async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/healthz") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False
        await eventually(alive, timeout=30, interval=0.2)
        assert process.returncode is None, (tmp_path / "operator.log").read_text()[-3000:]
        await cluster.create_deployment_resource("coder", base_spec())
        target = await eventually(lambda: cluster.get("deploy", "coder-target"), timeout=20)
        assert target["spec"]["template"]["spec"]["containers"][0]["command"][:2] == ["specsplit", "target"]

        response = await cluster.api.get("/apis/kopf.dev/v1/clusterkopfpeerings/specsplit")
        peers = (await response.json()).get("status") or {}
        assert [peer["priority"] for peer in peers.values()] == [7]

        async def operator_metrics() -> dict | None:
            async with aiohttp.ClientSession() as session, \
                    session.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                text = await r.text()
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for family in text_string_to_metric_families(text) for s in family.samples}
            return samples if any(name == "specsplit_operator_ready_replicas" for name, _ in samples) else None

        samples = await eventually(operator_metrics, timeout=20, interval=0.2)
        where = (("name", "coder"), ("namespace", "ml"))
        assert samples[("specsplit_operator_desired_replicas", (*where, ("role", "target")))] == 1  # replicas.min
        assert samples[("specsplit_operator_desired_replicas", (*where, ("role", "draft")))] == 1
        assert samples[("specsplit_operator_canary_weight", where)] == 0  # no canary
        read = named_metrics(operator=True)  # every operator metric the Grafana dashboard reads is exported
        assert len(read) == 3 and missing(read, [samples]) == []
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 30)
        log.close()
    assert code == 0, (tmp_path / "operator.log").read_text()[-3000:]
