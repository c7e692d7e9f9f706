"""The KEDA ScaledObject builder and the PromQL strings (the PromQL also runs on a real Prometheus
in test_loop_prometheus.py)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from mixrl.api.loader import load_rlrun
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.operator.autoscaling.promql import (
    default_load_query,
    load_query,
    substitute,
    sustained_query,
)
from mixrl.operator.builders.keda import keda_scaled_object

OWNER = {
    "apiVersion": "mixrl.dev/v1alpha1",
    "kind": "SamplerPool",
    "name": "x",
    "uid": "uid-1",
    "controller": True,
}


def mixed(**autoscaling: Any) -> ResolvedRun:
    run = load_rlrun("examples/rlrun-mixed.yaml")
    data = run.model_dump(by_alias=True, exclude_none=True, mode="json")
    data["spec"]["autoscaling"].update(autoscaling)
    return resolve(RLRun.model_validate(data))


def test_scaled_object_targets_the_pool_scale_subresource() -> None:
    run = mixed(
        fallbackReplicas=2, pollIntervalSeconds=15, scaleDownWindowSeconds=600, activationThreshold=0.5
    )
    pool = run.pool("b300-nvfp4")
    obj = keda_scaled_object(run, pool, {**OWNER, "name": pool.object_name})
    spec = obj["spec"]
    assert obj["apiVersion"] == "keda.sh/v1alpha1" and obj["kind"] == "ScaledObject"
    assert obj["metadata"]["name"] == pool.object_name and obj["metadata"]["namespace"] == "rl"
    assert spec["scaleTargetRef"] == {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "SamplerPool",
        "name": pool.object_name,
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 8)
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (15, 600)
    assert spec["fallback"] == {"failureThreshold": 3, "replicas": 2}
    trigger = spec["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["query"] == default_load_query("rl", pool.object_name)
    assert meta["threshold"] == "64"  # targetPerReplica 16 × capacity 4.0, a string as KEDA reads it
    assert meta["activationThreshold"] == "0.5"
    assert all(isinstance(v, str) for v in meta.values())
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 600
    assert {p["type"]: p["value"] for p in behavior["scaleUp"]["policies"]} == {"Pods": 4, "Percent": 100}


def test_scaled_object_without_fallback_and_zero_pools_ignore_empty_results() -> None:
    run = mixed()
    obj = keda_scaled_object(run, run.pool("a100-bf16"), OWNER)
    assert "fallback" not in obj["spec"]
    assert obj["spec"]["triggers"][0]["metadata"]["ignoreNullValues"] == "true"  # minReplicas 0
    obj = keda_scaled_object(run, run.pool("b200-nvfp4"), OWNER)
    assert obj["spec"]["triggers"][0]["metadata"]["ignoreNullValues"] == "false"


def test_scaled_object_needs_a_full_owner_reference() -> None:
    run = mixed()
    with pytest.raises(ValueError, match=r"owner\.uid: an ownerReference needs it"):
        keda_scaled_object(run, run.pools[0], {k: v for k, v in OWNER.items() if k != "uid"})


@pytest.mark.skipif(
    importlib.util.find_spec("cloudcoil.models.keda") is None,
    reason="cloudcoil-models-keda (KEDA's published CRD as pydantic models) is not installed",
)
@pytest.mark.parametrize("fallback", [None, 3])
def test_scaled_object_matches_kedas_published_schema(fallback: int | None) -> None:
    """Parse with models generated from KEDA's CRD; a field they do not know would be dropped by
    the round trip and a wrong type would fail, so equality means the schema accepts it as is."""
    from cloudcoil.models.keda.v1alpha1 import ScaledObject

    run = mixed(fallbackReplicas=fallback) if fallback is not None else mixed()
    for pool in run.pools:
        built = keda_scaled_object(run, pool, OWNER, labels={"app.kubernetes.io/name": "mixrl"})
        parsed = ScaledObject.model_validate(built)
        assert parsed.model_dump(by_alias=True, exclude_unset=True, mode="json") == built
    # The check has teeth: a misspelled field does not survive it.
    misspelled = {**built, "spec": {**built["spec"], "pollingIntervall": 30}}
    dumped = ScaledObject.model_validate(misspelled).model_dump(
        by_alias=True, exclude_unset=True, mode="json"
    )
    assert dumped != misspelled


def test_default_query_matches_both_metric_spellings_and_only_this_pools_pods() -> None:
    query = default_load_query("rl", "run-h100")
    for name in (
        "sglang:num_queue_reqs",
        "sglang_num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang_num_running_reqs",
    ):
        assert name in query
    assert 'namespace="rl"' in query and 'pod=~"run-h100-[a-z0-9]+-[a-z0-9]+"' in query


def test_user_query_placeholders_leave_promql_braces_alone() -> None:
    template = 'sum(mixrl_router_pool_pending{namespace="{namespace}",pool="{pool}"}) or vector(0)'
    assert substitute(template, pool="h100", namespace="rl", run="r", object_name="r-h100") == (
        'sum(mixrl_router_pool_pending{namespace="rl",pool="h100"}) or vector(0)'
    )
    run = mixed(query=template)
    assert load_query(run.autoscaling, run, run.pool("h100-fp8")).endswith('pool="h100-fp8"}) or vector(0)')


def test_sustained_query_is_a_subquery_with_an_explicit_step() -> None:
    assert sustained_query("sum(x)") == "avg_over_time((sum(x))[1m:15s])"


def test_router_query_template_fills_in() -> None:
    from mixrl.operator.autoscaling.promql import ROUTER_LOAD_QUERY

    run = mixed(query=ROUTER_LOAD_QUERY)
    query = load_query(run.autoscaling, run, run.pool("b200-nvfp4"))
    assert query.endswith('namespace="rl",run="qwen3-moe-coding",pool="b200-nvfp4"})')
    assert "mixrl_router_requests_in_flight|mixrl_router_queue_depth" in query
