"""Operator tests: the resource builders, the reconcilers and the kopf handlers.

Real: the builders, the reconcilers, the kopf handlers running in kopf's real engine (in-process,
on the test's event loop), our aiohttp client, HTTP on loopback, and Kubernetes' OpenAPI schemas
(kubernetes-validate) for every generated object.  Stand-in: the Kubernetes API server — kmock's
in-memory emulator, extended in ``emulator.py`` with the API-server and garbage-collector behaviour
the operator relies on (uids, resourceVersion, generation, status and scale subresources, server-side
apply by one manager, cascading deletion, fault injection).  No kubelet, scheduler or Deployment
controller runs: tests write workload status themselves where the controller would.  The autoscaling
wiring tests add a real Prometheus (the Debian package, on loopback; skipped without it) scraping
engine stand-ins (loopback servers exposing SGLang's gauges, see tests/autoscaling/conftest.py); no
KEDA controller runs (KEDA mode checks what the operator hands KEDA).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import kmock
import pytest

from .emulator import ApiServer
from .support import PEERING, running_operator


@pytest.fixture
async def api() -> AsyncIterator[ApiServer]:
    async with ApiServer() as server, kmock.Server(server):
        server.register()
        server.objects[kmock.resource("kopf.dev/v1/clusterkopfpeerings"), None, PEERING] = {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": PEERING, "uid": "peering-uid", "resourceVersion": "1"},
        }
        yield server


@pytest.fixture
def operator(api: ApiServer) -> Callable[..., Any]:
    """``async with operator(**config_overrides) as runtime:`` runs kopf with our handlers."""
    return lambda **overrides: running_operator(api, **overrides)


@pytest.fixture(autouse=True)
def kopf_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kopf")
