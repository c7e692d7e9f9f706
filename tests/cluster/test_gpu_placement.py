"""GPU placement beyond the GFD-labelled fleet, on the real scheduler: a node that GPU Feature
Discovery labels with a time-sliced ``-SHARED`` product, and a node without GFD at all that only a
cloud's own label identifies (the chart's ``gpuNodeLabels``, passed to the operator)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_TABLE
from mixrl.devcluster.kwok_fleet import NodeGroup, node

from .conftest import ROOT, Bed, start_operator, stop_operator, wait_for

CLOUD_LABEL = ("cloud.example.com/accelerator", "a100-80gb")


def extra_node(name: str, labels: dict[str, str], gfd: bool = True) -> dict[str, Any]:
    """An 8-GPU A100 KWOK node; ``gfd=False`` strips every GPU Feature Discovery label."""
    obj = node(NodeGroup("A100", 1, 8), 0)
    kept = {k: v for k, v in obj["metadata"]["labels"].items() if gfd or not k.startswith("nvidia.com/gpu.")}
    obj["metadata"]["name"] = name
    obj["metadata"]["labels"] = kept | labels | {"kubernetes.io/hostname": name}
    return obj


@pytest.fixture
def only_extra_a100_nodes(cluster: Bed) -> Iterator[list[str]]:
    """Two A100 nodes of the unusual kinds, with the fleet's GFD-labelled A100 nodes cordoned."""
    product = GPU_TABLE["A100"].gfd_products[0]
    shared = extra_node("kwok-a100-shared", {GPU_PRODUCT_LABEL: f"{product}-SHARED"})
    no_gfd = extra_node("kwok-a100-nogfd", dict([CLOUD_LABEL]), gfd=False)
    cluster.apply({"apiVersion": "v1", "kind": "List", "items": [shared, no_gfd]})
    fleet_a100 = [
        n["metadata"]["name"] for n in cluster.get("nodes", "-l", f"{GPU_PRODUCT_LABEL}={product}")["items"]
    ]
    cluster.kubectl("cordon", *fleet_a100)
    wait_for(lambda: all(
        any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
        and not any(t["key"] == "node.kubernetes.io/not-ready" for t in n["spec"].get("taints", []))
        for n in (cluster.get(f"node/{name}") for name in ("kwok-a100-shared", "kwok-a100-nogfd"))
    ), 60, what="the extra nodes schedulable")  # fmt: skip
    try:
        yield ["kwok-a100-shared", "kwok-a100-nogfd"]
    finally:
        cluster.kubectl("uncordon", *fleet_a100)
        cluster.kubectl("delete", "node", "kwok-a100-shared", "kwok-a100-nogfd", "--wait=false")


def test_pods_reach_shared_and_gfd_less_nodes(
    cluster: Bed, only_extra_a100_nodes: list[str], namespace: str, tmp_path: Path
) -> None:
    key, value = CLOUD_LABEL
    operator = start_operator(cluster, tmp_path, f"--gpu-node-label=A100:{key}={value}")
    try:
        run = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
        run["metadata"]["namespace"] = namespace
        run["spec"]["samplerPools"] = [
            {**p, "minReplicas": 8, "maxReplicas": 8, "gpusPerReplica": 2}
            for p in run["spec"]["samplerPools"]
            if p["gpuType"] == "A100"
        ]
        cluster.apply(run)
        selector = "app.kubernetes.io/component=sampler"

        def placed() -> dict[str, int]:
            counts: dict[str, int] = {}
            for pod in cluster.get("pods", "-n", namespace, "-l", selector)["items"]:
                if pod.get("status", {}).get("phase") == "Running":
                    counts[pod["spec"]["nodeName"]] = counts.get(pod["spec"]["nodeName"], 0) + 1
            return counts

        # 8 replicas x 2 GPUs fill both 8-GPU nodes, so both kinds of node must have been chosen.
        counts = wait_for(
            lambda: placed() if sum(placed().values()) == 8 else None, 90, what="8 A100 replicas"
        )
        assert counts == {"kwok-a100-shared": 4, "kwok-a100-nogfd": 4}
    finally:
        stop_operator(operator)
