"""examples/rlrun-mixed.yaml applied with kubectl, reconciled by the operator under the chart's RBAC,
scheduled by kube-scheduler onto the simulated GPU fleet, and driven through the /scale subresource."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_TABLE
from mixrl.api.models import RLRun

from .conftest import ROOT, Bed, OperatorProcess, wait_for

EXAMPLE = ROOT / "examples" / "rlrun-mixed.yaml"
RUN = "qwen3-moe-coding"
SAMPLER = "app.kubernetes.io/component=sampler"


def example(namespace: str) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["namespace"] = namespace
    return doc


def pods(cluster: Bed, namespace: str, selector: str) -> list[dict[str, Any]]:
    return cluster.get("pods", "-n", namespace, "-l", selector)["items"]


def node_products(cluster: Bed) -> dict[str, str]:
    return {
        n["metadata"]["name"]: n["metadata"]["labels"].get(GPU_PRODUCT_LABEL, "")
        for n in cluster.get("nodes")["items"]
    }


def running(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        p
        for p in items
        if p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


@pytest.fixture
def mixed_run(cluster: Bed, operator: OperatorProcess, namespace: str) -> dict[str, Any]:
    doc = example(namespace)
    cluster.apply(doc)
    return doc


def test_fleet_is_labelled_like_gpu_feature_discovery(cluster: Bed) -> None:
    nodes = cluster.get("nodes")["items"]
    gpu_nodes = [n for n in nodes if n["metadata"]["labels"].get("nvidia.com/gpu.present") == "true"]
    assert gpu_nodes and len(gpu_nodes) < len(nodes)  # GPU nodes and CPU nodes
    for node in gpu_nodes:
        labels = node["metadata"]["labels"]
        gpu = next(g for g in GPU_TABLE.values() if labels[GPU_PRODUCT_LABEL] in g.gfd_products)
        assert labels["nvidia.com/gpu.count"] == node["status"]["allocatable"]["nvidia.com/gpu"]
        assert labels["nvidia.com/gpu.memory"] == str(gpu.memory_gib * 1024)
        assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in node["spec"]["taints"]
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])


def test_kubectl_explain_reads_the_crd_schema(cluster: Bed) -> None:
    # The API server publishes a new CRD's OpenAPI a moment after it is Established.
    def explain() -> str:
        done = cluster.kubectl("explain", "rlrun.spec.samplerPools", check=False)
        return done.stdout if done.returncode == 0 else ""

    out = wait_for(explain, 30, what="kubectl explain")
    assert "weightPrecision" in out and "gpuType" in out
    assert (
        "Precision the engine serves the weights in"
        in cluster.kubectl("explain", "rlrun.spec.samplerPools.weightPrecision").stdout
    )


def test_mixed_example_runs_on_the_right_gpus(
    cluster: Bed, mixed_run: dict[str, Any], namespace: str
) -> None:
    resolved_pools = {p["name"]: p for p in mixed_run["spec"]["samplerPools"]}
    wait_for(
        lambda: len(cluster.get("samplerpools", "-n", namespace)["items"]) == len(resolved_pools),
        60,
        what="SamplerPools",
    )
    # Each pool's workload follows its SamplerPool's replicas (a new pool starts with at least one).
    desired = {
        sp["spec"]["pool"]: sp["spec"]["replicas"]
        for sp in cluster.get("samplerpools", "-n", namespace)["items"]
    }
    assert all(replicas >= max(1, resolved_pools[pool]["minReplicas"]) for pool, replicas in desired.items())

    def running_per_pool() -> dict[str, int]:
        counts = dict.fromkeys(desired, 0)
        for pod in running(pods(cluster, namespace, SAMPLER)):
            counts[pod["metadata"]["labels"]["mixrl.dev/pool"]] += 1
        return counts

    wait_for(lambda: running_per_pool() == desired, 90, what=f"Running sampler pods per pool {desired}")
    products = node_products(cluster)
    seen_pools = set()
    for pod in running(pods(cluster, namespace, SAMPLER)):
        pool = pod["metadata"]["labels"]["mixrl.dev/pool"]
        seen_pools.add(pool)
        gpu_type = resolved_pools[pool]["gpuType"]
        assert products[pod["spec"]["nodeName"]] in GPU_TABLE[gpu_type].gfd_products, (
            pool,
            pod["spec"]["nodeName"],
        )
        requests = [c.get("resources", {}).get("requests", {}) for c in pod["spec"]["containers"]]
        assert any(r.get("nvidia.com/gpu") for r in requests)
    assert seen_pools == set(desired)
    # The trainer's pods land on H200 nodes only.
    trainer = wait_for(
        lambda: running(pods(cluster, namespace, "app.kubernetes.io/component=trainer")),
        60,
        what="trainer pods",
    )
    assert {products[p["spec"]["nodeName"]] for p in trainer} <= set(GPU_TABLE["H200"].gfd_products)

    # Printer columns show real values: the pools' and the run's.  The pool's ready count is the
    # operator's status write, a debounced reconcile after the Deployment's own status changed.
    def b200_row() -> list[str]:
        table = cluster.kubectl("get", "sp", "-n", namespace, "--no-headers").stdout.splitlines()
        return {line.split()[0]: line.split() for line in table}[f"{RUN}-b200-nvfp4"][1:5]

    # GPU, precision, desired, ready
    wait_for(b200_row, 30, what="the b200 pool's row", equals=["B200", "nvfp4", "2", "2"])
    header = cluster.kubectl("get", "rlr", RUN, "-n", namespace).stdout.splitlines()[0].split()
    assert header[:3] == ["NAME", "PHASE", "STEP"]
    run_row = wait_for(
        lambda: cluster.kubectl("get", "rlr", RUN, "-n", namespace, "--no-headers").stdout.split(),
        60,
        what="run row",
    )
    assert run_row[1] in ("Pending", "Running") and str(len(resolved_pools)) in run_row


def test_kubectl_scale_and_an_hpa_drive_the_pool(
    cluster: Bed, mixed_run: dict[str, Any], namespace: str
) -> None:
    pool = f"{RUN}-a100-bf16"  # minReplicas 0: starts with no pods
    wait_for(
        lambda: cluster.kubectl("get", "sp", pool, "-n", namespace, check=False).returncode == 0,
        60,
        what=pool,
    )
    cluster.kubectl("scale", f"sp/{pool}", "-n", namespace, "--replicas=3")
    selector = f"mixrl.dev/pool=a100-bf16,{SAMPLER}"
    wait_for(lambda: len(running(pods(cluster, namespace, selector))) == 3, 60, what="3 A100 pods")
    scale = cluster.get(f"samplerpools/{pool}", "-n", namespace, "--subresource=scale")
    assert scale["spec"]["replicas"] == 3 and scale["status"]["selector"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "a100", "namespace": namespace},
        "spec": {
            "scaleTargetRef": {"apiVersion": "mixrl.dev/v1alpha1", "kind": "SamplerPool", "name": pool},
            "minReplicas": 2,
            "maxReplicas": 2,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}},
                }
            ],
        },
    }
    cluster.apply(hpa)
    # No metrics server here, but the HPA still enforces its bounds through /scale: 3 -> 2.
    wait_for(lambda: len(running(pods(cluster, namespace, selector))) == 2, 90, what="HPA scaling to 2")
    assert cluster.get(f"sp/{pool}", "-n", namespace)["spec"]["replicas"] == 2


def test_delete_removes_every_child_through_the_garbage_collector(
    cluster: Bed, mixed_run: dict[str, Any], namespace: str
) -> None:
    claims = {f"{RUN}-weights", f"data-{RUN}-buffer-0"}  # the 4 trainer nodes share the weights volume

    def made() -> bool:
        return claims <= {c["metadata"]["name"] for c in cluster.get("pvc", "-n", namespace)["items"]}

    wait_for(made, 60, what="the run's claims")
    cluster.kubectl("delete", "rlr", RUN, "-n", namespace, "--wait=true", "--timeout=60s")

    def leftovers() -> list[str]:
        kinds = "deployments,statefulsets,services,configmaps,samplerpools,pods,pvc"
        items = cluster.get(kinds, "-n", namespace)["items"]
        return sorted(
            f"{i['kind']}/{i['metadata']['name']}"
            for i in items
            if i["metadata"]["name"] != "kube-root-ca.crt"
        )

    # What stays is deliberate: the buffer's logs (Retain). The example's 4 trainer nodes keep
    # their checkpoints on the weights volume, which goes with the run (docs/operator.md#delete).
    assert mixed_run["spec"]["trainer"]["nodes"] > 1
    kept = [f"PersistentVolumeClaim/data-{RUN}-buffer-0"]
    wait_for(leftovers, 90, what="garbage collection", equals=kept)


def test_valid_example_passes_mixrl_validate_and_the_api_server(cluster: Bed, namespace: str) -> None:
    doc = example(namespace)
    RLRun.model_validate(copy.deepcopy(doc))
    done = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(doc))
    assert "created (server dry run)" in done.stdout
