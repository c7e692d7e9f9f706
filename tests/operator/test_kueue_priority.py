"""A queued run's Kueue Workloads at its pods' priority (``--kueue-workload-priority``): the class
they take, the value read from the cluster's PriorityClass, an admitted Workload left at the priority
it was admitted with, and a class the cluster lacks said in one line.

Pure builders, then the reconcilers through the in-memory API stand-in of test_reconcile_faults.
Kueue ordering its queue by that priority: tests/cluster/test_kueue.py."""

from __future__ import annotations

import copy

from mixrl.api.kube_types import Obj
from mixrl.operator.builders.kueue import (
    priority_class_name,
    run_workload,
    with_priority,
    with_priority_of,
)
from mixrl.operator.builders.objects import HASH_ANNOTATION, BuildOptions, Owner
from mixrl.operator.controller.observed_status import Reason

from .support import NAMESPACE
from .test_kueue import resolved
from .test_reconcile_faults import (
    ADMITTED_STATUS,
    POOL,
    RUN,
    TRAINER,
    WORKLOAD,
    Api,
    a_run,
    reconcile,
    reconcile_pool,
)

OWNER = Owner("mixrl.dev/v1alpha1", "RLRun", "demo", "uid-1")
HIGH = {
    "apiVersion": "scheduling.k8s.io/v1",
    "kind": "PriorityClass",
    "metadata": {"name": "rl-high"},
    "value": 1000,
}
LOW = {
    "apiVersion": "scheduling.k8s.io/v1",
    "kind": "PriorityClass",
    "metadata": {"name": "rl-low"},
    "value": 10,
}


def scheduled(manifest: Obj, trainer: str | None = None, pools: dict[str, str] | None = None) -> Obj:
    """``manifest`` with the trainer's and the named pools' priorityClassName set."""
    out = copy.deepcopy(manifest)
    if trainer is not None:
        out["spec"]["trainer"]["scheduling"] = {"priorityClassName": trainer}
    for pool in out["spec"]["samplerPools"]:
        if pool["name"] in (pools or {}):
            pool["scheduling"] = {"priorityClassName": (pools or {})[pool["name"]]}
    return out


def workload_of(manifest: Obj) -> Obj:
    return run_workload(resolved(manifest), OWNER, BuildOptions(), "team-a")


def test_the_class_is_the_trainers_else_the_first_pools_naming_one() -> None:
    assert priority_class_name(workload_of(a_run())) is None
    both = scheduled(a_run(), trainer="rl-high", pools={"h100": "rl-low"})
    assert priority_class_name(workload_of(both)) == "rl-high"
    assert priority_class_name(workload_of(scheduled(a_run(), pools={"h100": "rl-low"}))) == "rl-low"


def test_a_priority_is_the_class_and_its_value_and_changes_the_hash_not_the_workload_it_came_from() -> None:
    plain = workload_of(scheduled(a_run(), trainer="rl-high"))
    before = copy.deepcopy(plain)
    high = with_priority(plain, "rl-high", 1000)
    assert high["spec"]["priorityClassRef"] == {
        "group": "scheduling.k8s.io",
        "kind": "PriorityClass",
        "name": "rl-high",
    }
    assert high["spec"]["priority"] == 1000 and high["spec"]["podSets"] == plain["spec"]["podSets"]
    assert (
        high["metadata"]["annotations"][HASH_ANNOTATION] != plain["metadata"]["annotations"][HASH_ANNOTATION]
    )
    assert plain == before
    # What a live Workload has: its fields taken, or dropped when it had none.
    assert with_priority_of(plain, high) == high
    assert with_priority_of(high, plain) == plain


async def test_the_workload_takes_the_value_of_its_pods_class_only_with_the_flag() -> None:
    api = Api()
    api.objects[("PriorityClass", "", "rl-high")] = copy.deepcopy(HIGH)
    api.objects[RUN] = scheduled(a_run("team-a"), trainer="rl-high")
    await reconcile(api)
    assert "priority" not in api.objects[WORKLOAD]["spec"]  # off: Kueue's default priority
    await reconcile(api, workload_priority=True)
    spec = api.objects[WORKLOAD]["spec"]
    assert (spec["priorityClassRef"]["name"], spec["priority"]) == ("rl-high", 1000)


async def test_an_admitted_workload_keeps_its_priority_and_is_not_queued_again() -> None:
    """Turning the flag on over an admitted run made without a priority changes nothing of it: Kueue
    refuses a new class on a Workload holding quota, and a new Workload would queue the run again."""
    api = Api()
    api.objects[("PriorityClass", "", "rl-high")] = copy.deepcopy(HIGH)
    api.objects[RUN] = scheduled(a_run("team-a"), trainer="rl-high")
    await reconcile(api)
    api.objects[WORKLOAD]["status"] = copy.deepcopy(ADMITTED_STATUS)
    await reconcile(api)
    uid = api.objects[WORKLOAD]["metadata"]["uid"]
    outcome = await reconcile(api, workload_priority=True)
    assert not outcome.report.recreated and api.objects[WORKLOAD]["metadata"]["uid"] == uid
    assert "priority" not in api.objects[WORKLOAD]["spec"]
    assert int(api.objects[TRAINER]["spec"]["replicas"]) == 2
    # Its pod sets change (more trainer nodes): made again, now at its class's priority.
    api.objects[RUN]["spec"]["trainer"]["nodes"] = 3
    await reconcile(api, workload_priority=True)
    await reconcile(api, workload_priority=True)
    assert api.objects[WORKLOAD]["spec"]["priority"] == 1000
    # Admitted at it, it stays as it is.
    api.objects[WORKLOAD]["status"] = copy.deepcopy(ADMITTED_STATUS)
    uid = api.objects[WORKLOAD]["metadata"]["uid"]
    outcome = await reconcile(api, workload_priority=True)
    assert not outcome.report.recreated and api.objects[WORKLOAD]["metadata"]["uid"] == uid


async def test_a_class_the_cluster_lacks_is_said_in_one_line_and_nothing_is_created() -> None:
    api = Api()
    api.objects[RUN] = scheduled(a_run("team-a"), trainer="rl-missing")
    outcome = await reconcile(api, workload_priority=True)
    assert WORKLOAD not in api.objects and TRAINER not in api.objects
    admitted = next(c for c in api.objects[RUN]["status"]["conditions"] if c["type"] == "Admitted")
    assert (admitted["status"], admitted["reason"]) == ("False", Reason.PRIORITY_CLASS_MISSING)
    assert "priorityClassName rl-missing: no PriorityClass of that name" in admitted["message"]
    assert "\n" not in admitted["message"]
    assert ("Warning", Reason.QUEUED, admitted["message"]) in outcome.events


async def test_an_extra_replica_takes_its_pools_class() -> None:
    """The run's Workload has the trainer's class; a pool's extra replica, its pool's (its pods')."""
    api = Api()
    for found in (HIGH, LOW):
        api.objects[("PriorityClass", "", found["metadata"]["name"])] = copy.deepcopy(found)
    api.objects[RUN] = scheduled(a_run("team-a"), trainer="rl-high", pools={"h100": "rl-low"})
    await reconcile(api, workload_priority=True)
    api.objects[WORKLOAD]["status"] = copy.deepcopy(ADMITTED_STATUS)
    await reconcile(api, workload_priority=True)
    api.objects[POOL]["spec"]["replicas"] = 2
    await reconcile_pool(api, workload_priority=True)
    (extra,) = [o for k, o in api.objects.items() if k[0] == "Workload" and k != WORKLOAD]
    assert extra["metadata"]["namespace"] == NAMESPACE
    assert (extra["spec"]["priorityClassRef"]["name"], extra["spec"]["priority"]) == ("rl-low", 10)
    assert api.objects[WORKLOAD]["spec"]["priority"] == 1000


async def test_an_extra_replica_of_a_class_the_cluster_lacks_is_not_created_and_says_why() -> None:
    api = Api()
    api.objects[("PriorityClass", "", "rl-high")] = copy.deepcopy(HIGH)
    api.objects[RUN] = scheduled(a_run("team-a"), trainer="rl-high", pools={"h100": "rl-gone"})
    await reconcile(api, workload_priority=True)
    api.objects[WORKLOAD]["status"] = copy.deepcopy(ADMITTED_STATUS)
    await reconcile(api, workload_priority=True)
    api.objects[POOL]["spec"]["replicas"] = 2
    outcome = await reconcile_pool(api, workload_priority=True)
    assert not [k for k in api.objects if k[0] == "Workload" and k != WORKLOAD]
    (failure,) = outcome.report.failures
    assert failure.object == "Workload/demo-h100-extra-1" and not failure.retry
    assert failure.reason == Reason.PRIORITY_CLASS_MISSING and "rl-gone" in failure.message
    progressing = next(c for c in api.objects[POOL]["status"]["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", Reason.PRIORITY_CLASS_MISSING)
