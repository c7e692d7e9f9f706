"""The loop's pure step (body + observation → scale, status patch, event) and the GPU-type check."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.operator.autoscaling.gpu_check import product_label, wrong_gpu_value
from mixrl.operator.autoscaling.plan import (
    MetricsUnavailable,
    Observation,
    PoolMemory,
    as_routed,
    config_of,
    load_of,
    plan_pool,
)
from mixrl.operator.autoscaling.replicas import Census

RUN = resolve(load_rlrun("examples/rlrun-mixed.yaml"))  # targetPerReplica 16; h100-fp8 capacity 1.5


def pool_body(
    replicas: int = 2, ready: int = 2, conditions: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {"name": "qwen3-moe-coding-h100-fp8", "namespace": "rl", "generation": 3, "uid": "u"},
        "spec": {
            "run": "qwen3-moe-coding",
            "pool": "h100-fp8",
            "replicas": replicas,
            "minReplicas": 1,
            "maxReplicas": 8,
        },
        "status": {"readyReplicas": ready, "conditions": conditions or [], "lastScaleDecisions": []},
    }


def test_a_scale_up_writes_replicas_a_decision_and_an_event() -> None:
    plan = plan_pool(pool_body(), RUN, Observation(120.0, 120.0), PoolMemory(), now=1_700_000_000.0)
    assert plan.replicas == 5  # ceil(120 / (16 · 1.5))
    status = plan.status_patch["status"]
    assert status["lastScaleDecisions"][-1] == {
        "time": "2023-11-14T22:13:20Z",
        "fromReplicas": 2,
        "toReplicas": 5,
        "reason": plan.decision.reason,
        "load": 120.0,
    }
    assert (
        status["conditions"][0]["type"] == "MetricsAvailable" and status["conditions"][0]["status"] == "True"
    )
    assert plan.event is not None and plan.event[:2] == ("Normal", "Scaled")


def test_nothing_to_write_when_nothing_changed() -> None:
    available = {
        "type": "MetricsAvailable",
        "status": "True",
        "reason": "QueryReturned",
        "message": "load 48",
    }
    plan = plan_pool(pool_body(conditions=[available]), RUN, Observation(48.0, 48.0), PoolMemory(), now=0.0)
    assert plan.replicas is None and plan.status_patch == {} and plan.event is None


def test_decision_history_is_bounded_newest_last() -> None:
    body = pool_body()
    body["status"]["lastScaleDecisions"] = [{"toReplicas": i} for i in range(10)]
    plan = plan_pool(body, RUN, Observation(120.0, None), PoolMemory(), now=0.0, history=10)
    decisions = plan.status_patch["status"]["lastScaleDecisions"]
    assert len(decisions) == 10 and decisions[0] == {"toReplicas": 1} and decisions[-1]["toReplicas"] == 5


def test_lost_metrics_hold_replicas_and_flip_the_condition_once() -> None:
    problem = MetricsUnavailable("PrometheusUnreachable", "http://prom:9090/api/v1/query: connection refused")
    other = {"type": "Ready", "status": "True", "reason": "Ready", "message": ""}
    plan = plan_pool(
        pool_body(conditions=[other]), RUN, Observation(None, None, problem), PoolMemory(), now=0.0
    )
    assert plan.replicas is None
    conditions = {c["type"]: c for c in plan.status_patch["status"]["conditions"]}
    assert conditions["Ready"] == other  # someone else's condition is kept
    assert (conditions["MetricsAvailable"]["status"], conditions["MetricsAvailable"]["reason"]) == (
        "False",
        "PrometheusUnreachable",
    )
    assert plan.event is not None and plan.event[:2] == ("Warning", "MetricsUnavailable")
    again = plan_pool(
        pool_body(conditions=list(conditions.values())),
        RUN,
        Observation(None, None, problem),
        PoolMemory(),
        now=30.0,
    )
    assert again.status_patch == {} and again.event is None


def test_starting_replicas_and_weight_updates_come_from_the_body() -> None:
    updating = {"type": "UpdatingWeights", "status": "True"}
    load = load_of(pool_body(replicas=6, ready=2, conditions=[updating]), Observation(10.0, None))
    assert (load.replicas, load.ready, load.starting, load.updating_weights) == (6, 2, 4, True)
    plan = plan_pool(
        pool_body(replicas=6, ready=6, conditions=[updating]), RUN, Observation(1.0, None), PoolMemory(), 0.0
    )
    assert plan.replicas is None and "weight update" in plan.decision.reason


def test_replicas_awaiting_kueues_admission_are_stuck_with_kueues_reason() -> None:
    # A queued run's pool asked for 6; Kueue admitted 3 of them (2 ready, 1 starting), 3 wait.
    admitted = {"type": "Admitted", "status": "False", "reason": "Queued", "message": "insufficient quota"}
    body = pool_body(replicas=6, ready=2, conditions=[admitted])
    body["status"]["awaitingAdmission"] = 3
    load = load_of(body, Observation(10.0, None), pods=Census(ready=2, starting=1, stuck=0))
    assert (load.starting, load.stuck) == (4, 3)
    assert load.why_stuck == "3 awaiting Kueue's admission: insufficient quota"
    alone = load_of(body, Observation(10.0, None))  # the pods not read: Kueue's word still counts
    assert alone.stuck == 3
    plain = pool_body(replicas=6, ready=2)
    assert load_of(plain, Observation(10.0, None)).stuck is None  # no word at all: the clock decides


def test_wrong_gpu_type_raises_a_condition_and_a_warning() -> None:
    plan = plan_pool(
        pool_body(), RUN, Observation(48.0, 48.0), PoolMemory(), 0.0, gpu_models={"NVIDIA A100-SXM4-80GB"}
    )
    conditions = {c["type"]: c for c in plan.status_patch["status"]["conditions"]}
    assert conditions["WrongGpuType"]["status"] == "True"
    assert "NVIDIA-A100-SXM4-80GB" in conditions["WrongGpuType"]["message"]
    assert plan.gpu_event is not None and plan.gpu_event[:2] == ("Warning", "WrongGpuType")
    fine = plan_pool(
        pool_body(), RUN, Observation(48.0, 48.0), PoolMemory(), 0.0, gpu_models={"NVIDIA H100 80GB HBM3"}
    )
    assert {c["type"]: c["status"] for c in fine.status_patch["status"]["conditions"]}[
        "WrongGpuType"
    ] == "False"


def test_the_wrong_gpu_warning_has_its_own_slot_and_is_posted_once_when_it_turns_true() -> None:
    # A scale-up in the same poll: before, its Scaled event replaced the Warning.
    plan = plan_pool(
        pool_body(), RUN, Observation(120.0, 120.0), PoolMemory(), 0.0, gpu_models={"NVIDIA A100-SXM4-80GB"}
    )
    assert plan.event is not None and plan.event[:2] == ("Normal", "Scaled")
    assert plan.gpu_event is not None and plan.gpu_event[:2] == ("Warning", "WrongGpuType")
    # Still True, with another product seen: the condition is rewritten, no second Warning.
    status = plan.status_patch["status"]
    body = pool_body(replicas=5, ready=5, conditions=status["conditions"])
    again = plan_pool(
        body, RUN, Observation(120.0, 120.0), PoolMemory(), 30.0,
        gpu_models={"NVIDIA A100-SXM4-80GB", "NVIDIA L40S"},
    )  # fmt: skip
    [rewritten] = [c for c in again.status_patch["status"]["conditions"] if c["type"] == "WrongGpuType"]
    assert rewritten["status"] == "True" and "NVIDIA-L40S" in rewritten["message"]
    assert again.gpu_event is None
    # Back to the right GPUs, then wrong again: a new Warning.
    fine = plan_pool(
        pool_body(replicas=5, ready=5, conditions=again.status_patch["status"]["conditions"]),
        RUN, Observation(120.0, 120.0), PoolMemory(), 60.0, gpu_models={"NVIDIA H100 80GB HBM3"},
    )  # fmt: skip
    assert fine.gpu_event is None
    wrong = plan_pool(
        pool_body(replicas=5, ready=5, conditions=fine.status_patch["status"]["conditions"]),
        RUN, Observation(120.0, 120.0), PoolMemory(), 90.0, gpu_models={"NVIDIA L40S"},
    )  # fmt: skip
    assert wrong.gpu_event is not None and "NVIDIA-L40S" in wrong.gpu_event[2]


@pytest.mark.parametrize(
    ("reported", "allowed", "expected"),
    [
        ({"NVIDIA H200"}, ("NVIDIA-H200", "NVIDIA-H200-NVL"), "False"),
        ({"NVIDIA H200", "NVIDIA H100 80GB HBM3"}, ("NVIDIA-H200",), "True"),
        (set(), ("NVIDIA-H200",), None),  # no telemetry: nothing to say
        ({"NVIDIA H200"}, (), None),  # a CPU pool has no product list
    ],
)
def test_wrong_gpu_value(reported: set[str], allowed: tuple[str, ...], expected: str | None) -> None:
    value = wrong_gpu_value(reported, allowed)
    assert (value[0] if value else None) == expected


def test_product_label_matches_gpu_feature_discovery() -> None:
    assert product_label("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert product_label(" NVIDIA  B200 ") == "NVIDIA-B200"


def test_stuck_replicas_are_released_with_a_warning_and_a_cold_start_is_learned() -> None:
    pods = Census(
        ready=2,
        starting=1,
        stuck=2,
        why_stuck="p-1: Unschedulable: 0/4 nodes are available",
        cold_start_s=41.26,
    )
    plan = plan_pool(
        pool_body(replicas=5, ready=2), RUN, Observation(120.0, 120.0), PoolMemory(), 0.0, pods=pods
    )
    assert plan.replicas == 3  # the two the cluster reports stuck go, the cold start stays
    status = plan.status_patch["status"]
    [stuck] = [c for c in status["conditions"] if c["type"] == "ReplicasStuck"]
    assert stuck["status"] == "True" and stuck["message"].endswith(
        "p-1: Unschedulable: 0/4 nodes are available"
    )
    assert plan.stuck_event == ("Warning", "ReplicasStuck", stuck["message"])
    assert plan.event is not None and plan.event[:2] == ("Normal", "Scaled")
    assert status["coldStartSeconds"] == 41.3
    # Still stuck at the next poll: no second warning, no rewrite.
    again = plan_pool(
        {
            **pool_body(replicas=3, ready=2, conditions=status["conditions"]),
            "status": {**status, "readyReplicas": 2},
        },
        RUN,
        Observation(48.0, 48.0),
        PoolMemory(),
        30.0,
        pods=replace(pods, stuck=1),
    )
    assert again.stuck_event is None


def test_the_policy_sizes_a_pool_by_the_capacity_the_router_shares_by() -> None:
    pool = RUN.pool("h100-fp8")  # declared 1.5: 16 x 1.5 = 24 requests per replica
    body = pool_body()
    assert config_of(RUN, pool, body).target_per_replica == 24.0
    assert config_of(RUN, as_routed(pool, None), body).target_per_replica == 24.0  # the router says nothing
    assert config_of(RUN, as_routed(pool, 0.5), body).target_per_replica == 8.0  # measured a third
