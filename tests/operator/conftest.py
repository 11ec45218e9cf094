"""Fixtures of the operator's tests; the harness itself is in kube_harness.py."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import kmock
import kopf
import pytest
import pytest_asyncio

from kube_harness import (
    Cluster,
    FakeClock,
    ReplayServer,
    RunningOperator,
    SpecsplitEmulator,
    assert_rbac_allows,
    operator_calls,
    prepare_api,
    write_kubeconfig,
)


@pytest_asyncio.fixture()
async def emulator() -> AsyncIterator[SpecsplitEmulator]:
    async with SpecsplitEmulator() as api, kmock.Server(api):
        await prepare_api(api)
        yield api


@pytest.fixture()
def cluster(emulator: SpecsplitEmulator) -> Cluster:
    return Cluster(emulator)


@pytest.fixture()
def kubeconfig(emulator: SpecsplitEmulator, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator logs in the way it does outside a cluster: through a kubeconfig naming the API's URL."""
    write_kubeconfig(tmp_path / "kubeconfig", emulator)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    # The service-account login must not pick up an in-cluster token, were this machine to have one.
    monkeypatch.setattr(kopf, "login_with_service_account", lambda **_: None)


@pytest_asyncio.fixture()
async def operator(emulator: SpecsplitEmulator, kubeconfig: None) -> AsyncIterator[RunningOperator]:
    running = RunningOperator(FakeClock())
    await running.start()
    yield running
    await running.stop()
    # Every test that runs the operator also checks that the RBAC rules cover whatever it called.
    assert_rbac_allows(operator_calls(emulator))


@pytest_asyncio.fixture()
async def replay() -> AsyncIterator[ReplayServer]:
    server = ReplayServer()
    yield server
    await server.close()
