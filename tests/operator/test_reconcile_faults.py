"""The reconcilers against API failures that come and go, through an in-memory API stand-in
(every read and write, server-side apply as a merge, faults per kind and verb): a failed read is
not an eviction, a failed cleanup is retried, an ended run is never started again."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from mixrl.api.kube_types import Obj
from mixrl.operator.builders.objects import Images
from mixrl.operator.controller import reconcile as R
from mixrl.operator.controller.apply import merged
from mixrl.operator.controller.discovery import Discovery
from mixrl.operator.controller.observed_status import ADMITTED
from mixrl.operator.kube.cache import ObjectCache
from mixrl.operator.kube.client import ApiError
from mixrl.operator.kube.rbac import ApiResource

from .emulator import keep_string_data
from .support import NAMESPACE, small_run

RUN = ("RLRun", NAMESPACE, "demo")
POOL = ("SamplerPool", NAMESPACE, "demo-h100")
TRAINER = ("StatefulSet", NAMESPACE, "demo-trainer")
WORKLOAD = ("Workload", NAMESPACE, "demo")
ADMITTED_STATUS = {
    "admission": {"clusterQueue": "cq"},
    "conditions": [
        {"type": "QuotaReserved", "status": "True"},
        {"type": "Admitted", "status": "True"},
    ],
}


class Api:
    """Objects by (kind, namespace, name); ``faults`` maps (kind, verb) to how many of those
    calls fail next (verb: get, list, delete, write)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], Obj] = {}
        self.cache = ObjectCache()
        self.faults: dict[tuple[str, str], int] = {}
        self.uids = 0

    def fault(self, kind: str, verb: str) -> None:
        left = self.faults.get((kind, verb), 0)
        if left:
            self.faults[(kind, verb)] = left - 1
            raise ApiError(503, "ServiceUnavailable", f"{verb} {kind} failed")

    async def get(
        self, r: ApiResource, ns: str, name: str, subresource: Any = None, cached: bool = False
    ) -> Obj | None:
        self.fault(r.kind, "get")
        return copy.deepcopy(self.objects.get((r.kind, ns, name)))

    async def get_cluster(self, r: ApiResource, name: str) -> Obj | None:
        return await self.get(r, "", name)

    async def list(
        self, r: ApiResource, ns: str, labels: dict[str, str], cached: bool = False, field_selector: str = ""
    ) -> list[Obj]:
        self.fault(r.kind, "list")
        return [
            copy.deepcopy(o)
            for (kind, namespace, _), o in self.objects.items()
            if (kind, namespace) == (r.kind, ns)
            and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    async def _write(self, r: ApiResource, ns: str, name: str, body: Obj) -> Obj:
        self.fault(r.kind, "write")
        old = self.objects.get((r.kind, ns, name))
        new = copy.deepcopy(body) if old is None else merged(old, body)
        keep_string_data(new)
        if "uid" not in new["metadata"]:
            self.uids += 1
            new["metadata"]["uid"] = f"uid-{self.uids}"
        self.objects[(r.kind, ns, name)] = new
        return copy.deepcopy(new)

    async def apply(self, r: ApiResource, ns: str, name: str, body: Obj) -> Obj:
        return await self._write(r, ns, name, body)

    async def create(self, r: ApiResource, ns: str, body: Obj) -> Obj:
        return await self._write(r, ns, body["metadata"]["name"], body)

    async def merge_patch(
        self, r: ApiResource, ns: str, name: str, body: Obj, subresource: Any = None
    ) -> Obj:
        written = await self._write(r, ns, name, body)
        _drop_nulls(self.objects[(r.kind, ns, name)])  # RFC 7386: null removes the key
        return written

    async def delete(
        self, r: ApiResource, ns: str, name: str, propagation: str = "Background", uid: Any = None
    ) -> bool:
        self.fault(r.kind, "delete")
        return self.objects.pop((r.kind, ns, name), None) is not None


def _drop_nulls(obj: Obj) -> None:
    for key, value in list(obj.items()):
        if value is None:
            del obj[key]
        elif isinstance(value, dict):
            _drop_nulls(value)


class AllServed(Discovery):
    async def serves(self, resource: ApiResource) -> bool:
        return True


def context(api: Api, workload_priority: bool = False) -> R.Context:
    discovery = AllServed(api, Images(), monitoring_mode="annotations", keda_mode="off")  # type: ignore[arg-type]
    return R.Context(client=api, discovery=discovery, workload_priority=workload_priority)  # type: ignore[arg-type]


def a_run(queue: str | None = None) -> Obj:
    run = small_run()
    run["metadata"].update(uid="run-uid", generation=1)
    if queue is not None:
        run["spec"]["scheduling"] = {"queue": queue}
    return run


async def reconcile(api: Api, workload_priority: bool = False) -> R.Outcome:
    return await R.reconcile_run(context(api, workload_priority), copy.deepcopy(api.objects[RUN]))


async def reconcile_pool(api: Api, workload_priority: bool = False) -> R.Outcome:
    return await R.reconcile_pool(context(api, workload_priority), copy.deepcopy(api.objects[POOL]))


def replicas(api: Api, key: tuple[str, str, str]) -> int:
    return int(api.objects[key]["spec"]["replicas"])


def phase(api: Api) -> str | None:
    return api.objects[RUN]["status"].get("phase")


async def admitted_run(api: Api) -> None:
    """A queued run Kueue admitted, running, its h100 pool scaled to 3 by the autoscaler."""
    api.objects[RUN] = a_run("team-a")
    await reconcile(api)
    api.objects[WORKLOAD]["status"] = copy.deepcopy(ADMITTED_STATUS)
    await reconcile(api)
    api.objects[POOL]["spec"]["replicas"] = 3
    await reconcile(api)
    assert (replicas(api, TRAINER), replicas(api, POOL)) == (2, 3)


async def test_a_failed_read_of_an_admitted_runs_workload_changes_nothing_and_is_retried() -> None:
    api = Api()
    await admitted_run(api)
    before = copy.deepcopy(api.objects)
    api.faults[("Workload", "get")] = 1
    with pytest.raises(ApiError):  # the runtime retries it (with backoff)
        await reconcile(api)
    assert api.objects == before  # not held at zero, not Queued, no replicas lost
    await reconcile(api)
    assert (replicas(api, TRAINER), replicas(api, POOL), phase(api)) == (2, 3, "Pending")


async def test_a_workload_kueue_does_not_admit_still_holds_the_run_at_zero() -> None:
    api = Api()
    await admitted_run(api)
    api.objects[WORKLOAD]["status"] = {}  # evicted
    await reconcile(api)
    assert (replicas(api, TRAINER), replicas(api, POOL), phase(api)) == (0, 0, "Queued")


@pytest.mark.parametrize("min_replicas", [0, 1])
async def test_a_run_admitted_again_gets_its_pools_replicas_back(min_replicas: int) -> None:
    """Held at zero by an eviction, a pool came back to minReplicas (none at all with 0, so a run
    without an autoscaler never served again); it gets the replicas it had."""
    api = Api()
    api.objects[RUN] = a_run("team-a")
    for pool in api.objects[RUN]["spec"]["samplerPools"]:
        pool.update(minReplicas=min_replicas, maxReplicas=4)
    await reconcile(api)
    api.objects[WORKLOAD]["status"] = copy.deepcopy(ADMITTED_STATUS)
    await reconcile(api)
    api.objects[POOL]["spec"]["replicas"] = 3  # the autoscaler, kubectl scale
    await reconcile(api)
    api.objects[WORKLOAD]["status"] = {}  # evicted
    await reconcile(api)
    assert (replicas(api, TRAINER), replicas(api, POOL), phase(api)) == (0, 0, "Queued")
    api.objects[WORKLOAD]["status"] = {}  # still queued: a second write must keep what it had
    api.objects[RUN]["spec"]["rollout"] = {"workers": 3}
    await reconcile(api)
    api.objects[WORKLOAD]["status"] = copy.deepcopy(ADMITTED_STATUS)
    await reconcile(api)
    assert (replicas(api, TRAINER), replicas(api, POOL)) == (2, 3)
    assert R.HELD_REPLICAS_ANNOTATION not in api.objects[POOL]["metadata"].get("annotations", {})


async def test_a_pool_whose_extras_cannot_be_read_keeps_its_replicas() -> None:
    api = Api()
    await admitted_run(api)
    await reconcile_pool(api)  # creates the extras for replicas above the start
    extras = [k for k in api.objects if k[0] == "Workload" and k[2] != "demo"]
    assert len(extras) == 2
    for key in extras:
        api.objects[key]["status"] = copy.deepcopy(ADMITTED_STATUS)
    await reconcile_pool(api)
    assert replicas(api, ("Deployment", NAMESPACE, "demo-h100")) == 3
    api.faults[("Workload", "list")] = 1
    with pytest.raises(ApiError):
        await reconcile_pool(api)
    assert replicas(api, ("Deployment", NAMESPACE, "demo-h100")) == 3


async def test_a_workload_whose_deletion_failed_at_the_runs_end_is_deleted_by_the_retry() -> None:
    api = Api()
    await admitted_run(api)
    api.objects[RUN]["status"]["phase"] = "Succeeded"  # the live status loop
    api.faults[("Workload", "delete")] = 1
    outcome = await reconcile(api)
    assert [f.object for f in outcome.report.retryable] == ["Workload/demo"]
    assert ADMITTED in {c["type"] for c in api.objects[RUN]["status"]["conditions"]}  # the marker stays
    assert WORKLOAD in api.objects
    outcome = await reconcile(api)
    assert not outcome.report.failures and WORKLOAD not in api.objects
    assert ADMITTED not in {c["type"] for c in api.objects[RUN]["status"]["conditions"]}
    assert (replicas(api, TRAINER), replicas(api, POOL)) == (0, 0)


async def test_a_pools_extras_whose_deletion_failed_when_the_run_ended_are_deleted_by_the_retry() -> None:
    api = Api()
    await admitted_run(api)
    await reconcile_pool(api)
    assert "awaitingAdmission" in api.objects[POOL]["status"]
    api.objects[RUN]["status"]["phase"] = "Succeeded"
    api.faults[("Workload", "delete")] = 1
    with pytest.raises(ApiError):
        await reconcile_pool(api)
    assert "awaitingAdmission" in api.objects[POOL]["status"]  # the marker stays
    await reconcile_pool(api)
    assert not [k for k in api.objects if k[0] == "Workload" and k[2] != "demo"]


@pytest.mark.parametrize("final", ["Succeeded", "Failed"])
async def test_an_ended_run_whose_spec_turns_invalid_keeps_its_phase_and_is_not_restarted(final: str) -> None:
    api = Api()
    api.objects[RUN] = a_run()
    await reconcile(api)
    api.objects[RUN]["status"]["phase"] = final
    await reconcile(api)
    assert (replicas(api, TRAINER), replicas(api, POOL)) == (0, 0)
    api.objects[RUN]["spec"]["weights"]["broadcast"] = True
    api.objects[RUN]["metadata"]["generation"] = 2
    outcome = await reconcile(api)
    assert outcome.invalid is not None and phase(api) == final
    invalid = {c["type"]: c for c in api.objects[RUN]["status"]["conditions"]}["InvalidSpec"]
    assert invalid["status"] == "True"
    api.objects[RUN]["spec"]["weights"]["broadcast"] = False
    api.objects[RUN]["metadata"]["generation"] = 3
    await reconcile(api)
    assert phase(api) == final
    assert (replicas(api, TRAINER), replicas(api, POOL)) == (0, 0)
