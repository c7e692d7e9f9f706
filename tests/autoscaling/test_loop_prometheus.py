"""The loop against real parts: a real Prometheus scraping loopback engines, kopf's real engine,
kmock's API emulator (see conftest.py for what is a stand-in)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import aiohttp.web
import kmock
import kopf
import pytest

from mixrl.operator.autoscaling.loop import AutoscalingLoop, LoopSettings
from mixrl.operator.autoscaling.plan import MetricsUnavailable
from mixrl.operator.autoscaling.pool_api import query_label_values, query_prometheus
from mixrl.operator.autoscaling.promql import (
    DCGM_GPU_UTIL,
    default_load_query,
    gpu_models_query,
    sustained_query,
)
from mixrl.operator.controller.handlers import register_autoscaling
from mixrl.operator.kube.client import Connection, KubeClient

from .conftest import EngineMetrics, engine_job, free_port, needs_prometheus

pytestmark = needs_prometheus

NS = "rl"
POOLS = "mixrl.dev/v1alpha1/samplerpools"
RUNS = "mixrl.dev/v1alpha1/rlruns"


async def eventually(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := predicate()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)
    return value


async def value_of(session: aiohttp.ClientSession, url: str, query: str, expected: float) -> float:
    """Query until the scrapes have caught up with what the engines expose."""
    for _ in range(100):
        try:
            value = await query_prometheus(session, url, query)
            if value == expected:
                return value
        except MetricsUnavailable:
            pass
        await asyncio.sleep(0.1)
    return await query_prometheus(session, url, query)


async def eventually_value(session: aiohttp.ClientSession, url: str, query: str) -> float:
    for _ in range(50):
        try:
            return await query_prometheus(session, url, query)
        except MetricsUnavailable:
            await asyncio.sleep(0.1)
    return await query_prometheus(session, url, query)


async def test_prometheus_query_counts_both_spellings_once(serve, prometheus) -> None:
    colon, underscore = EngineMetrics(negotiate=False), EngineMetrics(negotiate=True)
    gpu_port = free_port()

    async def dcgm(_: aiohttp.web.Request) -> aiohttp.web.Response:
        lines = [
            f'DCGM_FI_DEV_GPU_UTIL{{gpu="{i}",modelName="{model}",namespace="{NS}",pod="{pod}"}} {util}'
            for i, (pod, model, util) in enumerate(
                [
                    ("r-h100-fp8-aaaaa-11111", "NVIDIA H100 80GB HBM3", 90),
                    ("r-h100-fp8-bbbbb-22222", "NVIDIA A100-SXM4-80GB", 70),
                    ("r-h100-ccccc-33333", "NVIDIA H100 80GB HBM3", 10),
                ]
            )
        ]
        return aiohttp.web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    for engine in (colon, underscore):
        await serve(engine.handle, engine.port)
    await serve(dcgm, gpu_port)
    server = await prometheus(
        [
            engine_job("a", colon.port, NS, "r-h100-fp8-aaaaa-11111"),
            engine_job("b", underscore.port, NS, "r-h100-fp8-bbbbb-22222"),
            f"  - job_name: dcgm\n    honor_labels: true\n    static_configs:\n      - targets: ['127.0.0.1:{gpu_port}']\n",
        ]
    )
    colon.set(3, 5)
    underscore.set(7, 11)
    async with aiohttp.ClientSession() as session:
        query = default_load_query(NS, "r-h100-fp8")
        assert await value_of(session, server.url, query, 26.0) == 26.0
        names = await query_prometheus(
            session, server.url, 'count(count by (__name__) ({__name__=~"sglang.*"}))'
        )
        assert names == 4.0  # two spellings of two gauges really reached Prometheus
        # A pool whose name extends another's is not counted with it.
        with pytest.raises(MetricsUnavailable) as no_series:
            await query_prometheus(session, server.url, default_load_query(NS, "r-h100"))
        assert no_series.value.reason == "NoSeries"
        # The subquery needs samples at its aligned steps: right after the first scrapes it has none.
        sustained = await eventually_value(session, server.url, sustained_query(query, "3s", "1s"))
        assert 0 < sustained <= 26.0
        with pytest.raises(MetricsUnavailable) as bad:
            await query_prometheus(session, server.url, "sum(")
        assert bad.value.reason == "QueryFailed"
        assert await value_of(session, server.url, f"count({DCGM_GPU_UTIL})", 3.0) == 3.0
        models = await query_label_values(
            session, server.url, gpu_models_query(NS, "r-h100-fp8"), "modelName"
        )
        assert models == {"NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"}
    await server.stop()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(MetricsUnavailable) as down:
            await query_prometheus(session, server.url, query)
        assert down.value.reason == "PrometheusUnreachable"


def rlrun(prometheus_url: str) -> dict[str, Any]:
    return {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "demo", "namespace": NS, "uid": "run-uid", "resourceVersion": "1"},
        "spec": {
            "model": {"path": "/weights/base/x"},
            "samplerPools": [
                {
                    "name": "b200",
                    "gpuType": "B200",
                    "weightPrecision": "nvfp4",
                    "minReplicas": 1,
                    "maxReplicas": 8,
                }
            ],
            "autoscaling": {
                "prometheusUrl": prometheus_url,
                "targetPerReplica": 4,
                "pollIntervalSeconds": 0.5,
                "scaleDownWindowSeconds": 3,
            },
        },
    }


def samplerpool() -> dict[str, Any]:
    return {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "SamplerPool",
        "metadata": {"name": "demo-b200", "namespace": NS, "uid": "pool-uid", "resourceVersion": "1"},
        "spec": {
            "run": "demo",
            "pool": "b200",
            "gpuType": "B200",
            "weightPrecision": "nvfp4",
            "kvCacheDtype": "fp8",
            "engine": "sglang",
            "replicas": 1,
            "minReplicas": 1,
            "maxReplicas": 8,
            "capacity": 1.0,
        },
        "status": {"replicas": 1, "readyReplicas": 1, "selector": "x=y"},
    }


@asynccontextmanager
async def emulator() -> AsyncIterator[kmock.KubernetesEmulator]:
    async with kmock.KubernetesEmulator() as api, kmock.Server(api):
        for key, kind, subresources in (
            ("v1/namespaces", "Namespace", set()),
            ("v1/events", "Event", set()),
            (RUNS, "RLRun", {"status"}),
            (POOLS, "SamplerPool", {"status", "scale"}),
        ):
            api.resources[key] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=key != "v1/namespaces",
                verbs={"get", "list", "watch", "create", "patch", "delete"},
                subresources=subresources,
            )
        yield api


@asynccontextmanager
async def autoscaler(api: kmock.KubernetesEmulator) -> AsyncIterator[None]:
    """kopf's engine with only the autoscaler's handlers, on this event loop."""
    url = str(api.url).rstrip("/")
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, insecure=True)

    @kopf.on.startup(registry=registry)
    def tune(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False
        settings.watching.reconnect_backoff = 0.05
        settings.process.ultimate_exiting_timeout = 5.0

    settings = LoopSettings(tick_s=0.1, sustained_window=("3s", "1s"))
    register_autoscaling(
        registry, AutoscalingLoop(KubeClient(lambda: Connection(server=url)), settings, owns_client=True)
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(registry=registry, standalone=True, clusterwide=True, stop_flag=stop, ready_flag=ready)
    )
    try:
        await asyncio.wait_for(ready.wait(), timeout=10)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=15)


def live(api: kmock.KubernetesEmulator) -> dict[str, Any]:
    return api.objects[kmock.resource(POOLS), NS, "demo-b200"].raw


async def play_deployment_controller(api: kmock.KubernetesEmulator, session: aiohttp.ClientSession) -> None:
    """Every requested replica becomes ready at once (kube-controller-manager and kubelets' part)."""
    replicas = live(api)["spec"]["replicas"]
    if live(api)["status"].get("readyReplicas") != replicas:
        path = f"{str(api.url).rstrip('/')}/apis/mixrl.dev/v1alpha1/namespaces/{NS}/samplerpools/demo-b200/status"
        body = {"status": {"replicas": replicas, "readyReplicas": replicas}}
        headers = {"Content-Type": "application/merge-patch+json"}
        async with session.patch(path, json=body, headers=headers) as response:
            assert response.status == 200


def conditions(api: kmock.KubernetesEmulator) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in live(api)["status"].get("conditions", [])}


async def test_load_step_scales_up_then_down_after_the_window_and_holds_without_prometheus(
    serve, prometheus
) -> None:
    engines = [EngineMetrics(negotiate=False), EngineMetrics(negotiate=True)]
    for engine in engines:
        await serve(engine.handle, engine.port)
    server = await prometheus(
        [engine_job(f"e{i}", e.port, NS, f"demo-b200-abcde-{i}{i}{i}{i}{i}") for i, e in enumerate(engines)]
    )
    async with emulator() as api, aiohttp.ClientSession() as session:
        api.objects[kmock.resource(RUNS), NS, "demo"] = rlrun(server.url)
        api.objects[kmock.resource(POOLS), NS, "demo-b200"] = samplerpool()
        async with autoscaler(api):
            # Idle: one replica, MetricsAvailable comes up True, nothing is scaled.
            await eventually(
                lambda: conditions(api).get("MetricsAvailable", {}).get("status") == "True", 15, "metrics"
            )
            assert live(api)["spec"]["replicas"] == 1

            # Step: 32 requests over two engines, target 4 per replica → 8 (maxReplicas).
            for engine in engines:
                engine.set(10, 6)
            await eventually(lambda: live(api)["spec"]["replicas"] == 8, 20, "scale-up to 8")
            # The decision lands in status right after the scale write (a second request).
            await eventually(
                # (the status write may not have landed yet: no decisions is "not yet", not an error)
                lambda: (live(api)["status"].get("lastScaleDecisions") or [{}])[-1].get("toReplicas") == 8,
                5,
                "decision recorded",
            )
            scale_patches = [
                r for r in list(api) if r.method.value == "PATCH" and r.url.path.endswith("/scale")
            ]
            assert scale_patches and scale_patches[-1].data == {"spec": {"replicas": 8}}
            # Prometheus scrapes the two engines at different instants, so the first poll may see
            # one engine's half of the step: one or two decisions, 1 → … → 8, never down.
            ups = live(api)["status"]["lastScaleDecisions"]
            assert ups[0]["fromReplicas"] == 1 and ups[-1]["toReplicas"] == 8 and ups[-1]["load"] == 32.0
            assert all(d["toReplicas"] > d["fromReplicas"] for d in ups) and len(ups) <= 2
            # The event is posted after the status patch: wait for it rather than race it.
            await eventually(
                lambda: any(
                    e.raw["reason"] == "Scaled" and e.raw["involvedObject"]["name"] == "demo-b200"
                    for (res, _, _), e in list(api.objects.items())
                    if res == kmock.resource("v1/events")
                ),
                5,
                "Scaled event",
            )
            await play_deployment_controller(api, session)

            # Down: load 10 → ceil(10 · 1.1 / 4) = 3, but only after the 3 s window forgets the peak.
            for engine in engines:
                engine.set(0, 5)
            dropped = asyncio.get_running_loop().time()
            await eventually(lambda: live(api)["spec"]["replicas"] < 8, 20, "first scale-down")
            assert asyncio.get_running_loop().time() - dropped >= 3.0
            await eventually(lambda: live(api)["spec"]["replicas"] == 3, 20, "scale-down to 3")
            await eventually(
                lambda: live(api)["status"]["lastScaleDecisions"][-1]["toReplicas"] == 3,
                5,
                "decision recorded",
            )
            await play_deployment_controller(api, session)
            # Stabilization may step down through what the window still remembers (scrapes taken
            # mid-change), but never back up.
            downs = [d["toReplicas"] for d in live(api)["status"]["lastScaleDecisions"][len(ups) :]]
            assert downs[-1] == 3 and downs == sorted(downs, reverse=True)

            # Prometheus gone: MetricsAvailable False with the reason, replicas held at 3.
            await server.stop()
            await eventually(
                lambda: conditions(api).get("MetricsAvailable", {}).get("status") == "False",
                10,
                "metrics lost",
            )
            condition = conditions(api)["MetricsAvailable"]
            assert condition["reason"] == "PrometheusUnreachable"
            patches_before = len([r for r in list(api) if r.url.path.endswith("/scale")])
            await asyncio.sleep(1.5)  # three more polls
            assert live(api)["spec"]["replicas"] == 3
            assert len([r for r in list(api) if r.url.path.endswith("/scale")]) == patches_before
