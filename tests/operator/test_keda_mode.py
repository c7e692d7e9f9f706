"""KEDA mode through the running operator: one ScaledObject per SamplerPool, applied by the pool's
controller when the cluster serves keda.sh; none for pools the built-in loop scales; gone with the
pool or with KEDA mode; a condition instead when KEDA is not installed.

Stand-ins (see conftest.py): the API server (kmock's emulator; "installing KEDA" registers its
scaledobjects resource for discovery), and no KEDA controller runs — what KEDA would do with a
ScaledObject is KEDA's; here we check what the operator hands it.  The built-in loop runs with a
Prometheus URL on which nothing listens (a closed loopback port), which is enough to see which
pools it visits.
"""

from __future__ import annotations

import copy
import socket
from typing import Any

from mixrl.api.models import RLRun
from mixrl.api.resolve import resolve
from mixrl.operator.autoscaling.loop import LoopSettings
from mixrl.operator.builders.keda import pool_scaled_object
from mixrl.operator.builders.objects import HASH_ANNOTATION, Owner

from .emulator import ApiServer
from .support import (
    NAMESPACE,
    RLRUNS,
    SAMPLERPOOLS,
    assert_covered,
    conditions,
    create,
    eventually,
    operator_calls,
    patch,
    run_path,
    settled,
    small_run,
)

Obj = dict[str, Any]
SCALEDOBJECTS = "keda.sh/v1alpha1/scaledobjects"
LOOP = LoopSettings(tick_s=0.1, query_timeout_s=1.0)


def closed_port_url() -> str:
    """A loopback URL nothing listens on: the loop's queries fail at once (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def with_engine(manifest: Obj, engine: str, prometheus: str, **extra: Any) -> Obj:
    manifest = copy.deepcopy(manifest)
    manifest["spec"]["autoscaling"] = {
        "engine": engine,
        "prometheusUrl": prometheus,
        # The first poll of a pool is at once; the next would come after the test (quiet API).
        "pollIntervalSeconds": 60,
        **extra,
    }
    return manifest


def scaled_objects(api: ApiServer) -> set[str]:
    return api.names(SCALEDOBJECTS, NAMESPACE)


def live(api: ApiServer, resource: str, name: str) -> Obj:
    found = api.live(resource, NAMESPACE, name)
    assert found is not None, name
    return found


def expected_scaled_object(api: ApiServer, manifest: Obj, pool_name: str) -> Obj:
    """What the builder says the pool's ScaledObject is, owned by the live SamplerPool."""
    resolved = resolve(RLRun.model_validate(manifest))
    pool = resolved.pool(pool_name)
    uid = live(api, SAMPLERPOOLS, pool.object_name)["metadata"]["uid"]
    return pool_scaled_object(
        resolved, pool, Owner("mixrl.dev/v1alpha1", "SamplerPool", pool.object_name, uid)
    )


async def test_keda_mode_applies_one_scaled_object_per_pool_and_removes_them(
    api: ApiServer, operator: Any
) -> None:
    api.register(with_keda=True)
    prometheus = closed_port_url()
    keda_run = with_engine(small_run("demo"), "keda", prometheus, targetPerReplica=16)
    builtin_run = with_engine(
        small_run("loop", pools=[{"name": "a100", "gpuType": "A100", "minReplicas": 1, "maxReplicas": 2}]),
        "builtin",
        prometheus,
    )
    async with operator(autoscaling=LOOP):
        await create(api, keda_run)
        await create(api, builtin_run)
        await eventually(lambda: scaled_objects(api) == {"demo-b200", "demo-h100"}, what="ScaledObjects")
        # The built-in loop visits only its own run's pool: it finds Prometheus down there.
        await eventually(
            lambda: (
                conditions(live(api, SAMPLERPOOLS, "loop-a100")).get("MetricsAvailable", {}).get("reason")
                == "PrometheusUnreachable"
            ),
            what="the loop's condition on the builtin pool",
        )
        await settled(api, quiet=0.3)
        assert "loop-a100" not in scaled_objects(api), "a builtin pool gets no ScaledObject"
        for name in ("demo-b200", "demo-h100"):
            pool_conditions = conditions(live(api, SAMPLERPOOLS, name))
            assert "MetricsAvailable" not in pool_conditions, "the loop leaves KEDA's pools alone"
            assert pool_conditions["AutoscalerReady"]["reason"] == "KedaScaledObject"
        assert not [r for r in list(api) if r.url.path.endswith("/scale")]
        for pool_name in ("b200", "h100"):
            want = expected_scaled_object(api, keda_run, pool_name)
            got = live(api, SCALEDOBJECTS, want["metadata"]["name"])
            assert (
                got["metadata"]["annotations"][HASH_ANNOTATION]
                == want["metadata"]["annotations"][HASH_ANNOTATION]
            )
            assert (
                got["spec"] == want["spec"]
                and got["metadata"]["ownerReferences"] == want["metadata"]["ownerReferences"]
            )
        assert live(api, SCALEDOBJECTS, "demo-b200")["spec"]["triggers"][0]["metadata"]["threshold"] == "16"
        run_autoscaler = conditions(live(api, RLRUNS, "demo"))["AutoscalerReady"]
        assert (run_autoscaler["status"], run_autoscaler["reason"]) == ("True", "KedaScaledObject")

        # A threshold change reaches the ScaledObjects (the pool's config-hash label wakes its controller).
        retuned = copy.deepcopy(keda_run["spec"]["autoscaling"]) | {"targetPerReplica": 24}
        await patch(api, run_path("demo"), {"spec": {"autoscaling": retuned}})
        await eventually(
            lambda: all(
                live(api, SCALEDOBJECTS, n)["spec"]["triggers"][0]["metadata"]["threshold"] == "24"
                for n in ("demo-b200", "demo-h100")
            ),
            what="new thresholds",
        )

        # Removing a pool removes its ScaledObject with it (owned by the SamplerPool).
        one_pool = [keda_run["spec"]["samplerPools"][0]]
        await patch(api, run_path("demo"), {"spec": {"samplerPools": one_pool}})
        await eventually(lambda: scaled_objects(api) == {"demo-b200"}, what="ScaledObject of h100 gone")

        # Leaving KEDA mode deletes the rest; the loop takes the pool over.
        builtin = copy.deepcopy(retuned) | {"engine": "builtin"}
        await patch(api, run_path("demo"), {"spec": {"autoscaling": builtin}})
        await eventually(lambda: not scaled_objects(api), what="ScaledObjects deleted")
        await eventually(
            lambda: "MetricsAvailable" in conditions(live(api, SAMPLERPOOLS, "demo-b200")),
            what="loop takes over",
        )
        assert live(api, SAMPLERPOOLS, "demo-b200")["metadata"]["uid"], "the pool itself stays"
        await settled(api, quiet=0.3)
    calls = operator_calls(api)
    assert {
        ("keda.sh", "scaledobjects", "create"),
        ("keda.sh", "scaledobjects", "patch"),
        ("keda.sh", "scaledobjects", "get"),
        ("keda.sh", "scaledobjects", "delete"),
    } <= calls
    assert_covered(calls, clusterwide=True)


async def test_keda_mode_without_keda_says_so_and_sends_nothing_to_keda(
    api: ApiServer, operator: Any
) -> None:
    manifest = with_engine(small_run("demo"), "keda", closed_port_url())
    async with operator(autoscaling=LOOP):
        await create(api, manifest)
        await eventually(
            lambda: "AutoscalerReady" in conditions(api.live(RLRUNS, NAMESPACE, "demo") or {}),
            what="condition",
        )
        await eventually(
            lambda: all(
                "AutoscalerReady" in conditions(api.live(SAMPLERPOOLS, NAMESPACE, n) or {})
                for n in ("demo-b200", "demo-h100")
            ),
            what="pool conditions",
        )
        await settled(api, quiet=0.3)
    for obj in (
        live(api, RLRUNS, "demo"),
        live(api, SAMPLERPOOLS, "demo-b200"),
        live(api, SAMPLERPOOLS, "demo-h100"),
    ):
        condition = conditions(obj)["AutoscalerReady"]
        assert (condition["status"], condition["reason"]) == ("False", "KedaNotInstalled")
        assert "install KEDA" in condition["message"]
        assert "MetricsAvailable" not in conditions(obj), "nor does the built-in loop step in"
    assert conditions(live(api, RLRUNS, "demo"))["Ready"]["reason"] != "KedaNotInstalled", "not part of Ready"
    assert not [r for r in list(api) if "scaledobjects" in r.url.path]
    assert not [r for r in list(api) if r.url.path.endswith("/scale")]
    assert any(r.url.path == "/apis/keda.sh/v1alpha1" for r in list(api)), "discovery was asked"


async def test_autoscaler_ready_says_when_this_operator_scales_nothing(api: ApiServer, operator: Any) -> None:
    # Before, a builtin run read True ("the operator scales the pools") under
    # --no-builtin-autoscaler, and a keda run was told to install KEDA under --keda off.
    builtin = with_engine(small_run("demo"), "builtin", closed_port_url())
    keda = with_engine(small_run("other"), "keda", closed_port_url())
    async with operator(autoscaling=None, keda="off"):
        await create(api, builtin)
        await create(api, keda)
        for run in ("demo", "other"):
            await eventually(
                lambda run=run: "AutoscalerReady" in conditions(api.live(RLRUNS, NAMESPACE, run) or {}),
                what=f"{run}'s condition",
            )
        await settled(api, quiet=0.3)
    unscaled = conditions(live(api, RLRUNS, "demo"))["AutoscalerReady"]
    assert (unscaled["status"], unscaled["reason"]) == ("False", "BuiltinAutoscalerOff")
    told_off = conditions(live(api, RLRUNS, "other"))["AutoscalerReady"]
    assert (told_off["status"], told_off["reason"]) == ("False", "KedaOff")
    assert "--keda off" in told_off["message"]
    assert not [r for r in list(api) if "keda.sh" in r.url.path], "not even discovery: it was told off"
