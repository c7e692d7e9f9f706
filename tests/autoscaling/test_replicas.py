"""Rule 8's inputs: a pool's pods counted as ready, starting (a cold start) or stuck, as the
cluster reports them (mixrl.operator.autoscaling.replicas), and the policy acting on that word."""

from __future__ import annotations

from typing import Any

import pytest

from mixrl.operator.autoscaling.policy import PolicyConfig, PolicyState, PoolLoad, decide
from mixrl.operator.autoscaling.replicas import (
    GROUP_INDEX_LABEL,
    census,
    pods_with_a_node_on_its_way,
    unschedulable,
)

T0 = "2026-12-05T10:00:00Z"


def pod(name: str, phase: str = "Pending", **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": T0}, "status": {"phase": phase, **status}}


def ready(name: str, after_s: int) -> dict[str, Any]:
    became = f"2026-12-05T10:{after_s // 60:02d}:{after_s % 60:02d}Z"
    return pod(
        name, "Running", conditions=[{"type": "Ready", "status": "True", "lastTransitionTime": became}]
    )


UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
}


def waiting(reason: str) -> dict[str, Any]:
    return {"name": "engine", "state": {"waiting": {"reason": reason, "message": "pull access denied"}}}


def test_the_cluster_decides_what_is_stuck_and_a_cold_start_is_not() -> None:
    pods = [
        ready("a", 90),
        ready("b", 150),
        ready("c", 700),
        pod("scheduled", conditions=[{"type": "PodScheduled", "status": "True"}]),  # pulling
        pod("loading", "Running", conditions=[{"type": "Ready", "status": "False"}]),
        pod("no-node", conditions=[UNSCHEDULABLE]),
        pod("bad-image", containerStatuses=[waiting("ImagePullBackOff")]),
        pod("crashing", "Running", containerStatuses=[waiting("CrashLoopBackOff")]),
        pod("evicted", "Failed", reason="Evicted"),
        {**pod("going", "Running"), "metadata": {"name": "going", "deletionTimestamp": T0}},
    ]
    counted = census(pods)
    assert (counted.ready, counted.starting, counted.stuck) == (3, 2, 4)
    assert (
        counted.why_stuck == "no-node: Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    )
    assert counted.cold_start_s == 150.0  # the median of 90, 150 and 700 s
    assert unschedulable(pods)
    assert not unschedulable([p for p in pods if p["metadata"]["name"] != "no-node"])


def member(group: int, worker: int, pod_: dict[str, Any]) -> dict[str, Any]:
    """``pod_`` as worker ``worker`` of a LeaderWorkerSet group (the labels LWS's webhook sets)."""
    labels = {GROUP_INDEX_LABEL: str(group), "leaderworkerset.sigs.k8s.io/worker-index": str(worker)}
    return {**pod_, "metadata": {**pod_["metadata"], "labels": labels}}


def test_a_multi_node_replica_is_its_group_not_its_pods() -> None:
    """A pool whose replica spans nodes (a LeaderWorkerSet) has one replica per group: ready when
    every member is, stuck when one is, and its cold start ends when its last member is Ready."""
    pods = [
        member(0, 0, ready("g0-leader", 60)),
        member(0, 1, ready("g0-worker", 200)),  # the group is ready at 200 s
        member(1, 0, ready("g1-leader", 90)),
        member(1, 1, pod("g1-worker", conditions=[UNSCHEDULABLE])),  # half a group cannot be placed
        member(2, 0, pod("g2-leader", conditions=[{"type": "PodScheduled", "status": "True"}])),
        member(2, 1, ready("g2-worker", 30)),
    ]
    counted = census(pods)
    assert (counted.ready, counted.starting, counted.stuck) == (1, 1, 1)  # per pod: 4 ready, 1, 1
    assert counted.why_stuck is not None and counted.why_stuck.startswith("g1-worker: Unschedulable")
    assert counted.cold_start_s == 200.0


def test_an_unschedulable_pod_a_node_is_coming_for_is_a_cold_start() -> None:
    pods = [pod("waits-for-node", conditions=[UNSCHEDULABLE]), pod("no-node", conditions=[UNSCHEDULABLE])]
    events = [
        {"reason": "TriggeredScaleUp", "involvedObject": {"kind": "Pod", "name": "waits-for-node"}},
        {"reason": "TriggeredScaleUp", "involvedObject": {"kind": "Node", "name": "no-node"}},
        {"reason": "FailedScheduling", "involvedObject": {"kind": "Pod", "name": "no-node"}},
    ]
    coming = pods_with_a_node_on_its_way(events)
    assert coming == {"waits-for-node"}
    counted = census(pods, coming)
    assert (counted.ready, counted.starting, counted.stuck) == (0, 1, 1)
    assert counted.cold_start_s is None


CONFIG = PolicyConfig(min_replicas=1, max_replicas=8, target_per_replica=10.0, pending_timeout_s=600.0)


@pytest.mark.parametrize("cluster_says", [0, None])
def test_a_cold_start_past_the_timeout_is_released_only_without_the_clusters_word(
    cluster_says: int | None,
) -> None:
    """Four replicas requested, one ready, three starting for 700 s at a load that needs all four."""
    state, decisions = PolicyState(), []
    for now in range(0, 721, 30):
        load = PoolLoad(load=40.0, replicas=4, ready=1, starting=3, stuck=cluster_says)
        decisions.append(decide(load, state, CONFIG, float(now)))
        state = decisions[-1].state
    changes = [(d.desired, d.reason) for d in decisions if d.changed]
    if cluster_says is None:  # the clock: three replicas not ready for 600 s are stuck
        [(desired, reason)] = changes
        assert desired == 1 and "pending timeout: 3 not ready after 600 s" in reason
    else:
        assert changes == []


def test_replicas_the_cluster_reports_stuck_are_released_at_once_with_its_reason() -> None:
    load = PoolLoad(
        load=40.0, replicas=4, ready=1, starting=3, stuck=2, why_stuck="p-1: Unschedulable: no node fits"
    )
    decision = decide(load, PolicyState(), CONFIG, 0.0)
    assert decision.desired == 2  # the two that cannot start go; the cold start stays
    assert "2 stuck, released (p-1: Unschedulable: no node fits)" in decision.reason
    blocked = decide(
        PoolLoad(load=80.0, replicas=2, ready=1, starting=1, stuck=0), decision.state, CONFIG, 30.0
    )
    assert blocked.desired == 2 and "growth blocked" in blocked.reason  # for the pending timeout


def test_a_stuck_count_beyond_the_starting_replicas_is_refused() -> None:
    with pytest.raises(ValueError, match=r"PoolLoad\.stuck"):
        PoolLoad(load=1.0, replicas=2, ready=1, starting=1, stuck=2)
