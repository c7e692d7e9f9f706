"""The live status loop (mixrl.operator.controller.observer) against the API's failures and gaps:
events of one moment each have a name, one event that cannot be posted does not stop the rest,
a run deleted while the watch was away is forgotten."""

from __future__ import annotations

from typing import Any

import pytest

from mixrl.api.kube_types import Obj
from mixrl.operator.controller import observer as O
from mixrl.operator.controller.live_status import PODS_PLACED
from mixrl.operator.controller.observer import RunMemory, StatusObserver
from mixrl.operator.kube.client import ApiError
from mixrl.operator.kube.events import event_object
from mixrl.operator.kube.rbac import RLRUNS, ApiResource

from .support import NAMESPACE, small_run
from .test_reconcile_faults import Api


def a_run() -> Obj:
    run = small_run()
    run["metadata"].update(uid="run-uid", generation=1)
    return run


def test_events_of_one_moment_about_one_object_have_names_of_their_own() -> None:
    run = a_run()
    names = {
        event_object(RLRUNS, run, "Warning", reason, "m", 1_700_000_000.5, "mixrl-status")["metadata"]["name"]
        for reason in ("Unschedulable", "Succeeded", "Unschedulable")
    }
    assert len(names) == 3
    assert all(name.startswith("demo.") and len(name) <= 253 for name in names)


class Events(Api):
    """The stand-in, where Event names are unique (409 otherwise) and the first ``refuse`` fail."""

    def __init__(self, refuse: int = 0) -> None:
        super().__init__()
        self.refuse = refuse
        self.posted: list[str] = []

    async def create(self, r: ApiResource, ns: str, body: Obj) -> Obj:
        if r.kind == "Event":
            if self.refuse:
                self.refuse -= 1
                raise ApiError(503, "ServiceUnavailable", "no")
            if (r.kind, ns, body["metadata"]["name"]) in self.objects:
                raise ApiError(409, "AlreadyExists", body["metadata"]["name"])
            self.posted.append(body["reason"])
        return await super().create(r, ns, body)


def placed_false() -> Obj:
    return {"type": PODS_PLACED, "status": "False", "reason": "Unschedulable", "message": "no GPUs"}


@pytest.mark.parametrize("refuse", [0, 1])
async def test_every_event_of_a_runs_end_is_posted_and_the_gpus_released_whatever_one_event_met(
    refuse: int,
) -> None:
    api = Events(refuse)
    asked: list[tuple[str, str]] = []
    observer = StatusObserver(api, reconcile=lambda ns, name: asked.append((ns, name)))  # type: ignore[arg-type]
    new = {"phase": "Succeeded", "message": "finished", "conditions": [placed_false()]}
    await observer._events(a_run(), {"phase": "Running"}, new, RunMemory(), 1_700_000_000.0)
    assert api.posted == (["Unschedulable", "Succeeded"] if not refuse else ["Succeeded"])
    assert asked == [(NAMESPACE, "demo")]  # the reconcile that scales the ended run to zero


async def test_a_run_deleted_while_the_watch_was_away_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_prometheus(*args: Any, **kwargs: Any) -> Any:
        raise O.PrometheusError("Unreachable", "no")

    monkeypatch.setattr(O, "query_vector", no_prometheus)
    monkeypatch.setattr(O, "query_history", no_prometheus)
    api = Api()  # holds no run: it was deleted, and kopf told nobody
    observer = StatusObserver(api, clock=lambda: 1_700_000_000.0)  # type: ignore[arg-type]
    observer.observe_run(a_run(), deleted=False)
    try:
        await observer.tick()
    finally:
        await observer.stop()
    assert observer.runs == {} and observer.memory == {}
