"""Gang admission with Kueue, the pure parts: the run's Workload (mixrl.operator.builders.kueue),
the run's status while it is Queued, the field's validation and the operator's RBAC for Workloads.
The whole path against a real Kueue: tests/cluster/test_kueue.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from mixrl.api.errors import InvalidSpec
from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_RESOURCE, GPU_TABLE
from mixrl.api.kube_types import Obj
from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.operator.builders.kueue import (
    EXTRA_LABEL,
    QUEUE_LABEL,
    admitted,
    elastic_admission,
    extra_workload,
    has_quota,
    plan_extras,
    pod_set_template,
    run_workload,
    waiting_message,
)
from mixrl.operator.builders.objects import HASH_ANNOTATION, BuildOptions, Owner
from mixrl.operator.controller.observed_status import ADMITTED, Reason, pool_status, run_status
from mixrl.operator.controller.reconcile import admission_events, run_queue
from mixrl.operator.kube.rbac import FRAMEWORK, RECONCILER, WORKLOADS

from .support import small_run

OWNER = Owner("mixrl.dev/v1alpha1", "RLRun", "demo", "uid-1")


def resolved(manifest: Obj | None = None) -> ResolvedRun:
    run = parse_document(manifest or small_run())
    assert isinstance(run, RLRun)
    return resolve(run)


def products_of(pod_set: Obj) -> list[str]:
    terms = pod_set["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    return [
        value
        for term in terms["nodeSelectorTerms"]
        for e in term["matchExpressions"]
        for value in e["values"]
    ]


def gpus_of(pod_set: Obj) -> int:
    return sum(
        int(c["resources"]["requests"].get(GPU_RESOURCE, 0))
        for c in pod_set["template"]["spec"]["containers"]
    )


def test_one_workload_holds_the_trainers_nodes_and_every_pools_starting_replicas() -> None:
    workload = run_workload(resolved(), OWNER, BuildOptions(), "team-a")
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta2" and workload["kind"] == "Workload"
    assert workload["metadata"]["name"] == "demo"
    assert workload["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # goes with the run
    assert workload["metadata"]["labels"][QUEUE_LABEL] == "team-a"
    assert workload["spec"]["queueName"] == "team-a"
    pod_sets = {p["name"]: p for p in workload["spec"]["podSets"]}
    assert list(pod_sets) == ["trainer", "pool-b200", "pool-h100"]
    # small_run: trainer 2 nodes x 8 H200; b200 minReplicas 2; h100 minReplicas 1.
    assert (pod_sets["trainer"]["count"], gpus_of(pod_sets["trainer"])) == (2, 8)
    assert (pod_sets["pool-b200"]["count"], gpus_of(pod_sets["pool-b200"])) == (2, 1)
    assert (pod_sets["pool-h100"]["count"], gpus_of(pod_sets["pool-h100"])) == (1, 1)
    # The GPU product affinity, so Kueue picks the flavour of each set's GPU type.
    assert set(GPU_TABLE["H200"].gfd_products) <= set(products_of(pod_sets["trainer"]))
    assert set(GPU_TABLE["H100"].gfd_products) <= set(products_of(pod_sets["pool-h100"]))
    assert all(GPU_PRODUCT_LABEL in str(p["template"]) for p in pod_sets.values())


def test_a_pool_that_starts_at_zero_is_not_in_the_gang_but_one_with_min_zero_starts_with_one() -> None:
    manifest = small_run()
    manifest["spec"]["samplerPools"][1].update(minReplicas=0, maxReplicas=0)
    manifest["spec"]["samplerPools"][0].update(minReplicas=0)
    pod_sets = {
        p["name"]: p for p in run_workload(resolved(manifest), OWNER, BuildOptions(), "q")["spec"]["podSets"]
    }
    assert "pool-h100" not in pod_sets  # maxReplicas 0: nothing to admit
    assert pod_sets["pool-b200"]["count"] == 1  # the replica the pool is created with


def test_the_pod_sets_carry_what_kueue_counts_not_images_so_a_new_image_keeps_the_admission() -> None:
    base = run_workload(resolved(), OWNER, BuildOptions(), "q")
    manifest = small_run()
    manifest["spec"]["samplerPools"][0]["image"] = "registry.example/sglang:v2"
    manifest["spec"]["trainer"]["image"] = "registry.example/trainer:v2"
    assert run_workload(resolved(manifest), OWNER, BuildOptions(), "q") == base
    assert "image" not in str(base["spec"]["podSets"])
    bigger = copy.deepcopy(small_run())
    bigger["spec"]["trainer"]["nodes"] = 3
    changed = run_workload(resolved(bigger), OWNER, BuildOptions(), "q")
    assert (
        changed["metadata"]["annotations"][HASH_ANNOTATION]
        != base["metadata"]["annotations"][HASH_ANNOTATION]
    )


def test_pod_set_template_keeps_requests_limits_as_missing_requests_placement_and_init_containers() -> None:
    template = {
        "metadata": {"labels": {"a": "b"}, "annotations": {"x": "y"}},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "i",
                    "command": ["x"],
                    "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2", "nvidia.com/gpu": "2"}},
                }
            ],
            "initContainers": [{"name": "init", "image": "i", "resources": {"requests": {"memory": "1Gi"}}}],
            "affinity": {"nodeAffinity": {"r": 1}, "podAffinity": {"p": 1}},
            "tolerations": [{"key": "k", "operator": "Exists"}],
            "nodeSelector": {"n": "1"},
            "volumes": [{"name": "v"}],
        },
    }
    assert pod_set_template(template) == {
        "metadata": {"labels": {"a": "b"}},
        "spec": {
            "containers": [{"name": "c", "resources": {"requests": {"cpu": "1", "nvidia.com/gpu": "2"}}}],
            "initContainers": [{"name": "init", "resources": {"requests": {"memory": "1Gi"}}}],
            "affinity": {"nodeAffinity": {"r": 1}},
            "nodeSelector": {"n": "1"},
            "tolerations": [{"key": "k", "operator": "Exists"}],
        },
    }


def condition(kind: str, status: str, message: str = "", reason: str = "R") -> Obj:
    return {"type": kind, "status": status, "reason": reason, "message": message}


PENDING = "couldn't assign flavors to pod set trainer: insufficient unused quota for nvidia.com/gpu in flavor h100, 8 more needed"


def test_admission_is_kueues_admitted_condition_and_the_wait_is_told_in_kueues_words() -> None:
    waiting = {"status": {"conditions": [condition("QuotaReserved", "False", PENDING, "Pending")]}}
    assert not admitted(waiting) and not has_quota(waiting) and not admitted(None)
    assert waiting_message(waiting, "q") == f"LocalQueue q: {PENDING}"
    assert waiting_message(None, "q") == "waiting for Kueue to admit the run in LocalQueue q"
    done = {"status": {"conditions": [condition("QuotaReserved", "True"), condition("Admitted", "True")]}}
    assert admitted(done) and has_quota(done)
    evicted = {
        "status": {
            "conditions": [
                *done["status"]["conditions"],
                condition("Evicted", "True", "Preempted to make room"),
            ]
        }
    }
    assert not admitted(evicted)
    assert waiting_message(evicted, "q") == "LocalQueue q: Preempted to make room"


def test_a_queued_run_is_not_ready_and_says_why_and_admission_events_follow_the_condition() -> None:
    admission = ("False", Reason.QUEUED, f"LocalQueue q: {PENDING}")
    components: dict[str, Any] = dict.fromkeys(("TrainerReady", "BufferReady", "RouterReady", "RolloutReady"))
    status = run_status({}, 1, components, [], "2026-01-01T00:00:00Z", None, (), admission)
    assert status["phase"] == "Queued"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["reason"] == "Queued" and PENDING in conditions["Ready"]["message"]
    assert conditions[ADMITTED]["status"] == "False" and PENDING in conditions[ADMITTED]["message"]
    assert admission_events({}, status) == [("Normal", "Queued", f"LocalQueue q: {PENDING}")]
    assert admission_events(status, status) == []  # the same wait is not told again
    admitted_now = run_status(
        status, 1, components, [], "2026-01-01T00:01:00Z", None, (), ("True", "Admitted", "ok")
    )
    assert admitted_now["phase"] == "Pending"
    assert admission_events(status, admitted_now) == [("Normal", "Admitted", "ok")]
    left = run_status(admitted_now, 1, components, [], "2026-01-01T00:02:00Z", None, (), None)
    assert ADMITTED not in {c["type"] for c in left["conditions"]}  # no queue, no condition


def test_the_queue_is_the_specs_else_the_operators_default() -> None:
    assert run_queue({"spec": {"scheduling": {"queue": "mine"}}}, "default") == "mine"
    assert run_queue({"spec": {}}, "default") == "default"
    assert run_queue({"spec": {}}, None) is None


@pytest.mark.parametrize("queue", ["Team_A", "-a", "a" * 64])
def test_a_queue_that_is_not_a_dns_label_is_refused_naming_the_field(queue: str) -> None:
    manifest = small_run()
    manifest["spec"]["scheduling"] = {"queue": queue}
    with pytest.raises(InvalidSpec) as refused:
        parse_document(manifest)
    assert "spec.scheduling.queue" in refused.value.first_line


def test_the_operator_may_write_and_watch_workloads() -> None:
    key = (WORKLOADS.group, WORKLOADS.plural)
    assert RECONCILER[key] == {"get", "list", "create", "patch", "delete"}
    assert FRAMEWORK[key] == {"list", "watch"}


NOW = "2026-12-01T00:00:00Z"
POOL_OWNER = Owner("mixrl.dev/v1alpha1", "SamplerPool", "demo-h100", "uid-pool")
KUEUE_SAYS = "couldn't assign flavors to pod set pool-h100: insufficient unused quota for nvidia.com/gpu in flavor h100, 1 more needed"


def extra(index: int, admitted_: bool) -> Obj:
    conditions = (
        [condition("QuotaReserved", "True"), condition("Admitted", "True")]
        if admitted_
        else [condition("QuotaReserved", "False", KUEUE_SAYS, "Pending")]
    )
    return {
        "metadata": {"name": f"demo-h100-extra-{index}", "labels": {EXTRA_LABEL: str(index)}},
        "status": {"conditions": conditions},
    }


def test_an_extra_replica_is_one_workload_of_one_replicas_pods_owned_by_the_pool() -> None:
    run = resolved()
    pool = run.pool("h100")
    workload = extra_workload(run, pool, POOL_OWNER, BuildOptions(), "team-a", 3)
    assert workload["metadata"]["name"] == "demo-h100-extra-3"
    assert workload["metadata"]["ownerReferences"][0]["uid"] == "uid-pool"  # goes with the pool
    assert workload["metadata"]["labels"][EXTRA_LABEL] == "3"
    assert workload["metadata"]["labels"]["app.kubernetes.io/component"] == "sampler"
    assert workload["spec"]["queueName"] == "team-a"
    (pod_set,) = workload["spec"]["podSets"]
    # The pod set as the run's Workload has it for this pool, one replica's worth.
    in_run = next(
        p
        for p in run_workload(run, OWNER, BuildOptions(), "team-a")["spec"]["podSets"]
        if p["name"] == "pool-h100"
    )
    assert pod_set["name"] == "pool-h100" and pod_set["count"] == 1
    assert pod_set["template"] == in_run["template"] and gpus_of(pod_set) == 1
    assert set(GPU_TABLE["H100"].gfd_products) <= set(products_of(pod_set))


def test_extras_are_created_at_the_lowest_free_index_and_a_scale_down_drops_the_waiting_ones_first() -> None:
    one, two, three = extra(1, False), extra(2, True), extra(3, True)
    up = plan_extras([two], 3)
    assert up.keep == (two,) and up.create == (1, 3) and up.delete == ()
    down = plan_extras([one, two, three], 2)
    assert down.keep == (two, three) and down.create == () and down.delete == (one,)
    assert plan_extras([one, two, three], 0).delete == (two, three, one)
    assert plan_extras([], 0) == plan_extras([], 0) and plan_extras([], 2).create == (1, 2)


def test_the_pool_runs_its_start_and_the_admitted_extras_and_says_why_the_others_wait() -> None:
    elastic = elastic_admission(1, 4, "team", [extra(2, True), extra(1, False), extra(3, False)])
    assert (elastic.start, elastic.wanted, elastic.admitted, elastic.waiting, elastic.held) == (1, 3, 1, 2, 2)
    assert elastic.reason == f"LocalQueue team: {KUEUE_SAYS}"
    status = pool_status({}, 3, None, "sel", NOW, elastic=elastic)
    assert status["awaitingAdmission"] == 2
    (admission,) = [c for c in status["conditions"] if c["type"] == ADMITTED]
    assert admission["status"] == "False" and admission["reason"] == Reason.QUEUED
    assert admission["message"] == (
        f"2 replica(s) above the start wait for Kueue (1 with the run, 1 of 3 above it): LocalQueue team: {KUEUE_SAYS}"
    )
    every = elastic_admission(1, 2, "team", [extra(1, True)])
    status = pool_status(status, 3, None, "sel", NOW, elastic=every)
    (admission,) = [c for c in status["conditions"] if c["type"] == ADMITTED]
    assert admission["status"] == "True" and status["awaitingAdmission"] == 0
    # Below its start nothing is extra; the start is what the run's Workload holds.
    assert elastic_admission(2, 1, "team", []).held == 1
    # Out of the queue: the condition goes and the field is removed (null in the merge patch), once.
    out = pool_status(status, 3, None, "sel", NOW)
    assert out["awaitingAdmission"] is None and all(c["type"] != ADMITTED for c in out["conditions"])
    assert "awaitingAdmission" not in pool_status({"replicas": 0}, 3, None, "sel", NOW)
