"""A run Kueue holds (evicted, or queued again) against whoever scales its pools meanwhile: the
pools' workloads stay at zero and their extras' quota is given back until Kueue admits the run again,
which then gets the replicas it had — also after an operator restart (nothing is kept in memory).

Through the in-memory API stand-in of test_reconcile_faults (every read and write, merge patches)."""

from __future__ import annotations

import copy

from mixrl.operator.controller import reconcile as R

from .support import NAMESPACE
from .test_reconcile_faults import (
    ADMITTED_STATUS,
    POOL,
    TRAINER,
    WORKLOAD,
    Api,
    a_run,
    admitted_run,
    phase,
    reconcile,
    reconcile_pool,
    replicas,
)

DEPLOYMENT = ("Deployment", NAMESPACE, "demo-h100")


def extras(api: Api) -> list[tuple[str, str, str]]:
    return [k for k in api.objects if k[0] == "Workload" and k != WORKLOAD]


async def evicted_with_three(api: Api) -> None:
    """A queued run admitted, its h100 pool scaled to 3 (both extras admitted), then evicted."""
    await admitted_run(api)
    await reconcile_pool(api)
    for key in extras(api):
        api.objects[key]["status"] = copy.deepcopy(ADMITTED_STATUS)
    await reconcile_pool(api)
    assert replicas(api, DEPLOYMENT) == 3
    api.objects[WORKLOAD]["status"] = {}  # evicted
    await reconcile(api)
    await reconcile_pool(api)
    assert (replicas(api, TRAINER), replicas(api, POOL), replicas(api, DEPLOYMENT)) == (0, 0, 0)
    assert phase(api) == "Queued" and not extras(api)


RUN = ("RLRun", NAMESPACE, "demo")


async def test_a_held_pool_scaled_meanwhile_runs_nothing_and_asks_kueue_for_nothing() -> None:
    """The autoscaler (or kubectl scale) moves a held pool's replicas before the run's controller
    takes them back: the pool's own controller must not start engines Kueue has not admitted, nor
    ask Kueue for extras of a run it evicted."""
    api = Api()
    await evicted_with_three(api)
    api.objects[POOL]["spec"]["replicas"] = 4  # the autoscaler's decision while held
    await reconcile_pool(api)
    assert replicas(api, DEPLOYMENT) == 0
    assert not extras(api)
    status = api.objects[POOL]["status"]
    admitted = {c["type"]: c for c in status["conditions"]}["Admitted"]
    assert (admitted["status"], admitted["reason"], status["awaitingAdmission"]) == ("False", "Queued", 4)
    assert admitted["message"].startswith("the run waits for Kueue")


async def test_a_held_pool_gets_its_replicas_back_across_an_autoscaler_decision_and_a_restart() -> None:
    api = Api()
    await evicted_with_three(api)
    api.objects[POOL]["spec"]["replicas"] = 1  # the autoscaler clamps the held pool to its minimum
    await reconcile_pool(api)
    await reconcile(api)  # the run's controller holds it at zero again, keeping what it had
    assert replicas(api, POOL) == 0
    assert api.objects[POOL]["metadata"]["annotations"][R.HELD_REPLICAS_ANNOTATION] == "3"
    # An operator restart keeps nothing in memory: every reconcile starts from the objects.
    await reconcile(api)
    await reconcile_pool(api)
    assert (replicas(api, POOL), replicas(api, DEPLOYMENT)) == (0, 0)
    api.objects[WORKLOAD]["status"] = copy.deepcopy(ADMITTED_STATUS)  # admitted again
    await reconcile(api)
    await reconcile_pool(api)
    assert (replicas(api, TRAINER), replicas(api, POOL)) == (2, 3)
    assert R.HELD_REPLICAS_ANNOTATION not in api.objects[POOL]["metadata"].get("annotations", {})
    assert len(extras(api)) == 2  # asked of Kueue again
    assert replicas(api, DEPLOYMENT) == 1  # the start, until Kueue admits them


async def test_a_run_of_more_pod_sets_than_a_workload_holds_says_so_and_creates_nothing() -> None:
    """Kueue's Workload holds at most 8 pod sets; validation allows 32 pools.  The API server would
    refuse the Workload on every retry while the run said it waits for Kueue."""
    api = Api()
    run = a_run("team-a")
    run["spec"]["samplerPools"] = [
        {"name": f"p{i}", "gpuType": "H100", "weightPrecision": "fp8", "minReplicas": 1, "maxReplicas": 2}
        for i in range(8)
    ]
    api.objects[RUN] = run
    await reconcile(api)
    admitted = {c["type"]: c for c in api.objects[RUN]["status"]["conditions"]}["Admitted"]
    assert admitted["status"] == "False" and "at most 8" in admitted["message"]
    assert phase(api) == "Queued"
    assert WORKLOAD not in api.objects and TRAINER not in api.objects
    api.objects[RUN]["spec"]["samplerPools"][7].update(minReplicas=0, maxReplicas=0)  # 8 pod sets now
    await reconcile(api)
    assert WORKLOAD in api.objects and len(api.objects[WORKLOAD]["spec"]["podSets"]) == 8
