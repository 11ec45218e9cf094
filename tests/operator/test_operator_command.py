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

from specsplit.operator.main import OPERATOR_COMMAND
from specsplit.operator.settings import OperatorConfig, OperatorContext

from dashboard_queries import missing, named_metrics, scrape
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
            samples = await asyncio.to_thread(scrape, f"http://127.0.0.1:{metrics_port}")
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


async def test_metrics_of_a_restarted_operator_say_what_the_status_says() -> None:
    """A new operator process (a restart, the next leader) knows a resource only from the status the last one
    wrote: its metrics read that before it writes anything itself, and its own later writes on top of it."""
    context = OperatorContext.create(OperatorConfig(metrics_port=free_port()))
    url = f"http://127.0.0.1:{context.config.metrics_port}"
    try:
        status = {"target": {"desiredReplicas": 3, "readyReplicas": 2}, "draft": {"desiredReplicas": 1},
                  "canary": {"model": "m", "weight": 25, "phase": "Progressing"}}
        body = {"metadata": {"uid": "u1", "namespace": "ml", "name": "coder"}, "status": status}
        state = context.state_of(body)
        assert state.roles["target"].desired_replicas == 3 and state.canary.weight == 25
        where = (("name", "coder"), ("namespace", "ml"))
        samples = await asyncio.to_thread(scrape, url)
        assert samples[("specsplit_operator_desired_replicas", (*where, ("role", "target")))] == 3
        assert samples[("specsplit_operator_ready_replicas", (*where, ("role", "target")))] == 2
        assert samples[("specsplit_operator_desired_replicas", (*where, ("role", "draft")))] == 1
        assert ("specsplit_operator_ready_replicas", (*where, ("role", "draft"))) not in samples
        assert samples[("specsplit_operator_canary_weight", where)] == 25

        state.written_status = {"canary": {"weight": 50}}  # this process's own write, the body not yet showing it
        assert (await asyncio.to_thread(scrape, url))[("specsplit_operator_canary_weight", where)] == 50
        state.deleted = True
        assert not any(name.startswith("specsplit_operator_") for name, _ in await asyncio.to_thread(scrape, url))
    finally:
        await context.close()
