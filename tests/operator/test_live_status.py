"""The live status: queries, figures, phases, failure and the collapse condition (pure parts).

The loop itself runs against a real API server and a real Prometheus in
tests/cluster/test_live_status.py.
"""

from __future__ import annotations

from typing import Any

from mixrl.api.models import CollapseSpec
from mixrl.operator.controller.live_status import (
    CAPACITY_MISMATCH,
    COLLAPSE_RISK,
    METRICS_AVAILABLE,
    TRAINER,
    Figures,
    LiveReason,
    Spend,
    figures_from,
    history_query,
    live_pool_status,
    live_run_status,
    node_matches,
    placement_explanation,
    placement_problem,
    quarantine_event,
    records_from_history,
    run_queries,
    significant,
    spend_fields,
    spend_from_status,
    trainer_failure,
)
from mixrl.rl.health.collapse import assess

NOW = "2026-12-01T00:00:00Z"
LATER = "2026-12-01T00:05:00Z"


def previous_status() -> dict[str, Any]:
    return {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True", "reason": "AllComponentsReady"}],
        "pools": [
            {"name": "fp8", "gpuType": "H100", "replicas": 2, "readyReplicas": 2},
            {"name": "bf16", "gpuType": "H200", "replicas": 1, "readyReplicas": 1},
        ],
    }


def answers(step: float = 7, finished: float = 0) -> dict[str, dict[str, float]]:
    return {
        "step": {"": step},
        "weight_version": {"": step},
        "reward": {"": 0.612345},
        "finished": {"": finished},
        "kl": {"all": 0.002, "fp8": 0.0031234567, "bf16": 0.0009},
        "traffic_share": {"fp8": 0.4, "bf16": 0.6},
        "tokens_per_second": {"fp8": 1234.5678},
        "serving_weight_version": {"fp8": 6, "bf16": 7},
    }


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_queries_select_the_run_in_its_namespace_and_escape_label_values() -> None:
    queries = run_queries("team-a", 'we"ird')
    assert queries["step"] == 'max(mixrl_trainer_step{namespace="team-a",run="we\\"ird",pool="all"})'
    assert queries["kl"].startswith("max by (pool) (mixrl_trainer_kl{")
    assert "rate(mixrl_router_generated_tokens_total" in queries["tokens_per_second"]
    assert history_query("ns", "r").startswith('{__name__=~"mixrl_trainer_step|')


def test_live_fields_land_on_the_run_and_its_pools_rounded() -> None:
    status = live_run_status(previous_status(), figures_from(answers()), 3, NOW)
    assert (status["step"], status["weightVersion"], status["reward"]) == (7, 7, 0.6123)
    fp8, bf16 = status["pools"]
    assert fp8 == {
        "name": "fp8",
        "gpuType": "H100",
        "replicas": 2,
        "readyReplicas": 2,
        "kl": 0.003123,
        "trafficShare": 0.4,
        "tokensPerSecond": 1235.0,
        "servingWeightVersion": 6,
    }
    assert bf16["servingWeightVersion"] == 7 and "tokensPerSecond" not in bf16
    assert condition(status, METRICS_AVAILABLE)["status"] == "True"
    assert condition(status, "Ready")["reason"] == "AllComponentsReady"  # others' conditions kept
    assert status["phase"] == "Running"


def test_quarantined_batches_land_on_the_run_with_a_warning_when_they_rise() -> None:
    queries = run_queries("team-a", "r")
    assert (
        queries["quarantined_batches"]
        == 'max(mixrl_buffer_quarantined_batches_total{namespace="team-a",run="r"})'
    )
    first = live_run_status(previous_status(), figures_from(answers()), 3, NOW)
    assert "quarantinedBatches" not in first and quarantine_event(previous_status(), first) is None
    one = live_run_status(first, figures_from({**answers(), "quarantined_batches": {"": 1.0}}), 3, LATER)
    assert one["quarantinedBatches"] == 1
    message = quarantine_event(first, one)
    assert message is not None and message.startswith("1 more batch(es) the trainer could not train")
    assert quarantine_event(one, one) is None  # the same count again: no second event


def test_the_same_figures_compose_the_same_status_so_nothing_is_written() -> None:
    first = live_run_status(previous_status(), figures_from(answers()), 3, NOW)
    again = live_run_status(first, figures_from(answers()), 3, LATER)
    assert again == first  # lastTransitionTime moves only on a flip
    jittered = answers()
    jittered["reward"] = {"": 0.6123449}  # below the 4 significant digits
    assert live_run_status(first, figures_from(jittered), 3, LATER) == first


def test_finished_trainer_makes_the_run_succeed_and_the_phase_is_final() -> None:
    done = live_run_status(previous_status(), figures_from(answers(step=40, finished=1)), 3, NOW)
    assert done["phase"] == "Succeeded"
    assert done["reason"] == LiveReason.FINISHED and done["message"] == "finished: 40 steps taken"
    # A trainer that restarts afterwards (its series at 0 again) does not undo the end.
    restarted = live_run_status(done, figures_from(answers(step=0, finished=0)), 3, LATER)
    assert restarted["phase"] == "Succeeded"


def crash_looping_pod(restarts: int, exit_code: int, message: str = "") -> dict[str, Any]:
    terminated = {"exitCode": exit_code, "reason": "Error" if exit_code else "Completed", "message": message}
    return {
        "metadata": {"name": "r-trainer-0"},
        "status": {
            "containerStatuses": [
                {"name": "trainer", "restartCount": restarts, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                 "lastState": {"terminated": terminated}},
            ]
        },
    }  # fmt: skip


def test_a_trainer_that_keeps_failing_fails_the_run_with_its_last_error() -> None:
    pods = [crash_looping_pod(6, 1, "Traceback...\nmixrl trainer: buffer: step 3 refused\n")]
    why = trainer_failure(pods)
    assert why == "trainer r-trainer-0 failed 6 times (exit code 1): mixrl trainer: buffer: step 3 refused"
    failed = live_run_status(previous_status(), Figures(), 3, NOW, trainer_failure=why)
    assert failed["phase"] == "Failed" and failed["reason"] == LiveReason.TRAINER_FAILED
    assert failed["message"] == why
    # Fewer restarts, or a container that exited 0, is no failure.
    assert trainer_failure([crash_looping_pod(5, 1)]) is None
    assert trainer_failure([crash_looping_pod(9, 0)]) is None


def test_prometheus_unreachable_keeps_the_last_figures_and_says_why() -> None:
    known = live_run_status(previous_status(), figures_from(answers()), 3, NOW)
    lost = live_run_status(known, Figures(), 3, LATER, problem=("PrometheusUnreachable", "http://p: refused"))
    assert lost["step"] == 7 and lost["pools"] == known["pools"]
    available = condition(lost, METRICS_AVAILABLE)
    assert (available["status"], available["reason"]) == ("False", "PrometheusUnreachable")
    assert available["lastTransitionTime"] == LATER
    empty = live_run_status(previous_status(), Figures(), 3, NOW)
    assert condition(empty, METRICS_AVAILABLE)["reason"] == LiveReason.NO_SERIES


def history(
    points: list[tuple[float, int, float, float]],
) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
    """Range-query series from (time, step, run KL, fp8 KL) samples."""
    run = {"run": "r", "pool": "all"}
    return [
        ({"__name__": "mixrl_trainer_step", **run}, [(t, s) for t, s, _, _ in points]),
        ({"__name__": "mixrl_trainer_kl", **run}, [(t, k) for t, _, k, _ in points]),
        ({"__name__": "mixrl_trainer_kl", "run": "r", "pool": "fp8"}, [(t, k) for t, _, _, k in points]),
        ({"__name__": "mixrl_trainer_reward", **run}, [(t, 0.5) for t, _, _, _ in points]),
        ({"__name__": "mixrl_trainer_format_error_endings", **run}, [(t, 0.0) for t, _, _, _ in points]),
    ]


def test_history_becomes_one_record_per_step_and_feeds_the_collapse_signs() -> None:
    # Two samples of step 1 (the last wins), none of step 0 (no update yet).
    points = [(0.0, 0, 0.0, 0.0), (1.0, 1, 0.001, 0.5), (2.0, 1, 0.001, 0.001)]
    points += [(float(t), t - 1, 0.001, 0.001 if t < 14 else 0.01) for t in range(3, 22)]
    records = records_from_history(history(points))
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[0]["pools"]["fp8"]["kl_k3"] == 0.001 and records[0]["kl_k3"] == 0.001
    spec = CollapseSpec(baseline_steps=5, window=3)
    raised = assess(records, spec).raised
    assert [(s.name, s.scope) for s in raised] == [("kl_growing", "fp8")]
    status = live_run_status(
        previous_status(), figures_from(answers()), 3, NOW, assessment=assess(records, spec)
    )
    risk = condition(status, COLLAPSE_RISK)
    assert risk["status"] == "True" and "pool fp8" in risk["message"]
    healthy = records_from_history(history([(float(t), t, 0.001, 0.001) for t in range(1, 21)]))
    calm = live_run_status(
        previous_status(), figures_from(answers()), 3, NOW, assessment=assess(healthy, spec)
    )
    assert condition(calm, COLLAPSE_RISK)["status"] == "False"
    early = live_run_status(previous_status(), figures_from(answers()), 3, NOW, assessment=None)
    assert condition(early, COLLAPSE_RISK)["status"] == "Unknown"


def collapse_risk(records: list[dict[str, Any]], spec: CollapseSpec) -> str:
    status = live_run_status(
        previous_status(), figures_from(answers()), 3, NOW, assessment=assess(records, spec)
    )
    return condition(status, COLLAPSE_RISK)["status"]


def test_collapse_risk_is_unknown_until_every_sign_can_be_judged_and_true_as_soon_as_one_is_raised() -> None:
    # KL judged after 5 + 3 steps, the reward only after its 12-step window: a calm run stays
    # Unknown until step 12, not False from step 8 with its reward never judged.
    spec = CollapseSpec(baseline_steps=5, window=3, reward_window=12)
    calm = records_from_history(history([(float(t), t, 0.001, 0.001) for t in range(1, 21)]))
    assert [collapse_risk(calm[:n], spec) for n in (7, 8, 11, 12, 20)] == [
        "Unknown",
        "Unknown",
        "Unknown",
        "False",
        "False",
    ]
    # A pool's KL growing from step 8 is raised at step 9, before the reward can be judged.
    growing = records_from_history(
        history([(float(t), t, 0.001, 0.001 if t < 8 else 0.01) for t in range(1, 21)])
    )
    assert [collapse_risk(growing[:n], spec) for n in (8, 9)] == ["Unknown", "True"]


def test_pool_status_gets_its_figures_and_keeps_the_rest() -> None:
    previous = {"replicas": 2, "readyReplicas": 2, "selector": "s", "conditions": [{"type": "Ready"}]}
    new = live_pool_status(previous, figures_from(answers()).pools["fp8"])
    assert new == {
        **previous,
        "kl": 0.003123,
        "trafficShare": 0.4,
        "tokensPerSecond": 1235.0,
        "servingWeightVersion": 6,
    }


def test_significant_digits() -> None:
    assert [significant(v) for v in (0.0, 123456.0, 0.000123456, -2.71828)] == [
        0.0,
        123500.0,
        0.0001235,
        -2.718,
    ]


def test_spend_accrues_gpu_hours_at_each_pools_price_and_survives_a_restart() -> None:
    spend = Spend().accrue(8, 3.5, now=1000.0)  # the first sample only starts the clock
    assert (spend.gpu_hours, spend.dollars) == (0.0, 0.0)
    spend = spend.accrue(8, 3.5, now=1000.0 + 1800)  # 8 GPUs for half an hour at $3.5
    assert (spend.gpu_hours, spend.dollars) == (4.0, 14.0)
    status = spend_fields(
        {"step": 7, "pools": [{"name": "fp8"}, {"name": "bf16"}]},
        {"fp8": Spend(2.0, 5.0, 0.0), "bf16": Spend(1.0, 3.5, 0.0), TRAINER: spend},
        NOW,
    )
    assert status["gpuHours"] == 7.0 and status["cost"] == 22.5
    assert status["costPerUpdate"] == significant(22.5 / 7)
    assert status["pools"] == [
        {"name": "fp8", "gpuHours": 2.0, "cost": 5.0},
        {"name": "bf16", "gpuHours": 1.0, "cost": 3.5},
    ]
    assert (status["trainerGpuHours"], status["trainerCost"], status["spendUpdatedAt"]) == (4.0, 14.0, NOW)
    # An operator restart reads it back and goes on accruing from the time it was written.
    again = spend_from_status(status)
    assert again["fp8"].dollars == 5.0 and again[TRAINER].gpu_hours == 4.0
    written_at = again["fp8"].since
    assert written_at is not None
    assert again["fp8"].accrue(2, 2.5, written_at + 3600).dollars == 10.0


def test_the_live_conditions_keep_their_place_so_two_writers_never_rewrite_each_other() -> None:
    """The reconciler puts its conditions first; the live status updates its own where they stand.
    Each putting its own first would reorder the list on every write of the other: a write storm."""
    from mixrl.operator.kube.conditions import merge_conditions

    reconciled = [{"type": t, "status": "True"} for t in ("Ready", "Progressing")]
    live = live_run_status({"phase": "Running", "conditions": reconciled}, figures_from(answers()), 3, NOW)
    order = [c["type"] for c in live["conditions"]]
    assert order == [
        "Ready",
        "Progressing",
        METRICS_AVAILABLE,
        "PodsPlaced",
        COLLAPSE_RISK,
    ]  # new ones at the end
    # The reconciler writes again (its own first, the others as they were), then the live status:
    again = merge_conditions(live["conditions"], [dict(c) for c in reconciled])
    assert [c["type"] for c in again] == order
    relive = live_run_status({**live, "conditions": again}, figures_from(answers()), 3, LATER)
    assert relive == {**live, "conditions": again}  # nothing to write


def test_a_pool_measured_far_off_its_declared_capacity_gets_a_condition_naming_both() -> None:
    previous = {"replicas": 2, "conditions": [{"type": "Ready", "status": "True"}]}
    off = live_pool_status(previous, {"measured_capacity": 1.07}, declared=3.2, generation=4, now="T1")
    [condition] = [c for c in off["conditions"] if c["type"] == CAPACITY_MISMATCH]
    assert condition["status"] == "True" and condition["reason"] == "MeasuredOff"
    assert "measured capacity 1.07 per replica against the declared 3.2 (3x off)" in condition["message"]
    assert off["measuredCapacity"] == 1.07 and {"type": "Ready", "status": "True"} in off["conditions"]
    near = live_pool_status(off, {"measured_capacity": 2.9}, declared=3.2, generation=4, now="T2")
    [condition] = [c for c in near["conditions"] if c["type"] == CAPACITY_MISMATCH]
    assert condition["status"] == "False" and condition["lastTransitionTime"] == "T2"
    # Nothing to compare: no condition (a null pool is measured, not checked; no measurement yet).
    assert "conditions" not in live_pool_status({}, {"measured_capacity": 1.0}, declared=None)
    assert "conditions" not in live_pool_status({}, {}, declared=3.2)


def unschedulable(message: str) -> dict[str, Any]:
    """A Pending pod's status as the scheduler writes it when it cannot place the pod."""
    return {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
        ],
    }


def test_a_pod_the_scheduler_cannot_place_is_named_with_what_it_needs_and_why() -> None:
    trainer = {
        "metadata": {
            "name": "demo-trainer-1",
            "labels": {"app.kubernetes.io/component": "trainer", "mixrl.dev/gpu-type": "H100"},
        },
        "spec": {"containers": [{"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
        "status": unschedulable(
            "0/25 nodes are available: 3 Insufficient nvidia.com/gpu,\n 22 node(s) didn't match Pod's node affinity/selector."
        ),
    }
    placed = {
        "metadata": {"name": "demo-trainer-0"},
        "status": {"conditions": [{"type": "PodScheduled", "status": "True"}]},
    }
    why = placement_problem([placed, trainer])
    assert why == (
        "trainer pod demo-trainer-1 needs 8 × H100 on one node and cannot be placed: 0/25 nodes are available: "
        "3 Insufficient nvidia.com/gpu, 22 node(s) didn't match Pod's node affinity/selector."
    )
    assert placement_problem([placed]) is None
    status = live_run_status({}, Figures(), 1, "T", unplaced=why)
    [condition] = [c for c in status["conditions"] if c["type"] == "PodsPlaced"]
    assert (
        condition["status"] == "False"
        and condition["reason"] == "Unschedulable"
        and condition["message"] == why
    )
    status = live_run_status(status, Figures(), 1, "T2")
    [condition] = [c for c in status["conditions"] if c["type"] == "PodsPlaced"]
    assert condition["status"] == "True" and condition["lastTransitionTime"] == "T2"


H100 = "NVIDIA-H100-80GB-HBM3"


def node(name: str, product: str, gpus: int, cordoned: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"nvidia.com/gpu.product": product}},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "96"}},
    }


def bound(
    name: str, node_name: str, gpus: int, run: str | None = None, phase: str = "Running"
) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "mixrl", "app.kubernetes.io/instance": run} if run else {}
    return {
        "metadata": {"name": name, "namespace": "team", "labels": labels},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}],
        },
        "status": {"phase": phase},
    }


def unplaced_trainer(gpus: int = 8) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "demo-trainer-0",
            "labels": {"app.kubernetes.io/component": "trainer", "mixrl.dev/gpu-type": "H100"},
        },
        "spec": {
            "containers": [{"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "nvidia.com/gpu.product", "operator": "In", "values": [H100]}
                                ]
                            }
                        ]
                    }
                }
            },
        },
        "status": unschedulable(
            "0/6 nodes are available: 2 Insufficient nvidia.com/gpu, 4 node(s) didn't match Pod's node affinity/selector."
        ),
    }


def test_the_explanation_names_the_free_gpus_of_the_nodes_the_pod_may_use_and_who_holds_them() -> None:
    """Issue #31's fragmentation: two 8-GPU H100 nodes, each half used by 1-GPU engine pods of run
    ``a``, and a 2-GPU pod of another team: no node has the trainer's 8 free."""
    nodes = [node("h100-0", H100, 8), node("h100-1", H100, 8), node("b200-0", "NVIDIA-B200", 8)]
    pods = [
        *(bound(f"a-pool-{i}", f"h100-{i % 2}", 1, run="a") for i in range(4)),
        bound("notebook", "h100-1", 2),
        bound("done", "h100-0", 4, run="old", phase="Succeeded"),  # terminated: holds nothing
        bound("b200-pod", "b200-0", 8, run="b"),  # not a node the trainer may use
    ]
    why = placement_explanation(unplaced_trainer(), nodes, pods)
    assert why == (
        "2 H100 node(s) it may use; GPUs free on the most free: h100-0 6, h100-1 4; none has 8 free: it fits "
        "once 2 more are freed on one of them; their GPUs are held by run team/a (4 GPUs in 4 pod(s)), "
        "pod team/notebook (2 GPUs in 1 pod(s))"
    )
    # Appended to the scheduler's reason, within a condition's 1000 characters.
    line = placement_problem([unplaced_trainer()], why)
    assert line is not None and line.startswith(
        "trainer pod demo-trainer-0 needs 8 × H100 on one node and cannot be placed: 0/6 nodes are available"
    )
    assert line.endswith("; " + why) and len(line) <= 1000
    # A node with the GPUs free: the GPUs are not what blocks it (the scheduler's reason says what does).
    assert "h100-0 has 6 free, so the GPUs are not what blocks it" in str(
        placement_explanation(unplaced_trainer(6), nodes, pods)
    )
    # A cordoned node is shown as such and never counted as a fit.
    cordoned = [node("h100-0", H100, 8, cordoned=True), node("h100-1", H100, 8)]
    text = str(placement_explanation(unplaced_trainer(8), cordoned, []))
    assert "h100-0 8 (cordoned), h100-1 8" in text and "h100-1 has 8 free" in text


def test_the_explanation_says_when_no_node_offers_the_gpu_and_skips_cpu_pods() -> None:
    nodes = [node("b200-0", "NVIDIA-B200", 8), {"metadata": {"name": "cpu-0", "labels": {}}, "status": {}}]
    assert placement_explanation(unplaced_trainer(), nodes, []) == (
        "no node of the cluster offers H100 GPUs to this pod: add H100 nodes, or change the gpuType"
    )
    cpu_pod = {**unplaced_trainer(), "spec": {"containers": [{"name": "router"}]}}
    assert placement_explanation(cpu_pod, nodes, []) is None


def test_node_matching_reads_the_selector_and_the_or_of_affinity_terms() -> None:
    pod = unplaced_trainer()
    pod["spec"]["nodeSelector"] = {"pool": "gpu"}
    gpu = node("h100-0", H100, 8)
    assert not node_matches(pod, gpu)  # the selector's label is missing
    gpu["metadata"]["labels"]["pool"] = "gpu"
    assert node_matches(pod, gpu)
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    terms["nodeSelectorTerms"].append(
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["x"]}]}
    )
    other = node("x", "NVIDIA-B200", 8)
    other["metadata"]["labels"]["pool"] = "gpu"
    assert node_matches(pod, other)  # the second term, by name
    terms["nodeSelectorTerms"] = [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "NotIn", "values": [H100]}]},
    ]
    assert not node_matches(pod, gpu) and node_matches(pod, other)
