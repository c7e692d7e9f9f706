"""What Kueue counts for a pool whose replica spans nodes equals what its LeaderWorkerSet's pods
request: every node of every group, the leader (which alone has the weight-sync sidecar) as it is
and the workers as they are — in the run's Workload and in each extra replica's."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

from mixrl.api.kube_types import Obj
from mixrl.api.resolve import ResolvedRun
from mixrl.operator.builders.kueue import extra_workload, run_workload
from mixrl.operator.builders.objects import BuildOptions, Owner
from mixrl.operator.builders.pools import pool_children
from mixrl.operator.controller.apply import quantity

from .test_lws import two_node_run

RUN_OWNER = Owner("mixrl.dev/v1alpha1", "RLRun", "demo", "uid-run")
POOL_OWNER = Owner("mixrl.dev/v1alpha1", "SamplerPool", "demo-big", "uid-pool")


def pod_requests(spec: Obj) -> Counter[str]:
    """A pod's effective requests, as the scheduler and Kueue count them: its containers' sum, or an
    init container's when larger; a limit without a request is the request."""

    def of(container: Obj) -> Counter[str]:
        resources = container.get("resources") or {}
        merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        out: Counter[str] = Counter()
        for name, value in merged.items():
            amount = quantity(value)
            assert amount is not None
            out[name] = amount  # type: ignore[assignment]
        return out

    total: Counter[str] = Counter()
    for container in spec["containers"]:
        total.update(of(container))
    for init in spec.get("initContainers") or []:
        for name, amount in of(init).items():
            total[name] = max(total[name], amount)
    return total


def counted(workload: Obj, prefix_of: str) -> Counter[str]:
    """What Kueue reserves for the pod sets of pool ``prefix_of``: each set's count times its pod."""
    total: Counter[str] = Counter()
    for pod_set in workload["spec"]["podSets"]:
        if pod_set["name"] != "trainer":
            for name, amount in pod_requests(pod_set["template"]["spec"]).items():
                total[name] += amount * pod_set["count"]
    return total


def requested(resolved: ResolvedRun, groups: int) -> Counter[str]:
    """What the pool's LeaderWorkerSet of ``groups`` groups asks of the cluster."""
    pool = resolved.pools[0]
    lws = next(
        o
        for o in pool_children(resolved, pool, groups, POOL_OWNER, BuildOptions())
        if o["kind"] == "LeaderWorkerSet"
    )
    template = lws["spec"]["leaderWorkerTemplate"]
    total: Counter[str] = Counter()
    for name, amount in pod_requests(template["leaderTemplate"]["spec"]).items():
        total[name] += amount * groups
    for name, amount in pod_requests(template["workerTemplate"]["spec"]).items():
        total[name] += amount * groups * (template["size"] - 1)
    return total


def test_the_run_workload_counts_every_node_of_a_multi_node_pool_leader_and_workers_as_they_are() -> None:
    resolved = two_node_run()
    workload = run_workload(resolved, RUN_OWNER, BuildOptions(), "q")
    want = requested(resolved, resolved.pools[0].initial_replicas)
    assert want["nvidia.com/gpu"] == Fraction(16)  # one group of two nodes of 8 GPUs
    assert counted(workload, "big") == want


def test_an_extra_replica_of_a_multi_node_pool_counts_one_whole_group() -> None:
    resolved = two_node_run()
    workload = extra_workload(resolved, resolved.pools[0], POOL_OWNER, BuildOptions(), "q", 1)
    assert counted(workload, "big") == requested(resolved, 1)
    names = [p["name"] for p in workload["spec"]["podSets"]]
    assert len(names) == len(set(names))
