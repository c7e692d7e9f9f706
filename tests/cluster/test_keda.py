"""KEDA for real (issue #30): the ScaledObject the operator writes for a pool of an
``autoscaling.engine: keda`` run drives the SamplerPool through the HPA KEDA creates, from a real
Prometheus, on the real control plane.

Real: KEDA v2.21's operator and metrics server (tests/cluster/conftest.py's ``keda``), the API
server's aggregation layer proxying the external metrics API to that server, kube-controller-
manager's HPA controller scaling the SamplerPool's scale subresource, Prometheus scraping, the
operator as the chart runs it.  Stand-in: the engines (one loopback exporter plays every engine pod
of the pool, as in tests/cluster/test_autoscaling.py).  The built-in loop never touches a KEDA
run's pools, so the SamplerPool's replicas move only if KEDA's HPA moves them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.devcluster.cluster import free_port

from .conftest import ROOT, Bed, OperatorProcess, wait_for
from .test_autoscaling import POOL, TARGET, PoolExporter, pool_replicas, scraped

pytestmark = pytest.mark.needs_prometheus


def keda_run(namespace: str, prometheus_url: str) -> dict[str, Any]:
    run = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
    run["metadata"]["namespace"] = namespace
    run["spec"]["samplerPools"] = [p for p in run["spec"]["samplerPools"] if p["name"] == POOL]
    run["spec"]["samplerPools"][0].update(minReplicas=1, maxReplicas=4, capacity=1.0)
    run["spec"]["autoscaling"] = {
        "engine": "keda",
        "prometheusUrl": prometheus_url,
        "targetPerReplica": TARGET,
        "pollIntervalSeconds": 1,
        # The HPA's scale-down stabilization window (and KEDA's cooldown): none, so the test sees
        # the fall within the HPA's 2 s sync period of the bed instead of 5 minutes.
        "scaleDownWindowSeconds": 0,
    }
    return run


def external_average(hpa: dict[str, Any] | None) -> float | None:
    """The HPA's last reading of its external metric, per replica (a quantity: "3500m" is 3.5)."""
    for metric in ((hpa or {}).get("status") or {}).get("currentMetrics") or []:
        value = ((metric.get("external") or {}).get("current") or {}).get("averageValue")
        if value is not None:
            return float(value[:-1]) / 1000 if value.endswith("m") else float(value)
    return None


def test_keda_scales_a_pool_through_the_hpa_from_prometheus(
    keda: Bed, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    cluster = keda
    prom_port = free_port()
    run = keda_run(namespace, f"http://127.0.0.1:{prom_port}")
    name = f"{run['metadata']['name']}-{POOL}"
    exporter = PoolExporter(cluster, namespace, name)
    with scraped(exporter, tmp_path, prom_port):
        cluster.apply(run)

        # The operator's ScaledObject, and the HPA KEDA made of it, aimed at the SamplerPool.
        def scaled_object() -> dict[str, Any] | None:
            found = cluster.kubectl("get", f"scaledobject/{name}", "-n", namespace, "-o", "json", check=False)
            return json.loads(found.stdout) if found.returncode == 0 else None

        so = wait_for(scaled_object, 60, what="the operator's ScaledObject")
        assert so["spec"]["scaleTargetRef"] == {
            "apiVersion": "mixrl.dev/v1alpha1",
            "kind": "SamplerPool",
            "name": name,
        }
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == f"{TARGET:g}"
        assert so["metadata"]["ownerReferences"][0]["kind"] == "SamplerPool"

        def hpa() -> dict[str, Any] | None:
            found = cluster.kubectl("get", f"hpa/keda-hpa-{name}", "-n", namespace, "-o", "json", check=False)
            return json.loads(found.stdout) if found.returncode == 0 else None

        made = wait_for(hpa, 30, what="KEDA's HPA")
        assert made["spec"]["scaleTargetRef"]["kind"] == "SamplerPool"
        assert made["spec"]["scaleTargetRef"]["name"] == name
        assert (made["spec"]["minReplicas"], made["spec"]["maxReplicas"]) == (1, 4)
        (metric,) = made["spec"]["metrics"]
        assert metric["type"] == "External" and metric["external"]["target"]["type"] == "AverageValue"

        def replicas() -> tuple[int, int, int] | None:
            return pool_replicas(cluster, namespace, name, exporter)

        wait_for(replicas, equals=(1, 1, 1), timeout=60, what="one replica at rest")
        exporter.load = 3.5 * TARGET  # ceil(14 / 4) = 4 replicas: the pool's maximum
        wait_for(replicas, equals=(4, 4, 4), timeout=60, what="KEDA's HPA scaling the pool up to 4")
        # The value the HPA read through the aggregated external metrics API: Prometheus' sum.
        # AverageValue: the query's value over the replicas, 14 / 4 = 3.5.
        wait_for(lambda: external_average(hpa()), equals=3.5, timeout=20, what="the HPA's external metric")

        exporter.load = 0.0
        wait_for(replicas, equals=(1, 1, 1), timeout=60, what="KEDA's HPA scaling the pool back to 1")

        # It was KEDA's HPA: its rescale events name the external metric, and the built-in loop,
        # which records every decision of its own in the pool's status, made none.
        events = cluster.get(
            "events", "-n", namespace, "--field-selector", f"involvedObject.name=keda-hpa-{name}"
        )["items"]
        sizes = [e["message"] for e in events if e.get("reason") == "SuccessfulRescale"]
        assert any("New size: 4" in m and "external metric" in m for m in sizes), sizes
        assert any("New size: 1" in m for m in sizes), sizes
        status = cluster.get(f"sp/{name}", "-n", namespace).get("status", {})
        assert not status.get("lastScaleDecisions"), status.get("lastScaleDecisions")
