"""The warm pool's state machine (pure): fill, lease, recycle, time out, back off, shut down; and
the pool's rounds reading every pod it holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from mixrl.rl.sandbox.kubernetes import SandboxPods
from mixrl.rl.sandbox.lease import BACKOFF_S, PoolState


def pool(size: int = 2, ready_timeout_s: float = 10.0) -> PoolState:
    return PoolState("w-0", size, ready_timeout_s, token="t")


def ready_all(state: PoolState, now: float) -> None:
    for index, name in enumerate(sorted(state.slots)):
        state.observe(name, now, ready=True, address=f"10.0.0.{index + 1}")


def test_it_fills_to_its_size_once_and_names_pods_after_the_worker() -> None:
    state = pool(3)
    plan = state.plan(0.0)
    assert plan.create == ("w-0-sb-t-1", "w-0-sb-t-2", "w-0-sb-t-3") and plan.delete == ()
    assert state.plan(1.0).create == ()  # asked for already
    assert state.lease(1.0, 5.0) is None  # none ready yet


def test_a_pod_is_leased_once_then_deleted_and_replaced_never_reused() -> None:
    state = pool(2)
    state.plan(0.0)
    ready_all(state, 1.0)
    first = state.lease(2.0, 5.0)
    second = state.lease(2.0, 5.0)
    assert first is not None and second is not None and first[0] != second[0]
    assert state.lease(2.0, 5.0) is None  # both busy: the size bounds commands at once
    assert state.plan(2.5).create == ()
    state.release(first[0], 3.0)
    plan = state.plan(3.0)
    assert plan.delete == (first[0],)
    assert plan.create == ("w-0-sb-t-3",)  # a fresh pod, not the dirty one
    state.gone(first[0])
    assert first[0] not in state.slots
    state.observe("w-0-sb-t-3", 4.0, ready=True, address="10.0.0.9")
    assert state.lease(4.0, 5.0) == ("w-0-sb-t-3", "10.0.0.9")


def test_the_longest_ready_pod_is_leased_first_and_an_address_is_needed() -> None:
    state = pool(2)
    state.plan(0.0)
    state.observe("w-0-sb-t-2", 1.0, ready=True, address="10.0.0.2")
    state.observe("w-0-sb-t-1", 2.0, ready=True, address=None)  # ready but no IP yet: not leasable
    assert state.lease(3.0, 5.0) == ("w-0-sb-t-2", "10.0.0.2")
    assert state.lease(3.0, 5.0) is None


def test_a_pod_not_ready_in_time_is_deleted_and_replaced() -> None:
    state = pool(1, ready_timeout_s=10.0)
    state.plan(0.0)
    assert state.plan(10.0).delete == ()
    plan = state.plan(10.5)
    assert plan.delete == ("w-0-sb-t-1",) and plan.create == ("w-0-sb-t-2",)
    assert "not ready after 10 s" in state.last_problem


def test_a_lease_held_past_its_deadline_is_deleted() -> None:
    state = pool(1)
    state.plan(0.0)
    ready_all(state, 1.0)
    leased = state.lease(1.0, hold_s=5.0)
    assert leased is not None
    assert state.plan(6.0).delete == ()
    plan = state.plan(6.5)
    assert plan.delete == (leased[0],) and len(plan.create) == 1
    state.release(leased[0], 7.0)  # the late release changes nothing
    assert state.slots[leased[0]].state == "deleting"


def test_a_failed_pod_is_replaced_but_a_leased_one_waits_for_its_release() -> None:
    state = pool(2)
    state.plan(0.0)
    ready_all(state, 1.0)
    leased = state.lease(1.0, 5.0)
    assert leased is not None
    idle = next(name for name in state.slots if name != leased[0])
    state.observe(idle, 2.0, ready=False, address=None, ended="phase Failed: Evicted")
    state.observe(leased[0], 2.0, ready=False, address=None, ended="gone")
    assert state.slots[idle].state == "deleting" and state.slots[leased[0]].state == "leased"
    assert state.plan(2.0).delete == (idle,)


def test_failed_creations_back_off() -> None:
    state = pool(1)
    [name] = state.plan(0.0).create
    state.create_failed(name, 0.0, "403 forbidden")
    assert state.plan(0.5).create == ()
    [again] = state.plan(BACKOFF_S[0]).create
    state.create_failed(again, 1.0, "403 forbidden")
    assert state.plan(1.0 + BACKOFF_S[1] - 0.1).create == ()
    assert state.plan(1.0 + BACKOFF_S[1]).create
    assert "403 forbidden" in state.last_problem


def test_shutdown_deletes_everything_and_creates_nothing_more() -> None:
    state = pool(3)
    state.plan(0.0)
    ready_all(state, 1.0)
    state.lease(1.0, 5.0)
    assert set(state.shutdown(2.0)) == set(state.slots) and len(state.slots) == 3
    plan = state.plan(3.0)
    assert plan.create == () and len(plan.delete) == 3


def test_bad_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="poolSize"):
        pool(0)
    with pytest.raises(ValueError, match="readyTimeoutSeconds"):
        pool(1, ready_timeout_s=0)


async def test_a_warm_pod_that_dies_before_its_lease_is_replaced_not_leased() -> None:
    class Pods:
        def __init__(self) -> None:
            self.pods: dict[str, dict[str, Any]] = {}

        async def create(self, pod: dict[str, Any]) -> None:
            ready = {
                "phase": "Running",
                "podIP": "10.0.0.9",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
            self.pods[pod["metadata"]["name"]] = {**pod, "status": ready}

        async def get(self, name: str) -> dict[str, Any] | None:
            return self.pods.get(name)

        async def list(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
            return []

        async def delete(self, name: str) -> None:
            self.pods.pop(name, None)

    template = {
        "kind": "Pod",
        "metadata": {},
        "spec": {"containers": [{"ports": [{"name": "executor", "containerPort": 8790}]}]},
    }
    api = Pods()
    pool = SandboxPods(api, template, worker="w", size=1)
    await pool.step()  # created
    await pool.step()  # ready
    [(name, slot)] = pool.state.slots.items()
    assert slot.state == "ready"
    api.pods[name]["status"] = {"phase": "Failed", "reason": "Evicted"}  # dies while it waits
    await pool.step()  # read: marked for deletion, not leasable (before, it was leased)
    assert pool.state.slots[name].state == "deleting" and pool.state.lease(0.0, 10.0) is None
    await pool.step()  # deleted, and a fresh one asked for
    assert name not in api.pods and len(api.pods) == 1
