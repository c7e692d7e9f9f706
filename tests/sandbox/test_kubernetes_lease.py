"""The warm pool's state machine (pure): fill, lease, recycle, time out, back off, shut down; and
the pool's rounds reading every pod it holds."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from mixrl.rl.sandbox.kubernetes import PodApiError, SandboxPods
from mixrl.rl.sandbox.lease import BACKOFF_S, PoolState

from .pods import InstantPods, executor_template


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


def test_one_refused_round_is_one_failure_however_many_pods_it_asked_for() -> None:
    state = pool(6)
    plan = state.plan(0.0)
    for name in plan.create:  # one quota refusing the whole round
        state.create_failed(name, 0.0, "403 exceeded quota")
    assert state.retry_at == BACKOFF_S[0]  # was 30 s: one failure counted per pod
    again = state.plan(BACKOFF_S[0]).create
    assert len(again) == 6
    for name in again:
        state.create_failed(name, BACKOFF_S[0], "403 exceeded quota")
    assert state.retry_at == BACKOFF_S[0] + BACKOFF_S[1]


def test_a_create_that_may_have_happened_is_deleted_not_forgotten() -> None:
    state = pool(1)
    [name] = state.plan(0.0).create
    state.create_failed(name, 0.0, "timed out", maybe_created=True)
    assert state.slots[name].state == "deleting" and "timed out" in state.last_problem
    plan = state.plan(BACKOFF_S[0])
    assert plan.delete == (name,) and len(plan.create) == 1  # the fresh one replaces it, as a release does


TEMPLATE = executor_template()


async def test_a_create_call_lost_on_the_way_back_leaves_no_pod_behind() -> None:
    class AnswerLost(InstantPods):
        async def create(self, pod: dict[str, Any]) -> None:
            await super().create(pod)  # the API server made it...
            raise TimeoutError()  # ...but its answer never came

    now = [0.0]
    api = AnswerLost()
    pods = SandboxPods(api, TEMPLATE, worker="w", size=1, clock=lambda: now[0])
    await pods.step()
    [name] = pods.state.slots
    assert pods.state.slots[name].state == "deleting"
    await pods.step()  # within the back-off: deleted, none created
    assert api.pods == {} and pods.state.slots == {}


async def test_a_refused_create_is_forgotten_without_a_deletion() -> None:
    class Refused(InstantPods):
        async def create(self, pod: dict[str, Any]) -> None:
            raise PodApiError("POST pods: 403 exceeded quota", status=403)

    api = Refused()
    pods = SandboxPods(api, TEMPLATE, worker="w", size=1, clock=lambda: 0.0)
    await pods.step()
    await pods.step()
    assert pods.state.slots == {} and api.deleted == []
    assert "exceeded quota" in pods.state.last_problem


async def test_commands_queued_behind_a_busy_pool_wait_their_turn_not_a_timeout() -> None:
    """More commands than pods: the time every pod runs another command does not count as no pod
    becoming ready (it did: 2 s in, the third pair was refused 'none became ready ... (none was
    created)')."""
    pods = SandboxPods(InstantPods(), TEMPLATE, worker="w", size=2, ready_timeout_s=0.5, poll_s=0.02)
    await pods.start()

    async def command() -> str:
        async with pods.lease(hold_s=30) as (name, _):
            await asyncio.sleep(0.6)  # each longer than half the 1 s wait: four rounds take 2.4 s
            return name

    try:
        names = await asyncio.gather(*(command() for _ in range(8)))
    finally:
        await pods.close()
    assert len(set(names)) == 8  # each in a fresh pod


async def test_close_deletes_every_labelled_pod_though_one_deletion_fails() -> None:
    class OneDeleteFails(InstantPods):
        failed = False

        async def delete(self, name: str) -> None:
            if not self.failed:
                self.failed = True
                raise PodApiError(f"DELETE {name}: 429 Too Many Requests", status=429)
            await super().delete(name)

    api = OneDeleteFails()
    pods = SandboxPods(api, TEMPLATE, worker="w", size=1)
    for index in range(3):  # made by this worker but not in its pool (its create's answer was lost)
        await api.create({"metadata": {"name": f"w-sb-old-{index}"}})
    await pods.close()
    assert len(api.pods) == 1  # only the one whose deletion failed; was all three
