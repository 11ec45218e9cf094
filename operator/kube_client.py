"""A small async client for the few Kubernetes REST calls the operator makes itself (aiohttp, JSON merge-patch).

kopf watches and patches the SpeculativeDeployment; the objects it owns are read and written here, with the
same credentials kopf logged in with (a kopf.ConnectionInfo handed over by the login handler).
Only GET, LIST, POST, merge-PATCH and DELETE: nothing needs more, and the RBAC rules stay as narrow.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
import kopf


@dataclasses.dataclass(frozen=True)
class Kind:
    api_version: str  # "v1", "apps/v1", "specsplit.dev/v1alpha1"
    plural: str

    def url(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        url = f"{root}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            url += f"/{name}"
        if subresource is not None:
            url += f"/{subresource}"
        return url


DEPLOYMENTS = Kind("apps/v1", "deployments")
SERVICES = Kind("v1", "services")
CONFIG_MAPS = Kind("v1", "configmaps")
PODS = Kind("v1", "pods")
KIND_OF_MANIFEST = {"Deployment": DEPLOYMENTS, "Service": SERVICES, "ConfigMap": CONFIG_MAPS}


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class KubeClient:
    """One aiohttp session against the API server, (re)connected whenever kopf logs in anew."""

    def __init__(self, connection: kopf.ConnectionInfo | None = None, timeout_seconds: float = 30.0) -> None:
        self._connection = connection
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._closed = False

    def connect(self, connection: kopf.ConnectionInfo) -> None:
        """Use new credentials from the next request on (the old session is closed lazily)."""
        if connection != self._connection:
            self._connection = connection
            old, self._session = self._session, None
            if old is not None:
                asyncio.get_running_loop().create_task(old.close())

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise ApiError(503, "the operator is shutting down")
        if self._connection is None:
            raise ApiError(401, "not logged in yet")
        if self._session is None or self._session.closed:
            info = self._connection
            ssl = info.as_ssl_context() if info.server.startswith("https:") else False
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl),
                headers={**info.as_http_headers(), "User-Agent": "specsplit-operator"},
                timeout=self._timeout,
                proxy=info.proxy_url,
                trust_env=info.trust_env,
            )
        return self._session

    async def _request(self, method: str, url: str, *, json: Any = None, params: dict[str, str] | None = None,
                       content_type: str = "application/json") -> Any:
        session = self._ensure_session()
        assert self._connection is not None
        headers = {"Content-Type": content_type} if json is not None else {}
        async with session.request(method, self._connection.server.rstrip("/") + url, json=json, params=params,
                                   headers=headers) as response:
            if response.status >= 400:
                text = await response.text()
                raise ApiError(response.status, text[:500])
            return await response.json()

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", kind.url(namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, kind: Kind, namespace: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self._request("GET", kind.url(namespace), params=params)
        return list(result.get("items") or [])

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", kind.url(namespace), json=body)

    async def patch(self, kind: Kind, namespace: str, name: str, patch: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        return await self._request("PATCH", kind.url(namespace, name, subresource), json=patch,
                                   content_type="application/merge-patch+json")

    async def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        """Delete with background propagation (pods go with their Deployment); False if it was not there."""
        try:
            await self._request("DELETE", kind.url(namespace, name),
                                json={"kind": "DeleteOptions", "apiVersion": "v1",
                                      "propagationPolicy": "Background"})
            return True
        except ApiError as error:
            if error.status == 404:
                return False
            raise

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None
