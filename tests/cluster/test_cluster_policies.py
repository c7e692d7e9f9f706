"""What a production namespace enforces, on the real API server: Pod Security ``restricted``, a
ResourceQuota that requires CPU and memory requests and limits on every container, and a weights
claim that binds through the storage class the RLRun names."""

from __future__ import annotations

from typing import Any

import yaml

from mixrl.devcluster.cluster import STORAGE_CLASS

from .conftest import ROOT, Bed, OperatorProcess, wait_for

RUN = "qwen3-moe-coding"


def test_pods_pass_pod_security_and_a_quota_and_the_claim_binds(
    cluster: Bed, operator: OperatorProcess, namespace: str
) -> None:
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "requires-requests"},
        # Naming a resource in a quota makes the API server refuse pods whose containers omit it.
        "spec": {"hard": {"requests.cpu": "10k", "requests.memory": "100Ti", "limits.memory": "100Ti"}},
    }
    cluster.apply(quota, namespace=namespace)
    run = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
    run["metadata"]["namespace"] = namespace
    run["spec"]["weights"]["storageClassName"] = STORAGE_CLASS
    cluster.apply(run)

    def workloads() -> list[dict[str, Any]]:
        items = cluster.get("deployments,statefulsets", "-n", namespace)["items"]
        return items if len(items) >= 3 + len(run["spec"]["samplerPools"]) + 1 else []

    def all_pods_created() -> list[str]:
        missing = []
        for workload in workloads() or [
            {"metadata": {"name": "(none yet)"}, "spec": {"replicas": 1}, "status": {}}
        ]:
            if workload["status"].get("readyReplicas", 0) != workload["spec"]["replicas"]:
                missing.append(workload["metadata"]["name"])
        return missing

    wait_for(all_pods_created, 120, what="every workload's pods admitted and Running", equals=[])
    refused = [
        e["message"]
        for e in cluster.get("events", "-n", namespace)["items"]
        if e.get("reason") == "FailedCreate"
    ]
    assert not refused, refused[:3]
    pods = cluster.get("pods", "-n", namespace)["items"]
    assert pods and all(p["status"].get("qosClass") != "BestEffort" for p in pods)
    claim = cluster.get(f"pvc/{RUN}-weights", "-n", namespace)
    assert claim["spec"]["storageClassName"] == STORAGE_CLASS
    wait_for(
        lambda: cluster.get(f"pvc/{RUN}-weights", "-n", namespace)["status"].get("phase"), 60, equals="Bound"
    )
    used = cluster.get("resourcequota/requires-requests", "-n", namespace)["status"]["used"]
    assert used["requests.cpu"] != "0" and used["limits.memory"] != "0"
