"""Reading the services' own numbers: Prometheus text from each pod's metrics port, and the coordinators' /v1/canary.

Pods are found through the API (their IPs and the container port named `metrics`, or a co-located coordinator's
`coord-metrics` in the target pods), then asked directly
over HTTP, without the operator's Kubernetes credentials. A pod that does not answer is left out: the
scaling policy knows how many pods reported and does not scale down on partial data.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from specsplit.operator import naming
from specsplit.operator.kube_client import PODS, KubeClient

logger = logging.getLogger(__name__)

STAGE_OF_ROLE = {naming.DRAFT: "propose", naming.TARGET: "verify"}


@dataclasses.dataclass(frozen=True)
class PodEndpoint:
    name: str
    url: str  # http://IP:PORT


@dataclasses.dataclass(frozen=True)
class PodSample:
    """One scrape of one pod, reduced to what the scaling policy uses."""
    pod: str
    kv_blocks_used: float | None
    kv_blocks_total: float | None
    queue_depth: float | None
    stage_latency_sum: float | None  # cumulative seconds of the role's stage
    stage_latency_count: float | None  # cumulative observations of it


@dataclasses.dataclass(frozen=True)
class RoleMetrics:
    """A pool's metrics as the scaling policy reads them (per-pod averages)."""
    pods_reporting: int
    kv_utilization: float | None
    queue_depth: float | None
    stage_latency_seconds: float | None  # mean over the interval since the previous scrape

    def observed(self, role: str) -> dict[str, float | None]:
        """Keyed by the CRD's metric names of that role."""
        if role == naming.TARGET:
            return {"kvUtilization": self.kv_utilization, "verifyQueueDepth": self.queue_depth}
        return {"proposeQueueDepth": self.queue_depth, "proposeLatencySeconds": self.stage_latency_seconds}


def ready_endpoints(pods: Iterable[Mapping[str, Any]], selector: Mapping[str, str], path: str,
                    port_name: str = "metrics") -> list[PodEndpoint]:
    """Running, not terminating pods with an IP that match the selector; the URL of `path` on their port `port_name`
    (where a pod does not name it, the number the operator gives that name: naming.SCRAPED_PORTS)."""
    endpoints = []
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        pod_labels = meta.get("labels") or {}
        if any(pod_labels.get(key) != value for key, value in selector.items()):
            continue
        if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
            continue
        port = naming.SCRAPED_PORTS[port_name]
        for container in pod.get("spec", {}).get("containers", []):
            for container_port in container.get("ports") or []:
                if container_port.get("name") == port_name:
                    port = int(container_port["containerPort"])
        endpoints.append(PodEndpoint(name=meta.get("name", ""), url=f"http://{status['podIP']}:{port}{path}"))
    return endpoints


def parse_pod_sample(pod: str, text: str, role: str) -> PodSample:
    """Pick the role's gauges and stage-latency histogram out of a Prometheus text exposition."""
    values: dict[str, float] = {}
    stage = STAGE_OF_ROLE.get(role)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name in ("specsplit_kv_blocks_used", "specsplit_kv_blocks_total", "specsplit_queue_depth"):
                if labels.get("role") == role:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
            elif sample.name in ("specsplit_stage_latency_seconds_sum", "specsplit_stage_latency_seconds_count"):
                if labels.get("stage") == stage:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return PodSample(
        pod=pod,
        kv_blocks_used=values.get("specsplit_kv_blocks_used"),
        kv_blocks_total=values.get("specsplit_kv_blocks_total"),
        queue_depth=values.get("specsplit_queue_depth"),
        stage_latency_sum=values.get("specsplit_stage_latency_seconds_sum"),
        stage_latency_count=values.get("specsplit_stage_latency_seconds_count"),
    )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def aggregate(samples: list[PodSample], previous: Mapping[str, PodSample]) -> RoleMetrics:
    """Per-pod averages; the latency is the mean over the interval since `previous` (counters are cumulative)."""
    utilizations = [s.kv_blocks_used / s.kv_blocks_total for s in samples
                    if s.kv_blocks_used is not None and s.kv_blocks_total]
    queues = [s.queue_depth for s in samples if s.queue_depth is not None]
    latency_sum = latency_count = 0.0
    for sample in samples:
        before = previous.get(sample.pod)
        if before is None or None in (sample.stage_latency_sum, sample.stage_latency_count,
                                      before.stage_latency_sum, before.stage_latency_count):
            continue
        count = sample.stage_latency_count - before.stage_latency_count  # type: ignore[operator]
        if count > 0:  # a negative delta is a restarted pod: skip it this once
            latency_sum += sample.stage_latency_sum - before.stage_latency_sum  # type: ignore[operator]
            latency_count += count
    return RoleMetrics(
        pods_reporting=len(samples),
        kv_utilization=_mean(utilizations),
        queue_depth=_mean(queues),
        stage_latency_seconds=latency_sum / latency_count if latency_count else None,
    )


class PodScraper:
    """HTTP GETs to pods, with a short timeout, in parallel."""

    def __init__(self, timeout_seconds: float = 3.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _get(self, endpoint: PodEndpoint, as_json: bool) -> Any:
        if self._closed:
            return None
        try:
            async with self._ensure_session().get(endpoint.url) as response:
                response.raise_for_status()
                return await (response.json() if as_json else response.text())
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            logger.info("scrape of %s (%s) failed: %s", endpoint.name, endpoint.url, error)
            return None

    async def fetch(self, endpoints: list[PodEndpoint], as_json: bool = False) -> dict[str, Any]:
        """Pod name -> body, for the pods that answered."""
        bodies = await asyncio.gather(*(self._get(endpoint, as_json) for endpoint in endpoints))
        return {endpoint.name: body for endpoint, body in zip(endpoints, bodies, strict=True) if body is not None}

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()


async def scrape_role(client: KubeClient, scraper: PodScraper, namespace: str, instance: str,
                      role: str) -> list[PodSample]:
    selector = naming.selector(instance, role)
    pods = await client.list(PODS, namespace, naming.selector_string(instance, role))
    texts = await scraper.fetch(ready_endpoints(pods, selector, "/metrics"))
    samples = []
    for pod, text in texts.items():
        try:
            samples.append(parse_pod_sample(pod, text, role))
        except ValueError as error:
            logger.warning("unparsable metrics from %s: %s", pod, error)
    return samples


async def canary_reports(client: KubeClient, scraper: PodScraper, namespace: str, instance: str,
                         colocated: bool = False) -> list[dict[str, Any]]:
    """The /v1/canary report of every ready coordinator: its own pods', or co-located, every target pod's."""
    component = naming.TARGET if colocated else naming.COORDINATOR
    port_name = naming.COLOCATED_METRICS_PORT_NAME if colocated else "metrics"
    pods = await client.list(PODS, namespace, naming.selector_string(instance, component))
    endpoints = ready_endpoints(pods, naming.selector(instance, component), "/v1/canary", port_name)
    reports = await scraper.fetch(endpoints, as_json=True)
    return [report for report in reports.values() if isinstance(report, dict)]
