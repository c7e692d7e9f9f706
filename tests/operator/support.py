"""Helpers for the operator tests: manifests, polling, request accounting, the operator runner."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import kmock
import kopf

from mixrl.operator.controller.handlers import build_registry
from mixrl.operator.controller.runtime import OperatorConfig, Runtime
from mixrl.operator.kube import rbac

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
            "model": {"path": "/weights/base/qwen3-8b"},
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
async def running_operator(
    api: ApiServer, namespaces: list[str] | None = None, **overrides: Any
) -> AsyncIterator[Runtime]:
    """kopf's real engine with our registry, in-process on this event loop, until the block ends.

    Cluster-wide by default (peering through the ClusterKopfPeering ``mixrl``); with ``namespaces``
    it watches only those (peering through a KopfPeering in each).  The built-in autoscaler is off
    unless a test passes ``autoscaling=LoopSettings(...)``: these runs name no reachable Prometheus,
    and its polls would add writes the reconcile tests count."""
    url = str(api.url).rstrip("/")
    settings: dict[str, Any] = {
        "login": lambda **_: kopf.ConnectionInfo(server=url, insecure=True),
        "monitoring": "annotations",
        "backoff_base_s": 0.05,
        "backoff_cap_s": 0.2,
        "event_debounce_s": 0.1,
        "resync_interval_s": None,  # tests that need the periodic resync ask for a short one
        "tune": fast,
        "autoscaling": None,
    }
    config = OperatorConfig(**(settings | overrides))
    registry, runtime = build_registry(config)
    stop = asyncio.Event()
    ready = asyncio.Event()
    scope: dict[str, Any] = {"namespaces": namespaces} if namespaces else {"clusterwide": True}
    api.allow_watches()
    task = asyncio.create_task(
        kopf.operator(registry=registry, peering_name=PEERING, stop_flag=stop, ready_flag=ready, **scope)
    )
    try:
        await asyncio.wait_for(ready.wait(), timeout=10)
        yield runtime
    finally:
        stop.set()
        await asyncio.sleep(0.05)  # let kopf cancel its watchers, then close the server side
        api.end_watches()
        await asyncio.wait_for(task, timeout=15)


async def settled(api: ApiServer, quiet: float = 0.5, timeout: float = 20.0) -> int:
    """Wait until the operator has sent no request for ``quiet`` seconds; returns the request count."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    count, since = len(list(api)), loop.time()
    while loop.time() - since < quiet:
        if loop.time() > deadline:
            raise AssertionError(f"still busy after {timeout}s: {[r.url.path for r in list(api)[-5:]]}")
        await asyncio.sleep(0.05)
        now = len(list(api))
        if now != count:
            count, since = now, loop.time()
    return count


async def writes_settled(api: ApiServer, quiet: float = 0.6, timeout: float = 20.0) -> int:
    """Like :func:`settled`, for an operator that keeps reading (a resync): wait until nothing but
    reads and kopf's peering keep-alives was sent for ``quiet`` seconds; returns the request count."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    def count() -> int:
        return sum(1 for r in writes(api) if r.resource is None or r.resource.group != "kopf.dev")

    seen, since = count(), loop.time()
    while loop.time() - since < quiet:
        if loop.time() > deadline:
            raise AssertionError(f"still writing after {timeout}s")
        await asyncio.sleep(0.05)
        if (now := count()) != seen:
            seen, since = now, loop.time()
    return len(list(api))


async def play_workload_controllers(api: ApiServer, namespace: str = NAMESPACE) -> None:
    """Do what kube-controller-manager and the kubelets would: every Deployment and StatefulSet
    reports all its replicas updated and ready for its current generation."""
    for resource, plural in ((DEPLOYMENTS, "deployments"), (STATEFULSETS, "statefulsets")):
        for name in sorted(api.names(resource, namespace)):
            live = api.live(resource, namespace, name)
            assert live is not None
            replicas = live["spec"].get("replicas", 1)
            status = {
                "observedGeneration": live["metadata"]["generation"],
                "replicas": replicas,
                "readyReplicas": replicas,
                "updatedReplicas": replicas,
                "availableReplicas": replicas,
            }
            if live.get("status") != status:
                path = f"/apis/apps/v1/namespaces/{namespace}/{plural}/{name}"
                await patch(api, path, {"status": status}, subresource="status")


def events(api: ApiServer, namespace: str = NAMESPACE) -> list[Obj]:
    found = [api.live("v1/events", namespace, name) for name in api.names("v1/events", namespace)]
    return sorted((e for e in found if e), key=lambda e: e["metadata"]["creationTimestamp"])


def conditions(obj: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}


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


# ----------------------------------------------------------------------------- RBAC accounting


def rbac_calls(request: kmock.Request) -> set[tuple[str, str, str]]:
    """The (group, resource[/subresource], verb) checks the API server makes for a request; none for
    discovery, which every authenticated client may read (system:discovery).  A server-side apply
    may create the object, so it needs create as well as patch."""
    resource = request.resource
    if resource is None or not resource.plural:
        return set()
    method = request.method.value
    if method == "GET":
        verbs = {"watch" if request.params.get("watch") == "true" else "get" if request.name else "list"}
    elif method == "PATCH" and request.headers.get("Content-Type", "").startswith("application/apply-patch"):
        verbs = {"patch", "create"}
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method)
        verbs = {verb or ("delete" if request.name else "deletecollection")}
    name = f"{resource.plural}/{request.subresource}" if request.subresource else resource.plural
    return {(resource.group, name, verb) for verb in verbs}


def operator_calls(api: ApiServer) -> set[tuple[str, str, str]]:
    """What kopf and our client sent (the test's own kubectl-like requests come from kmock's client)."""
    agents = ("kopf/", "mixrl-operator/")
    return {
        call
        for r in list(api)
        if r.headers.get("User-Agent", "").startswith(agents)
        for call in rbac_calls(r)
    }


def assert_covered(calls: set[tuple[str, str, str]], clusterwide: bool) -> None:
    allowed = rbac.permissions(clusterwide)
    rules = rbac.operator_rules(clusterwide)
    missing = sorted(c for c in calls if not rbac.is_allowed(allowed, *c))
    assert not missing, f"calls the RBAC registry does not declare: {missing}"
    assert all(rbac.rules_allow(rules, *c) for c in calls), "operator_rules() lost a permission"
