"""Test harness of the operator: a Kubernetes API over real HTTP (kmock's emulator), the real kopf operator
running against it, and real HTTP servers standing in for the services' metrics and canary endpoints.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import pathlib
import threading
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import kopf
import yaml

from specsplit.operator import naming, rbac
from specsplit.operator.handlers import register
from specsplit.operator.settings import OperatorConfig

CRD_DIR = pathlib.Path(__file__).resolve().parents[2] / "operator" / "crd"
SCRAPES_DIR = pathlib.Path(__file__).resolve().parent / "scrapes"
NAMESPACE = "ml"
SD = f"{naming.API_VERSION}/{naming.PLURAL}"
WRITE_ACTIONS = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)


@attrs.define(kw_only=True)
class SpecsplitEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the bits of API-server bookkeeping kopf relies on.

    kmock stores objects as plain JSON. A real API server also assigns uid, creationTimestamp and a new
    resourceVersion on every write (kopf's JSON-patches test it), bumps metadata.generation when the spec
    changes, filters lists by labelSelector, and starts a watch after the resourceVersion of the list it
    follows (so a watch does not replay stale states). These are added here, mostly by rewriting the
    incoming request before kmock applies it, as kmock's documentation suggests ("inherit and implement").
    """
    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_version: int = attrs.field(default=0, init=False)

    def _next_version(self) -> str:
        self._last_version = next(self._versions)
        return str(self._last_version)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        data = request.data
        if request.resource is not None and request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            meta["generation"] = 1
            meta["resourceVersion"] = self._next_version()
        elif request.resource is not None and request.action == kmock.action.UPDATE and request.name:
            version = self._next_version()
            key = (request.resource, request.namespace, request.name)
            current = self.objects[key].raw if key in self.objects and not self.objects[key].deleted else {}
            generation = current.get("metadata", {}).get("generation", 1)
            if isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = version
                if request.subresource is None and "spec" in data \
                        and _merged(current, data).get("spec") != current.get("spec"):
                    meta["generation"] = generation + 1
            elif isinstance(data, list):
                _check_json_patch_tests(current, data)
                data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
                if any(op.get("path", "").startswith("/spec") for op in data):
                    data.append({"op": "add", "path": "/metadata/generation", "value": generation + 1})
        elif request.resource is not None and request.action == kmock.action.DELETE and request.name:
            key = (request.resource, request.namespace, request.name)
            if key in self.objects and not self.objects[key].deleted:
                # The deletion (or the deletionTimestamp it sets) is a change with a version of its own.
                self.objects[key].patch({"metadata": {"resourceVersion": self._next_version()}})
        return await super()._handle(request)

    async def _serve_watch(self, request: kmock.Request) -> Any:
        """kmock's watch, except that the initial replay skips objects not newer than ?resourceVersion=."""
        since = request.params.get("resourceVersion", "")
        floor = int(since) if since.isdigit() else 0
        yield b""
        async with self._lock:
            current = [obj.raw for obj in self._KubernetesEmulator__get_objs(request, strict=False)
                       if not obj.deleted]
        for raw in current:
            if int(raw.get("metadata", {}).get("resourceVersion") or 0) > floor:
                yield {"type": "ADDED", "object": raw}
        async for event in self._buses[request.resource]:
            meta = event.get("object", {}).get("metadata", {})
            if self._KubernetesEmulator__check(request, request.resource, meta.get("namespace"), meta.get("name"),
                                               strict=False):
                yield event

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        result["metadata"] = {"resourceVersion": str(self._last_version)}
        selector = request.params.get("labelSelector")
        if selector:
            wanted = dict(term.split("=", 1) for term in selector.split(","))
            result["items"] = [item for item in result["items"]
                               if all((item.get("metadata", {}).get("labels") or {}).get(key) == value
                                      for key, value in wanted.items())]
        return result

    def writes(self, since: int = 0, resources: tuple[str, ...] | None = None) -> list[kmock.Request]:
        """Write requests (create, patch, delete) after the first `since` requests, optionally of some resources."""
        chosen = []
        for request in list(self)[since:]:
            if request.action in WRITE_ACTIONS and request.resource is not None:
                plural = request.resource.plural
                if resources is None or plural in resources:
                    chosen.append(request)
        return chosen


def _check_json_patch_tests(current: dict[str, Any], operations: list[dict[str, Any]]) -> None:
    """A failed `test` operation is a conflict the client must retry: 422 like the API server, not kmock's 500."""
    tests = [op for op in operations if op.get("op") == "test"]
    try:
        jsonpatch.apply_patch(current, tests, in_place=False)
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as error:
        raise kmock.KubernetesError(status=422, reason="Invalid", message=str(error)) from None


def _merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    result = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _merged(result[key], value)
        elif value is None:
            result.pop(key, None)
        else:
            result[key] = value
    return result


class FakeClock:
    """The operator's clock in tests: the scaling windows and cooldowns pass when the test says so."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class Cluster:
    """Helpers over the emulator: what a user (or a controller the emulator lacks) would do over HTTP."""

    def __init__(self, emulator: SpecsplitEmulator) -> None:
        self.api = emulator

    def url(self, kind: str, name: str | None = None, subresource: str | None = None,
            namespace: str = NAMESPACE) -> str:
        api_version, plural = {"sd": (naming.API_VERSION, naming.PLURAL), "deploy": ("apps/v1", "deployments"),
                               "svc": ("v1", "services"), "cm": ("v1", "configmaps"), "pod": ("v1", "pods"),
                               "event": ("v1", "events")}[kind]
        root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        url = f"{root}/namespaces/{namespace}/{plural}"
        return url + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")

    async def create(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.api.post(self.url(kind), json=body)
        assert response.status < 300, await response.text()
        return await response.json()

    async def patch(self, kind: str, name: str, patch: dict[str, Any], subresource: str | None = None) -> None:
        response = await self.api.patch(self.url(kind, name, subresource), json=patch,
                                        headers={"Content-Type": "application/merge-patch+json"})
        assert response.status < 300, await response.text()

    async def delete(self, kind: str, name: str) -> None:
        response = await self.api.delete(self.url(kind, name))
        assert response.status < 300, await response.text()

    async def get(self, kind: str, name: str) -> dict[str, Any] | None:
        response = await self.api.get(self.url(kind, name))
        if response.status == 404:
            return None
        assert response.status < 300, await response.text()
        return await response.json()

    async def list(self, kind: str) -> list[dict[str, Any]]:
        response = await self.api.get(self.url(kind))
        return (await response.json())["items"]

    async def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        return [event for event in await self.list("event") if reason is None or event.get("reason") == reason]

    async def create_deployment_resource(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return await self.create("sd", {"apiVersion": naming.API_VERSION, "kind": naming.KIND,
                                        "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec})

    async def add_pod(self, instance: str, component: str, index: int, port: int, ip: str = "127.0.0.1",
                      other_ports: dict[str, int] | None = None) -> None:
        """What the Deployment controller and kubelet would do: a Running pod with an IP and a metrics port (and
        `other_ports`, by name: a co-located coordinator's `coord-metrics`)."""
        ports = [{"name": "metrics", "containerPort": port}]
        ports += [{"name": name, "containerPort": number} for name, number in (other_ports or {}).items()]
        await self.create("pod", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{instance}-{component}-{index}", "namespace": NAMESPACE,
                         "labels": naming.labels(instance, component)},
            "spec": {"containers": [{"name": component, "image": "x", "ports": ports}]},
            "status": {"phase": "Running", "podIP": ip},
        })


async def eventually(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll an (async) check until it returns a truthy value; the operator works in the background."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if asyncio.iscoroutine(last):
                last = await last
            if last:
                return last
            error: Exception | None = None
        except AssertionError as failure:
            error = failure
        if asyncio.get_running_loop().time() > deadline:
            if error is not None:
                raise error
            raise AssertionError(f"not reached in {timeout}s; last: {last!r}")
        await asyncio.sleep(interval)


def base_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "image": "registry.example/specsplit:0.1.0",
        "numSpeculativeTokens": 5,
        "target": {"model": "qwen2.5-coder-1.5b-instruct", "replicas": {"min": 1, "max": 5},
                   "resources": {"gpus": 1, "requests": {"cpu": "2", "memory": "8Gi"}}},
        "draft": {"model": "qwen2.5-coder-0.5b-instruct", "replicas": {"min": 1, "max": 4},
                  "resources": {"gpus": 1}},
        "autoscaling": {"intervalSeconds": 10, "stabilizationWindowSeconds": 60, "scaleDownCooldownSeconds": 30,
                        "maxStep": 2},
    }
    spec.update(overrides)
    return spec


async def prepare_api(api: SpecsplitEmulator) -> None:
    """Serve the built-in resources, the CRDs the chart installs, and the peering object it creates."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # kmock reads its bundled file the old way
        api.resources.load_bundled()
    crd = yaml.safe_load((CRD_DIR / "speculativedeployment.yaml").read_text())
    api.resources[SD] = kmock.ResourceInfo(
        kind=naming.KIND, singular=naming.SINGULAR, namespaced=True, shortnames=set(crd["spec"]["names"]["shortNames"]),
        verbs={"get", "list", "watch", "create", "patch", "delete"},
        subresources=set(crd["spec"]["versions"][0]["subresources"]))
    for peering in yaml.safe_load_all((CRD_DIR / "kopf-peering.yaml").read_text()):
        names = peering["spec"]["names"]
        api.resources[f"kopf.dev/v1/{names['plural']}"] = kmock.ResourceInfo(
            kind=names["kind"], singular=names["singular"], namespaced=peering["spec"]["scope"] == "Namespaced",
            verbs={"get", "list", "watch", "patch", "create"})
    # The operator runs cluster-wide, so its peering object is a ClusterKopfPeering.
    response = await api.post("/apis/kopf.dev/v1/clusterkopfpeerings", json={
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "specsplit"}})
    assert response.status == 200


def write_kubeconfig(path: pathlib.Path, api: SpecsplitEmulator) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": str(api.url).rstrip("/")}}],
        "users": [{"name": "test", "user": {"token": "test-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": NAMESPACE}}],
    }))


class RunningOperator:
    """The real kopf operator (kopf.operator) with the production handlers, in a thread of its own.

    A thread, as kopf's own KopfRunner does: when kopf.operator() exits, it cancels every task created in its
    event loop after it started, which in the test's loop would include pytest's own teardown.
    """

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.decisions: list[tuple[Any, ...]] = []
        self.config = OperatorConfig(tick_seconds=0.05, scrape_timeout_seconds=2.0, clock=clock,
                                     peering_priority=100,
                                     decision_listeners=[lambda *record: self.decisions.append(record)])
        self.memo = kopf.Memo()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    def _run(self, ready: threading.Event) -> None:
        registry = kopf.OperatorRegistry()
        register(registry, self.config)
        settings = kopf.OperatorSettings()
        settings.queueing.idle_timeout = 0.5
        settings.queueing.exit_timeout = 0.5
        settings.watching.reconnect_backoff = 0.1
        try:
            asyncio.run(kopf.operator(registry=registry, settings=settings, memo=self.memo, clusterwide=True,
                                      stop_flag=self._stop, ready_flag=ready))
        except BaseException as error:  # reported by alive()/stop()
            self._error = error

    async def start(self) -> None:
        self.memo = kopf.Memo()  # a restart is a new process: nothing carried over but what is in the cluster
        ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        assert await asyncio.to_thread(ready.wait, 10), "the operator did not start"

    async def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            await asyncio.to_thread(self._thread.join, 10)
            assert not self._thread.is_alive(), "the operator did not stop"
            self._thread = None
        if self._error is not None:
            raise self._error

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def decisions_at(self, what: str, now: float) -> list[Any]:
        return [record[4] for record in list(self.decisions) if record[2] == what and record[3] == now]


def operator_calls(emulator: SpecsplitEmulator) -> list[tuple[str, str, str]]:
    """(api group, resource[/subresource], verb) of every API call made by the operator (kopf's or its own)."""
    calls = []
    for request in list(emulator):
        agent = request.headers.get("User-Agent", "")
        if not (agent.startswith("kopf/") or agent.startswith("specsplit-operator")):
            continue
        if request.resource is None or request.resource.plural is None:
            continue  # discovery (/api, /apis/GROUP/VERSION): open to every authenticated client
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        verb = {kmock.action.LIST: "list", kmock.action.WATCH: "watch", kmock.action.FETCH: "get",
                kmock.action.CREATE: "create", kmock.action.UPDATE: "patch",
                kmock.action.DELETE: "delete"}[request.action]
        calls.append((request.resource.group or "", resource, verb))
    return calls


def assert_rbac_allows(calls: list[tuple[str, str, str]]) -> None:
    denied = {call for call in calls
              if not any(call[0] in rule["apiGroups"] and call[1] in rule["resources"] and call[2] in rule["verbs"]
                         for rule in rbac.RULES)}
    assert not denied, f"calls outside operator/rbac.py: {sorted(denied)}"


class ReplayServer:
    """A local HTTP server replaying recorded scrapes: one listening port per pod, like a pod's metrics port.

    GET /metrics returns the recording currently assigned to that pod; GET /v1/canary the assigned JSON.
    The recordings in scrapes/ are Prometheus text expositions as prometheus_client writes them, with the
    services' metric names (gauges per role, the stage-latency histogram with its buckets, sum and count).
    """

    def __init__(self) -> None:
        self.metrics: dict[int, str] = {}
        self.canary: dict[int, Any] = {}
        self.hits: dict[int, int] = {}
        self._runner: aiohttp.web.AppRunner | None = None

    @staticmethod
    def recording(name: str) -> str:
        return (SCRAPES_DIR / f"{name}.prom").read_text()

    async def _handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        port = request.transport.get_extra_info("sockname")[1]
        self.hits[port] = self.hits.get(port, 0) + 1
        if request.path == "/metrics" and port in self.metrics:
            return aiohttp.web.Response(text=self.metrics[port],
                                        content_type="text/plain", charset="utf-8")
        if request.path == "/v1/canary" and port in self.canary:
            return aiohttp.web.Response(text=json.dumps(self.canary[port]), content_type="application/json")
        return aiohttp.web.Response(status=404)

    async def start(self, pods: int) -> list[int]:
        app = aiohttp.web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = aiohttp.web.AppRunner(app, access_log=None)
        await self._runner.setup()
        ports = []
        for _ in range(pods):
            site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        return ports

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
