"""Issue #31's fragmentation scenario on the bed's H100 nodes: a run whose 1-GPU engine replicas
the stock scheduler spreads 2 + 2 + 2 over the three 8-GPU nodes, then the chart's NOTES demo with
an 8-GPU H100 trainer, which then finds no whole node. Packed, the small replicas share one node
and the trainer is placed: by the operator's own preference (a preferred pod affinity toward nodes
running GPU pods of the run, then of any run) under the bed's stock ``default-scheduler``, and by
the ``mixrl-packing`` profile alone (mixrl.api.scheduling), which the bed's kube-scheduler serves
and the operator's ``--scheduler-name`` opts GPU pods into."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.scheduling import DEFAULT_SCHEDULER, PACKING_SCHEDULER

from .conftest import ROOT, Bed, start_operator, stop_operator, wait_for

SAMPLER = "app.kubernetes.io/component=sampler"
TRAINER = "app.kubernetes.io/component=trainer"
REPLICAS = 3  # per pool; two H100 pools: six 1-GPU pods


def first_run(namespace: str) -> dict[str, Any]:
    """examples/rlrun-mixed.yaml with its two H100 pools at three replicas each (its trainer on one
    H200 node, out of the H100s' way)."""
    run = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
    run["metadata"]["namespace"] = namespace
    run["spec"]["trainer"]["nodes"] = 1
    run["spec"]["samplerPools"] = [
        {**pool, "minReplicas": REPLICAS, "maxReplicas": REPLICAS}
        for pool in run["spec"]["samplerPools"]
        if pool["gpuType"] == "H100"
    ]
    return run


def demo_run(namespace: str) -> dict[str, Any]:
    """The chart's NOTES demo: an 8-GPU H100 trainer and a 1-GPU H100 pool."""
    notes = (ROOT / "charts" / "mixrl" / "templates" / "NOTES.txt").read_text()
    assert "trainer: {gpuType: H100, nodes: 1, gpusPerNode: 8}" in notes  # the demo this test plays
    return {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "demo", "namespace": namespace},
        "spec": {
            "model": {"path": "/weights/base/demo-8b", "parametersBillions": 8},
            "trainer": {"gpuType": "H100", "nodes": 1, "gpusPerNode": 8},
            "samplerPools": [
                {
                    "name": "h100-fp8",
                    "gpuType": "H100",
                    "weightPrecision": "fp8",
                    "minReplicas": 1,
                    "maxReplicas": 4,
                }
            ],
        },
    }


def placed(cluster: Bed, namespace: str, selector: str) -> list[dict[str, Any]]:
    return [
        pod
        for pod in cluster.get("pods", "-n", namespace, "-l", selector)["items"]
        if pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp")
    ]


def scheduled_by(cluster: Bed, pods: list[dict[str, Any]]) -> set[str]:
    """The schedulers (profiles) whose Scheduled events report placing ``pods``."""
    names = {(pod["metadata"]["namespace"], pod["metadata"]["name"]) for pod in pods}
    return {
        event.get("reportingComponent") or event["source"]["component"]
        for namespace in {namespace for namespace, _ in names}
        for event in cluster.get("events", "-n", namespace, "--field-selector", "reason=Scheduled")["items"]
        if (namespace, event["involvedObject"]["name"]) in names
    }


@pytest.fixture
def namespaces(cluster: Bed) -> Iterator[tuple[str, str]]:
    """The first run's namespace and the demo's (packing reaches across namespaces), deleted
    together and waited for, so the next test finds the H100 nodes empty."""
    names = (f"t-{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}")
    for name in names:
        cluster.kubectl("create", "namespace", name)
    yield names
    cluster.kubectl("delete", "namespace", *names, "--wait=true", "--timeout=90s", check=False)


def fragmentation_scenario(cluster: Bed, first: str, second: str) -> list[dict[str, Any]]:
    """Both runs applied one after the other; returns every GPU pod, all placed."""
    h100 = cluster.gpu_nodes("H100")
    assert len(h100) == 3, f"the bed's fleet has three 8-GPU H100 nodes: {h100}"
    cluster.apply(first_run(first))
    small = wait_for(
        lambda: pods if len(pods := placed(cluster, first, SAMPLER)) == 2 * REPLICAS else None,
        90,
        what=f"{2 * REPLICAS} sampler pods of the first run placed",
    )
    # Packed: one node holds all six; spread (2 + 2 + 2) none would have eight GPUs left.
    assert len({pod["spec"]["nodeName"] for pod in small}) == 1, [pod["spec"]["nodeName"] for pod in small]
    cluster.apply(demo_run(second))
    trainer = wait_for(lambda: placed(cluster, second, TRAINER), 90, what="the demo's 8-GPU trainer placed")
    demo_pool = wait_for(lambda: placed(cluster, second, SAMPLER), 60, what="the demo's engine placed")
    assert trainer[0]["spec"]["nodeName"] in h100
    assert trainer[0]["spec"]["nodeName"] != small[0]["spec"]["nodeName"]
    # The demo's 1-GPU engine joins the node the first run's engines use, not a whole one.
    assert demo_pool[0]["spec"]["nodeName"] == small[0]["spec"]["nodeName"]
    return [*small, *trainer, *demo_pool]


def test_the_operators_affinity_packs_gpu_pods_under_the_default_scheduler(
    cluster: Bed, namespaces: tuple[str, str], tmp_path: Path
) -> None:
    operator = start_operator(cluster, tmp_path)  # the chart's defaults: packing.gpuPods on
    try:
        pods = fragmentation_scenario(cluster, *namespaces)
    finally:
        stop_operator(operator)
    for pod in pods:
        assert pod["spec"]["schedulerName"] == DEFAULT_SCHEDULER
        assert pod["spec"]["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    wait_for(lambda: scheduled_by(cluster, pods), 30, what="Scheduled events", equals={DEFAULT_SCHEDULER})


def test_the_packing_profile_alone_packs_gpu_pods(
    cluster: Bed, namespaces: tuple[str, str], tmp_path: Path
) -> None:
    operator = start_operator(
        cluster, tmp_path, f"--scheduler-name={PACKING_SCHEDULER}", "--no-gpu-pod-packing"
    )
    try:
        pods = fragmentation_scenario(cluster, *namespaces)
    finally:
        stop_operator(operator)
    for pod in pods:
        assert pod["spec"]["schedulerName"] == PACKING_SCHEDULER
        assert "podAffinity" not in pod["spec"]["affinity"]
    # Served by the bed's kube-scheduler: the Scheduled events name the profile (docs/operator.md's check).
    wait_for(lambda: scheduled_by(cluster, pods), 30, what="Scheduled events", equals={PACKING_SCHEDULER})
