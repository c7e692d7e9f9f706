"""Helpers for the operator tests: manifests, polling, request accounting, the operator runner."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import kmock
import kopf

from mixrl.operator.handlers import OperatorConfig, Runtime, build_registry

from .emulator import ApiServer

Obj = dict[str, Any]
NAMESPACE = "rl"
PEERING = "mixrl"
RLRUNS = "mixrl.dev/v1alpha1/rlruns"
SAMPLERPOOLS = "mixrl.dev/v1alpha1/samplerpools"
DEPLOYMENTS = "apps/v1/deployments"
STATEFULSETS = "apps/v1/statefulsets"


def small_run(name: str = "demo", pools: list[Obj] | None = None) -> Obj:
    """An RLRun with two GPU pools and the default everything else."""
    return {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"path": "s3://models/qwen3-8b"},
            "trainer": {"gpuType": "H200", "nodes": 2, "gpusPerNode": 8},
            "samplerPools": pools
            or [
                {
                    "name": "b200",
                    "gpuType": "B200",
                    "weightPrecision": "nvfp4",
                    "minReplicas": 2,
                    "maxReplicas": 8,
                },
                {
                    "name": "h100",
                    "gpuType": "H100",
                    "weightPrecision": "fp8",
                    "minReplicas": 1,
                    "maxReplicas": 4,
                },
            ],
            "weights": {"store": "file:///weights", "volumeSize": "100Gi"},
        },
    }


async def eventually(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll until ``predicate()`` is truthy (the operator runs on this loop, so we must yield)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def writes(api: ApiServer, since: int = 0) -> list[kmock.Request]:
    """Requests that change state (kopf's and ours), after the first ``since`` requests."""
    return [r for r in list(api)[since:] if r.method.value in ("POST", "PUT", "PATCH", "DELETE")]


def fast(settings: kopf.OperatorSettings) -> None:
    settings.posting.enabled = True
    settings.networking.error_backoffs = [0.05, 0.1]
    settings.watching.reconnect_backoff = 0.05
    settings.queueing.idle_timeout = 0.5
    settings.queueing.exit_timeout = 0.5
    settings.persistence.consistency_timeout = 1.0
    settings.process.ultimate_exiting_timeout = 5.0


@asynccontextmanager
async def running_operator(api: ApiServer, **overrides: Any) -> AsyncIterator[Runtime]:
    """kopf's real engine with our registry, in-process, until the block ends."""
    url = str(api.url).rstrip("/")
    config = OperatorConfig(
        login=lambda **_: kopf.ConnectionInfo(server=url, insecure=True),
        monitoring="annotations",
        backoff_base_s=0.05,
        backoff_cap_s=0.2,
        tune=fast,
        **overrides,
    )
    registry, runtime = build_registry(config)
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry, clusterwide=True, peering_name=PEERING, stop_flag=stop, ready_flag=ready
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), timeout=10)
        yield runtime
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=15)


async def create(api: ApiServer, body: Obj) -> Obj:
    """POST an object the way kubectl create does (through HTTP, so watchers see it)."""
    meta = body["metadata"]
    plural = {"RLRun": "rlruns", "SamplerPool": "samplerpools"}[body["kind"]]
    async with api.post(
        f"/apis/mixrl.dev/v1alpha1/namespaces/{meta['namespace']}/{plural}", json=body
    ) as response:
        assert response.status in (200, 201), await response.text()
        return await response.json()


async def patch(api: ApiServer, path: str, body: Obj, subresource: str | None = None) -> Obj:
    url = f"{path}/{subresource}" if subresource else path
    headers = {"Content-Type": "application/merge-patch+json"}
    async with api.patch(url, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def delete(api: ApiServer, path: str) -> None:
    async with api.delete(path) as response:
        assert response.status == 200, await response.text()


def run_path(name: str, namespace: str = NAMESPACE) -> str:
    return f"/apis/mixrl.dev/v1alpha1/namespaces/{namespace}/rlruns/{name}"


def copy_of(obj: Obj) -> Obj:
    return copy.deepcopy(obj)
