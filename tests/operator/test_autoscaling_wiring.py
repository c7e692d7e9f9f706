"""The operator and its built-in autoscaler, wired together, end to end.

An RLRun goes in; the operator creates its SamplerPools; the autoscaler, running in the same kopf
operator on the same RBAC-checked client, reads a real Prometheus (the Debian ``prometheus``
package on loopback) scraping engine stand-ins, scales the pool through its scale subresource; the
pool's controller makes the Deployment follow.  A run with ``autoscaling.engine: none`` next to it
is left alone.  Stand-ins (see conftest.py and tests/autoscaling/conftest.py): the API server
(kmock's emulator, extended), the engines (loopback servers exposing SGLang's two gauges), the
Deployment controller (the test writes workload status).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock

from mixrl.operator.autoscaling.loop import LoopSettings

from ..autoscaling.conftest import (
    EngineMetrics,
    PrometheusServer,
    engine_job,
    needs_prometheus,
    start_prometheus,
)
from .emulator import ApiServer
from .support import (
    DEPLOYMENTS,
    NAMESPACE,
    RLRUNS,
    SAMPLERPOOLS,
    assert_covered,
    conditions,
    create,
    events,
    eventually,
    operator_calls,
    patch,
    play_workload_controllers,
    run_path,
    small_run,
)

pytestmark = needs_prometheus
Obj = dict[str, Any]
LOOP = LoopSettings(tick_s=0.1, sustained_window=("3s", "1s"))


def scalable_pool(name: str, gpu_type: str, precision: str) -> Obj:
    """A sampler pool the autoscaler may move between 1 and 8 replicas."""
    return {
        "name": name,
        "gpuType": gpu_type,
        "weightPrecision": precision,
        "minReplicas": 1,
        "maxReplicas": 8,
    }


def run_with_autoscaling(name: str, prometheus_url: str, engine: str, pool: Obj) -> Obj:
    manifest = small_run(name, pools=[pool])
    manifest["spec"]["autoscaling"] = {
        "engine": engine,
        "prometheusUrl": prometheus_url,
        "targetPerReplica": 4,
        "pollIntervalSeconds": 0.5,
        "scaleDownWindowSeconds": 3,
    }
    return manifest


@asynccontextmanager
async def engines_and_prometheus(
    tmp: Path, pods: dict[str, EngineMetrics]
) -> AsyncIterator[PrometheusServer]:
    """One loopback metrics server per engine pod, and a Prometheus scraping them (1 s scrapes)."""
    runners = []
    server: PrometheusServer | None = None
    try:
        for engine in pods.values():
            app = aiohttp.web.Application()
            app.router.add_get("/metrics", engine.handle)
            runner = aiohttp.web.AppRunner(app)
            await runner.setup()
            runners.append(runner)
            await aiohttp.web.TCPSite(runner, "127.0.0.1", engine.port).start()
        jobs = [engine_job(f"e{i}", e.port, NAMESPACE, pod) for i, (pod, e) in enumerate(pods.items())]
        server = await start_prometheus(tmp, jobs)
        yield server
    finally:
        if server is not None:
            await server.stop()
        for runner in runners:
            await runner.cleanup()


def pool(api: ApiServer, name: str) -> Obj:
    live = api.live(SAMPLERPOOLS, NAMESPACE, name)
    assert live is not None, name
    return live


def deployment_replicas(api: ApiServer, name: str) -> int | None:
    live = api.live(DEPLOYMENTS, NAMESPACE, name)
    return None if live is None else live["spec"]["replicas"]


async def until_scaled(api: ApiServer, name: str, replicas: int, timeout: float) -> None:
    """The SamplerPool asks for ``replicas`` and its Deployment follows; the pods then become ready."""
    await eventually(lambda: pool(api, name)["spec"]["replicas"] == replicas, timeout, f"{name} → {replicas}")
    await eventually(lambda: deployment_replicas(api, name) == replicas, 10, f"Deployment {name} follows")
    await play_workload_controllers(api)
    await eventually(lambda: pool(api, name)["status"].get("readyReplicas") == replicas, 10, "ready")


async def test_the_operator_scales_a_builtin_pool_from_prometheus_and_leaves_engine_none_alone(
    api: ApiServer, operator: Any, tmp_path: Path
) -> None:
    busy = [EngineMetrics(negotiate=False), EngineMetrics(negotiate=True)]  # both metric spellings
    idle_engine = EngineMetrics(negotiate=False)
    pods = {
        "demo-b200-7d9f8c6b5-abcde": busy[0],
        "demo-b200-7d9f8c6b5-fghij": busy[1],
        "manual-h100-5c4b3a291-klmno": idle_engine,
    }
    async with engines_and_prometheus(tmp_path, pods) as prometheus, operator(autoscaling=LOOP):
        b200, h100 = scalable_pool("b200", "B200", "nvfp4"), scalable_pool("h100", "H100", "fp8")
        await create(api, run_with_autoscaling("demo", prometheus.url, "builtin", b200))
        await create(api, run_with_autoscaling("manual", prometheus.url, "none", h100))
        await eventually(
            lambda: {"demo-b200", "manual-h100"} <= api.names(DEPLOYMENTS, NAMESPACE), what="pool Deployments"
        )
        assert pool(api, "demo-b200")["spec"]["replicas"] == 1 == deployment_replicas(api, "demo-b200")
        await play_workload_controllers(api)

        # Idle: the loop reaches Prometheus (MetricsAvailable) and keeps the floor of one replica.
        await eventually(
            lambda: conditions(pool(api, "demo-b200")).get("MetricsAvailable", {}).get("status") == "True",
            15,
            "MetricsAvailable on the builtin pool",
        )
        assert pool(api, "demo-b200")["spec"]["replicas"] == 1

        # Load step: 32 requests over two engines, 4 per replica → 8 (maxReplicas).  The engine=none
        # pool reports even more load and must not move.
        for engine in busy:
            engine.set(10, 6)
        idle_engine.set(40, 8)
        await until_scaled(api, "demo-b200", 8, timeout=20)
        decisions = pool(api, "demo-b200")["status"]["lastScaleDecisions"]
        assert decisions[-1]["toReplicas"] == 8 and decisions[-1]["load"] == 32.0
        ours = [r for r in list(api) if r.headers.get("User-Agent", "").startswith("mixrl-operator/")]
        scales = [r for r in ours if r.method.value == "PATCH" and r.url.path.endswith("/scale")]
        assert scales and scales[-1].url.path.endswith("/samplerpools/demo-b200/scale")
        assert json.loads(scales[-1].text) == {
            "spec": {"replicas": 8}
        }  # as sent (the stand-in rewrites .data)
        assert any(
            e["reason"] == "Scaled" and e["involvedObject"]["name"] == "demo-b200" for e in events(api)
        )

        # Load down to 10 → ceil(10 · 1.1 / 4) = 3, after the 3 s window has forgotten the peak.
        for engine in busy:
            engine.set(0, 5)
        await until_scaled(api, "demo-b200", 3, timeout=25)

        # engine: none — same Prometheus, far more load, yet untouched by the loop.
        manual = pool(api, "manual-h100")
        assert manual["spec"]["replicas"] == 1 == deployment_replicas(api, "manual-h100")
        assert "MetricsAvailable" not in conditions(manual)
        assert not [r for r in list(api) if "manual-h100/scale" in r.url.path]
        assert conditions(manual)["AutoscalerReady"]["reason"] == "AutoscalingDisabled"
        run = api.live(RLRUNS, NAMESPACE, "demo")
        assert conditions(run)["AutoscalerReady"]["reason"] == "BuiltinAutoscaler"
        # The run's status follows the pool the autoscaler scaled.
        await eventually(
            lambda: api.live(RLRUNS, NAMESPACE, "demo")["status"]["pools"][0]["replicas"] == 3,
            10,
            "run status",
        )
    calls = operator_calls(api)
    assert ("mixrl.dev", "samplerpools/scale", "patch") in calls
    assert_covered(calls, clusterwide=True)


async def test_switching_a_run_to_engine_none_stops_the_loop_and_drops_its_condition(
    api: ApiServer, operator: Any, tmp_path: Path
) -> None:
    engine = EngineMetrics(negotiate=False)
    async with engines_and_prometheus(tmp_path, {"demo-b200-7d9f8c6b5-abcde": engine}) as prometheus:
        b200 = scalable_pool("b200", "B200", "nvfp4")
        manifest = run_with_autoscaling("demo", prometheus.url, "builtin", b200)
        async with operator(autoscaling=LOOP):
            await create(api, manifest)
            # MetricsAvailable from Prometheus, ReplicasStuck from the pool's pods (the emulator
            # serves pods here only: none to list, so NoneStuck).
            api.resources["v1/pods"] = kmock.ResourceInfo(
                kind="Pod", singular="pod", namespaced=True, verbs={"get", "list", "watch"}
            )
            written = {"MetricsAvailable", "ReplicasStuck"}
            await eventually(
                lambda: written <= set(conditions(api.live(SAMPLERPOOLS, NAMESPACE, "demo-b200") or {})),
                15,
                "the loop's conditions",
            )
            manual = copy.deepcopy(manifest["spec"]["autoscaling"]) | {"engine": "none"}
            await patch(api, run_path("demo"), {"spec": {"autoscaling": manual}})
            # The engine is part of the pool's config-hash label: the pool's controller wakes up
            # and drops every condition the loop wrote (before, ReplicasStuck stayed for good).
            await eventually(
                lambda: not written & set(conditions(pool(api, "demo-b200"))), 10, "conditions dropped"
            )
            assert conditions(pool(api, "demo-b200"))["AutoscalerReady"]["reason"] == "AutoscalingDisabled"
            engine.set(60, 0)
            await asyncio.sleep(1.5)  # three poll intervals
            assert pool(api, "demo-b200")["spec"]["replicas"] == 1
            assert not [r for r in list(api) if r.url.path.endswith("/scale")]
