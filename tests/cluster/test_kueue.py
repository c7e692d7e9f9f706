"""Gang admission with Kueue on the bed (issue #31): the real Kueue v0.17 manager beside the real
control plane (tests/cluster/conftest.py's ``kueue``), the operator as the chart runs it.

A ClusterQueue of this test holding 10 H100 GPUs: a run of an 8-GPU H100 trainer and a 1-GPU H100
pool (9 GPUs) is admitted whole and starts; a second run of the same shape does not fit, waits
Queued with Kueue's reason in its status and an Event, and creates nothing of its trainer or
pools; deleting the first run frees its quota (its Workload goes with it) and the second starts.  A queued
run's pool scaled above its start gets its extra replicas admitted one Workload each while quota is
left; the ones beyond it wait, and the pool's status says so in Kueue's words.  With
--kueue-workload-priority (this module's operator), two waiting runs start in the order of their
pods' PriorityClasses, not of their arrival."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.devcluster.addons import CPU_FLAVOR, KUEUE_API, flavor_name, local_queue

from .conftest import Bed, OperatorProcess, operator_with_feature, wait_for

QUEUE = "team"
H100_QUOTA = 10


def run(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"path": "/weights/base/demo-8b", "parametersBillions": 8},
            "trainer": {"gpuType": "H100", "nodes": 1, "gpusPerNode": 8},
            "samplerPools": [
                {
                    "name": "h100",
                    "gpuType": "H100",
                    "weightPrecision": "fp8",
                    "minReplicas": 1,
                    "maxReplicas": 2,
                }
            ],
            "scheduling": {"queue": QUEUE},
        },
    }


@pytest.fixture(scope="module")
def operator(cluster: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """The chart's operator with the chart's kueue.workloadPriority: its flag and its ClusterRole."""
    workdir: Path = tmp_path_factory.mktemp("operator")
    with operator_with_feature(
        cluster, workdir, "kueue.workloadPriority=true", "-workload-priority", "--kueue-workload-priority"
    ) as running:
        yield running


@pytest.fixture
def queue(kueue: Bed, namespace: str) -> Iterator[str]:
    """A ClusterQueue of this namespace's own (10 H100 GPUs, CPU and memory to spare) and the
    LocalQueue ``team`` in the namespace pointing at it."""
    name = f"cq-{namespace}"
    cluster_queue = {
        "apiVersion": KUEUE_API,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "resourceGroups": [
                {
                    "coveredResources": ["nvidia.com/gpu"],
                    "flavors": [
                        {
                            "name": flavor_name("H100"),
                            "resources": [{"name": "nvidia.com/gpu", "nominalQuota": H100_QUOTA}],
                        }
                    ],
                },
                {
                    "coveredResources": ["cpu", "memory"],
                    "flavors": [
                        {
                            "name": CPU_FLAVOR,
                            "resources": [
                                {"name": "cpu", "nominalQuota": 1000},
                                {"name": "memory", "nominalQuota": "10Ti"},
                            ],
                        }
                    ],
                },
            ],
        },
    }
    kueue.apply(yaml.safe_dump_all([cluster_queue, local_queue(namespace, QUEUE, name)]))
    yield name
    kueue.kubectl("delete", "clusterqueue", name, "--wait=false", check=False)


def status(cluster: Bed, namespace: str, name: str) -> dict[str, Any]:
    return cluster.get("rlrun", name, "-n", namespace).get("status") or {}


def condition(cluster: Bed, namespace: str, name: str, kind: str) -> dict[str, Any]:
    found = status(cluster, namespace, name).get("conditions") or []
    return next((c for c in found if c["type"] == kind), {})


def exists(cluster: Bed, namespace: str, kind: str, name: str) -> bool:
    done = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "name", check=False)
    return done.returncode == 0


def started(cluster: Bed, namespace: str, name: str) -> bool:
    """The run's trainer StatefulSet and its pool's SamplerPool and Deployment all exist."""
    return all(
        exists(cluster, namespace, kind, f"{name}-{suffix}")
        for kind, suffix in (("statefulset", "trainer"), ("samplerpool", "h100"), ("deployment", "h100"))
    )


def test_a_run_that_does_not_fit_waits_queued_whole_and_starts_when_capacity_frees(
    kueue: Bed, operator: OperatorProcess, namespace: str, queue: str
) -> None:
    cluster = kueue
    cluster.apply(run("first", namespace))
    wait_for(lambda: started(cluster, namespace, "first"), 60, what="the first run admitted and started")
    workload = cluster.get("workload", "first", "-n", namespace)
    assert workload["spec"]["queueName"] == QUEUE
    assignments = {a["name"]: a for a in workload["status"]["admission"]["podSetAssignments"]}
    assert assignments["trainer"]["flavors"]["nvidia.com/gpu"] == "h100"
    assert assignments["trainer"]["resourceUsage"]["nvidia.com/gpu"] == "8"
    assert assignments["pool-h100"]["resourceUsage"]["nvidia.com/gpu"] == "1"
    admitted = wait_for(lambda: condition(cluster, namespace, "first", "Admitted"), 30, what="Admitted")
    assert admitted["status"] == "True"
    assert status(cluster, namespace, "first")["phase"] != "Queued"

    # 9 of the queue's 10 GPUs are taken: the second run's 9 do not fit.
    cluster.apply(run("second", namespace))
    waiting = wait_for(
        lambda: (
            c
            if (c := condition(cluster, namespace, "second", "Admitted")).get("message", "").count("quota")
            else None
        ),
        60,
        what="the second run's Admitted condition with Kueue's reason",
    )
    assert waiting["status"] == "False" and waiting["reason"] == "Queued"
    assert "insufficient unused quota for nvidia.com/gpu in flavor h100" in waiting["message"], waiting
    queued = status(cluster, namespace, "second")
    assert queued["phase"] == "Queued"
    ready = next(c for c in queued["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "Queued" and "insufficient unused quota" in ready["message"]
    # Never half-started: nothing of the second run's trainer or pools, nor of its other workloads.
    for kind, suffix in (
        ("statefulset", "trainer"),
        ("samplerpool", "h100"),
        ("deployment", "h100"),
        ("deployment", "router"),
        ("statefulset", "buffer"),
    ):
        assert not exists(cluster, namespace, kind, f"second-{suffix}"), f"{kind} second-{suffix}"
    events = cluster.get(
        "events", "-n", namespace, "--field-selector", "involvedObject.name=second,reason=Queued"
    )
    assert any("insufficient unused quota" in e["message"] for e in events["items"]), events["items"]

    # Capacity frees: the first run goes, its Workload with it (owner reference), and the second starts.
    cluster.kubectl("delete", "rlrun", "first", "-n", namespace, "--wait=false")
    wait_for(lambda: started(cluster, namespace, "second"), 90, what="the second run admitted and started")
    assert not exists(cluster, namespace, "workload", "first")
    wait_for(
        lambda: status(cluster, namespace, "second").get("phase") != "Queued",
        30,
        what="the second run's phase",
    )
    assert condition(cluster, namespace, "second", "Admitted")["status"] == "True"


def pool_status(cluster: Bed, namespace: str, name: str) -> dict[str, Any]:
    return cluster.get("samplerpool", name, "-n", namespace).get("status") or {}


def deployment_replicas(cluster: Bed, namespace: str, name: str) -> int:
    return int(cluster.get("deployment", name, "-n", namespace)["spec"]["replicas"])


def extras(cluster: Bed, namespace: str) -> dict[str, bool]:
    """The pool's extra-replica Workloads: name -> admitted."""
    found = cluster.get("workloads", "-n", namespace, "-l", "mixrl.dev/extra-replica")["items"]
    return {
        w["metadata"]["name"]: any(
            c["type"] == "Admitted" and c["status"] == "True"
            for c in (w.get("status") or {}).get("conditions", [])
        )
        for w in found
    }


def test_replicas_above_the_start_are_admitted_one_by_one_while_quota_is_left(
    kueue: Bed, operator: OperatorProcess, namespace: str, queue: str
) -> None:
    """The run takes 9 of the queue's 10 H100 GPUs (trainer 8, pool start 1); its pool scaled to 4
    replicas gets one more (1 GPU left), and two wait; scaled down to 2, the waiting two go."""
    cluster = kueue
    manifest = run("elastic", namespace)
    manifest["spec"]["samplerPools"][0]["maxReplicas"] = 4
    manifest["spec"]["autoscaling"] = {"engine": "none"}  # replicas are this test's to set
    cluster.apply(manifest)
    wait_for(lambda: started(cluster, namespace, "elastic"), 60, what="the run admitted and started")
    pool = "elastic-h100"
    cluster.kubectl("scale", f"samplerpool/{pool}", "-n", namespace, "--replicas=4")

    def waiting() -> dict[str, Any]:
        status = pool_status(cluster, namespace, pool)
        admission = next((c for c in status.get("conditions", []) if c["type"] == "Admitted"), {})
        return (
            status if status.get("awaitingAdmission") == 2 and "quota" in admission.get("message", "") else {}
        )

    status = wait_for(waiting, 30, what="two of three extra replicas waiting for Kueue, with its reason")
    admission = next(c for c in status["conditions"] if c["type"] == "Admitted")
    assert admission["status"] == "False" and admission["reason"] == "Queued", admission
    assert admission["message"].startswith(
        "2 replica(s) above the start wait for Kueue (1 with the run, 1 of 3"
    ), admission
    assert "insufficient unused quota for nvidia.com/gpu in flavor h100" in admission["message"], admission
    assert sorted(extras(cluster, namespace).values()) == [False, False, True]
    # The Deployment runs the start and the one admitted extra, not the four asked for.
    wait_for(lambda: deployment_replicas(cluster, namespace, pool), 20, equals=2, what="2 replicas held")
    assert cluster.get("samplerpool", pool, "-n", namespace)["spec"]["replicas"] == 4

    # Down to 2: the waiting extras go (the admitted one stays), and nothing waits any more.
    cluster.kubectl("scale", f"samplerpool/{pool}", "-n", namespace, "--replicas=2")
    wait_for(
        lambda: list(extras(cluster, namespace).values()),
        30,
        equals=[True],
        what="only the admitted extra left",
    )
    wait_for(
        lambda: pool_status(cluster, namespace, pool).get("awaitingAdmission"),
        20,
        equals=0,
        what="none waiting",
    )
    admission = next(
        c for c in pool_status(cluster, namespace, pool)["conditions"] if c["type"] == "Admitted"
    )
    assert admission["status"] == "True", admission
    assert deployment_replicas(cluster, namespace, pool) == 2


def priority_class(name: str, value: int) -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name},
        "value": value,
    }


def queued_for_quota(cluster: Bed, namespace: str, name: str) -> dict[str, Any] | None:
    found = condition(cluster, namespace, name, "Admitted")
    return found if found.get("status") == "False" and "quota" in found.get("message", "") else None


def test_of_two_waiting_runs_the_one_of_the_higher_priority_class_starts_first(
    kueue: Bed, operator: OperatorProcess, namespace: str, queue: str
) -> None:
    """``low`` arrives before ``high`` while ``first`` holds 9 of the 10 GPUs; each Workload has its
    trainer's PriorityClass and that class's value, and when ``first`` goes Kueue admits ``high``."""
    cluster = kueue
    classes = [priority_class(f"{namespace}-low", 10), priority_class(f"{namespace}-high", 1000)]
    cluster.apply(yaml.safe_dump_all(classes))
    try:
        cluster.apply(run("first", namespace))
        wait_for(lambda: started(cluster, namespace, "first"), 60, what="the first run admitted and started")
        for name in ("low", "high"):
            manifest = run(name, namespace)
            manifest["spec"]["trainer"]["scheduling"] = {"priorityClassName": f"{namespace}-{name}"}
            cluster.apply(manifest)
            wait_for(lambda n=name: queued_for_quota(cluster, namespace, n), 60, what=f"{name} queued")
        for name, value in (("low", 10), ("high", 1000)):
            spec = cluster.get("workload", name, "-n", namespace)["spec"]
            assert spec["priorityClassRef"] == {
                "group": "scheduling.k8s.io",
                "kind": "PriorityClass",
                "name": f"{namespace}-{name}",
            }
            assert spec["priority"] == value
        assert "priority" not in cluster.get("workload", "first", "-n", namespace)["spec"]

        cluster.kubectl("delete", "rlrun", "first", "-n", namespace, "--wait=false")
        wait_for(lambda: started(cluster, namespace, "high"), 90, what="the high-priority run started")
        assert queued_for_quota(cluster, namespace, "low"), condition(cluster, namespace, "low", "Admitted")
        assert not started(cluster, namespace, "low")
    finally:
        for found in classes:
            cluster.kubectl("delete", "priorityclass", found["metadata"]["name"], "--wait=false", check=False)
