"""Status composition (pure): Ready from sub-conditions, transition times, carried-over fields."""

from __future__ import annotations

from pathlib import Path

import yaml

from mixrl.operator.autoscaling.plan import loop_conditions_to_drop
from mixrl.operator.controller.observed_status import (
    COMPONENT_CONDITIONS,
    PoolState,
    Reason,
    WorkloadState,
    autoscaler_value,
    condition_value,
    invalid_run_status,
    pool_status,
    run_status,
    samplers_value,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def workload(
    desired: int = 1, ready: int = 1, updated: int | None = None, current: bool = True
) -> WorkloadState:
    return WorkloadState(
        desired=desired, ready=ready, updated=desired if updated is None else updated, current=current
    )


def ready_components() -> dict[str, WorkloadState | None]:
    return {kind: workload() for kind in COMPONENT_CONDITIONS if kind != "SamplersReady"}


def conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def test_workload_state_reads_deployment_status() -> None:
    live = {
        "metadata": {"generation": 3},
        "spec": {"replicas": 4},
        "status": {"observedGeneration": 2, "readyReplicas": 4, "updatedReplicas": 4},
    }
    state = WorkloadState.of(live)
    assert state == WorkloadState(desired=4, ready=4, updated=4, current=False)
    assert state.rolling_out, "the controller has not seen generation 3 yet"
    assert condition_value(state)[:2] == ("False", Reason.ROLLING_OUT)
    assert WorkloadState.of(None) is None
    assert condition_value(None)[:2] == ("False", Reason.MISSING)
    assert condition_value(workload(desired=0, ready=0))[:2] == ("True", Reason.SCALED_TO_ZERO)
    assert condition_value(workload(desired=3, ready=2)) == ("False", Reason.NOT_READY, "2/3 ready")


def test_samplers_need_a_ready_replica_in_every_pool_that_should_serve() -> None:
    pools = [PoolState("a", "B200", "nvfp4", 2, 1), PoolState("b", "A100", "bf16", 0, 0)]
    assert samplers_value(pools)[0] == "True"
    pools.append(PoolState("c", "H100", "fp8", 1, 0))
    assert samplers_value(pools) == ("False", Reason.NOT_READY, "no ready replica in c")
    assert samplers_value([PoolState("b", "A100", "bf16", 0, 0)])[:2] == ("False", Reason.SCALED_TO_ZERO)


def test_ready_is_composed_from_every_sub_condition() -> None:
    pools = [PoolState("a", "B200", "nvfp4", 1, 1)]
    status = run_status({}, 1, ready_components(), pools, T0)
    c = conditions(status)
    assert c["Ready"]["status"] == "True" and c["Ready"]["reason"] == Reason.ALL_READY
    assert c["Progressing"]["status"] == "False" and c["InvalidSpec"]["status"] == "False"
    assert status["phase"] == "Running" and status["observedGeneration"] == 1
    assert all(cond["observedGeneration"] == 1 for cond in status["conditions"])

    components = ready_components()
    components["BufferReady"] = workload(desired=1, ready=0)
    status = run_status(status, 1, components, pools, T1)
    c = conditions(status)
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == Reason.NOT_READY
    assert "BufferReady: 0/1 ready" in c["Ready"]["message"]
    assert status["phase"] == "Running", "a run that was running stays Running while a component restarts"


def test_an_unchanged_observation_reproduces_the_status_exactly() -> None:
    pools = [PoolState("a", "B200", "nvfp4", 1, 0)]
    first = run_status({}, 2, ready_components(), pools, T0)
    second = run_status(first, 2, ready_components(), pools, T1)
    assert second == first, "same observation => same status => no write"


def test_transition_time_moves_only_when_the_value_flips() -> None:
    pools = [PoolState("a", "B200", "nvfp4", 1, 0)]
    first = run_status({}, 1, ready_components(), pools, T0)
    flipped = run_status(first, 1, ready_components(), [PoolState("a", "B200", "nvfp4", 1, 1)], T1)
    assert conditions(flipped)["Ready"]["lastTransitionTime"] == T1
    assert conditions(flipped)["InvalidSpec"]["lastTransitionTime"] == T0


def test_fields_of_other_writers_survive() -> None:
    previous = {
        "step": 40,
        "reward": 0.7,
        "conditions": [{"type": "CollapseRisk", "status": "False", "reason": "Healthy", "message": ""}],
        "pools": [{"name": "a", "kl": 0.01, "trafficShare": 0.6, "replicas": 1}],
    }
    status = run_status(previous, 3, ready_components(), [PoolState("a", "B200", "nvfp4", 2, 2)], T0)
    assert status["step"] == 40 and status["reward"] == 0.7
    assert conditions(status)["CollapseRisk"]["reason"] == "Healthy"
    assert status["pools"] == [
        {
            "name": "a",
            "kl": 0.01,
            "trafficShare": 0.6,
            "replicas": 2,
            "gpuType": "B200",
            "weightPrecision": "nvfp4",
            "readyReplicas": 2,
        }
    ]
    assert status["poolCount"] == 1


def test_invalid_spec_status_carries_the_message() -> None:
    message = "spec.samplerPools[0].weightPrecision: nvfp4 needs FP4 tensor cores, which A100 lacks"
    status = invalid_run_status({}, 5, message, T0)
    c = conditions(status)
    assert status["phase"] == "Invalid" and status["observedGeneration"] == 5
    assert (c["InvalidSpec"]["status"], c["InvalidSpec"]["message"]) == ("True", message)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", Reason.INVALID_SPEC)


def test_pool_status_publishes_replicas_and_selector_for_the_scale_subresource() -> None:
    deployment = {
        "metadata": {"generation": 2},
        "spec": {"replicas": 3},
        "status": {"observedGeneration": 2, "replicas": 3, "readyReplicas": 2, "updatedReplicas": 3},
    }
    status = pool_status({"kl": 0.02}, 4, deployment, "a=b,c=d", T0)
    assert status["replicas"] == 3 and status["readyReplicas"] == 2 and status["selector"] == "a=b,c=d"
    assert status["kl"] == 0.02 and status["observedGeneration"] == 4
    assert conditions(status)["Ready"]["status"] == "False"


def test_autoscaler_ready_names_who_scales_the_pools() -> None:
    assert autoscaler_value("builtin", keda_served=False)[:2] == ("True", Reason.BUILTIN_AUTOSCALER)
    assert autoscaler_value("keda", keda_served=True, scaled_object="r-b200") == (
        "True",
        Reason.KEDA_SCALED_OBJECT,
        "KEDA scales through ScaledObject r-b200",
    )
    missing = autoscaler_value("keda", keda_served=False)
    assert missing[:2] == ("False", Reason.KEDA_NOT_INSTALLED) and "install KEDA" in missing[2]
    assert autoscaler_value("none", keda_served=True)[:2] == ("True", Reason.AUTOSCALING_DISABLED)
    # The operator's own settings: before, a builtin run read True under --no-builtin-autoscaler
    # (nothing scaled it) and a keda run was told to install KEDA under --keda off.
    unscaled = autoscaler_value("builtin", keda_served=False, builtin_loop=False)
    assert (
        unscaled[:2] == ("False", Reason.BUILTIN_AUTOSCALER_OFF) and "--no-builtin-autoscaler" in unscaled[2]
    )
    told_off = autoscaler_value("keda", keda_served=False, keda_off=True)
    assert told_off[:2] == ("False", Reason.KEDA_OFF) and "--keda off" in told_off[2]


def test_autoscaler_condition_is_informational_on_the_run() -> None:
    pools = [PoolState("a", "B200", "nvfp4", 1, 1)]
    missing = autoscaler_value("keda", keda_served=False)
    status = run_status({}, 1, ready_components(), pools, T0, missing)
    c = conditions(status)
    assert c["AutoscalerReady"]["status"] == "False" and c["Ready"]["status"] == "True"
    assert "AutoscalerReady" not in conditions(run_status({}, 1, ready_components(), pools, T0))


def test_pool_status_drops_the_loops_conditions_once_another_engine_scales() -> None:
    metrics = {"type": "MetricsAvailable", "status": "True", "reason": "QueryReturned", "message": "load 3"}
    stuck = {
        "type": "ReplicasStuck",
        "status": "True",
        "reason": "ClusterReports",
        "message": "p: Unschedulable",
    }
    wrong_gpu = {"type": "WrongGpuType", "status": "True", "reason": "UnexpectedProduct", "message": ""}
    previous = {"conditions": [metrics, stuck, wrong_gpu], "lastScaleDecisions": [{"toReplicas": 2}]}
    loop = {"MetricsAvailable", "ReplicasStuck", "WrongGpuType"}
    builtin = autoscaler_value("builtin", False)
    kept = pool_status(previous, 1, None, "a=b", T0, builtin, drop=loop_conditions_to_drop("builtin"))
    assert set(conditions(kept)) == {"Ready", "AutoscalerReady"} | loop
    for engine in ("keda", "none"):
        # The controller passes loop_conditions_to_drop(engine) (reconcile.py); before, only
        # MetricsAvailable went and a stale ReplicasStuck/WrongGpuType stayed True for good.
        dropped = pool_status(
            previous, 1, None, "a=b", T0, autoscaler_value(engine, True, "r-a"),
            drop=loop_conditions_to_drop(engine),
        )  # fmt: skip
        assert set(conditions(dropped)) == {"Ready", "AutoscalerReady"}, engine
        assert dropped["lastScaleDecisions"] == [{"toReplicas": 2}], "the decision history stays"


def test_the_autoscalers_concurrency_recommendation_survives_the_reconciler_and_the_crd() -> None:
    """status.recommendedConcurrency is the built-in autoscaler's (objective: trainer): the run's
    controller carries it over, and the CRD declares it (the API server would prune it otherwise)."""
    recommendation = {"sessions": 640, "configured": 256, "time": T0, "message": "demand 8 traj/s"}
    previous = {"recommendedConcurrency": recommendation}
    status = run_status(previous, 3, ready_components(), [PoolState("a", "B200", "nvfp4", 2, 2)], T1)
    assert status["recommendedConcurrency"] == recommendation
    crd = yaml.safe_load(Path("crds/rlruns.mixrl.dev.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    declared = schema["properties"]["recommendedConcurrency"]
    assert set(declared["properties"]) == set(recommendation)
    assert declared["properties"]["sessions"]["type"] == "integer"
