"""The warm pool of sandbox pods one rollout worker leases from (pure: no I/O, time passed in).

Every pod goes ``creating`` (asked for) -> ``ready`` (its executor answers its readiness probe and
it has an address) -> ``leased`` (one command runs in it) -> ``deleting`` -> gone.  A pod is never
leased twice: releasing it deletes it and :meth:`PoolState.plan` asks for a fresh one, so no command
sees what an earlier one left behind.  Pods that do not become ready within ``ready_timeout_s``,
pods that fail, leases held past their deadline, and pods whose create call failed without a clear
refusal (the API server may have made them) are deleted too.  At most ``size`` pods are
alive (not being deleted) at once, which bounds both the cluster's share and the commands running
at once.  :mod:`mixrl.rl.sandbox.kubernetes` does the API calls the plan asks for.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

WORKER_LABEL = "mixrl.dev/sandbox-worker"
"""On each sandbox pod: the rollout worker pod that leases it (it lists and cleans up its own)."""
EXECUTOR_PORT_NAME = "executor"
"""The sandbox pod's container port the executor serves on."""
SlotState = Literal["creating", "ready", "leased", "deleting"]
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Waits after consecutive failed creations (an API error, a quota): no hammering the API server."""


@dataclass
class Slot:
    state: SlotState
    since: float
    address: str | None = None
    deadline: float | None = None
    why: str = ""
    plan_round: int = 0
    """The :meth:`PoolState.plan` call that asked for it: failed creations of one round are one failure."""


@dataclass(frozen=True)
class Plan:
    create: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()


@dataclass
class PoolState:
    worker: str
    """The rollout worker's pod name: every sandbox pod is named after it."""
    size: int
    ready_timeout_s: float
    token: str
    """Distinguishes this worker process's pods from an earlier incarnation's (same worker name)."""
    slots: dict[str, Slot] = field(default_factory=dict)
    created: int = 0
    plan_rounds: int = 0
    failures: int = 0
    failed_round: int = -1
    retry_at: float = 0.0
    last_problem: str = ""
    last_ready_at: float = float("-inf")
    """When a pod last became ready: a command waiting since then waits for others' leases, not for
    a pool that cannot make pods."""

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"sandbox.poolSize: must be positive, got {self.size}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"sandbox.readyTimeoutSeconds: must be positive, got {self.ready_timeout_s}")

    def count(self, *states: SlotState) -> int:
        return sum(1 for slot in self.slots.values() if slot.state in states)

    def _delete(self, name: str, now: float, why: str) -> None:
        slot = self.slots[name]
        slot.state, slot.since, slot.why = "deleting", now, why
        if why:
            self.last_problem = f"{name}: {why}"

    def plan(self, now: float) -> Plan:
        """What to do now: pods to create (already recorded as ``creating``) and pods to delete
        (recorded as ``deleting``: those timed out now, and those still to be deleted)."""
        for name, slot in self.slots.items():
            if slot.state == "creating" and now - slot.since > self.ready_timeout_s:
                self._delete(name, now, f"not ready after {self.ready_timeout_s:g} s")
            elif slot.state == "leased" and slot.deadline is not None and now > slot.deadline:
                self._delete(name, now, "leased past its deadline")
        create: list[str] = []
        if now >= self.retry_at:
            self.plan_rounds += 1
            while self.count("creating", "ready", "leased") < self.size:
                self.created += 1
                name = f"{self.worker}-sb-{self.token}-{self.created}"
                self.slots[name] = Slot("creating", now, plan_round=self.plan_rounds)
                create.append(name)
        delete = tuple(name for name, slot in self.slots.items() if slot.state == "deleting")
        return Plan(tuple(create), delete)

    def create_failed(self, name: str, now: float, why: str, *, maybe_created: bool = False) -> None:
        """The create call failed: wait before asking again.  A refusal made nothing and the pod is
        forgotten; ``maybe_created`` (a timeout, a dropped connection, a server error: the API server
        may have made it all the same) deletes it, so that no pod outlives the pool's count."""
        slot = self.slots.get(name)
        if slot is None:
            return
        if maybe_created:
            self._delete(name, now, "")
        else:
            self.slots.pop(name)
        # One quota refusing a whole round's creations is one failure, not one per pod.
        if slot.plan_round != self.failed_round:
            self.failed_round = slot.plan_round
            self.failures += 1
        backoff_s = BACKOFF_S[min(self.failures, len(BACKOFF_S)) - 1]
        self.retry_at = max(self.retry_at, now + backoff_s)
        self.last_problem = f"creating {name}: {why}"

    def observe(self, name: str, now: float, ready: bool, address: str | None, ended: str = "") -> None:
        """What the API says of a pod: ready with an address, or ``ended`` (failed, gone) and why."""
        slot = self.slots.get(name)
        if slot is None or slot.state == "deleting":
            return
        if ended:
            if slot.state == "leased":
                slot.why = ended  # its command fails by itself; the release deletes it
            else:
                self._delete(name, now, ended)
            return
        if slot.state == "creating" and ready and address:
            slot.state, slot.since, slot.address = "ready", now, address
            self.failures, self.failed_round = 0, -1
            self.last_ready_at = now

    def lease(self, now: float, hold_s: float) -> tuple[str, str] | None:
        """The longest-ready pod, now leased until ``now + hold_s``, as (name, address); None when
        none is ready."""
        ready = [(slot.since, name) for name, slot in self.slots.items() if slot.state == "ready"]
        if not ready:
            return None
        _, name = min(ready)
        slot = self.slots[name]
        slot.state, slot.since, slot.deadline = "leased", now, now + hold_s
        assert slot.address is not None
        return name, slot.address

    def all_leased(self) -> bool:
        """Every pod the pool may have runs a command: a command waiting now waits its turn."""
        return 0 < self.size <= self.count("leased")

    def release(self, name: str, now: float) -> None:
        """The command is done (or failed): the pod is dirty and goes."""
        if name in self.slots and self.slots[name].state != "deleting":
            self._delete(name, now, "")

    def gone(self, name: str) -> None:
        """The API accepted the deletion (or the pod was already gone)."""
        self.slots.pop(name, None)

    def shutdown(self, now: float) -> tuple[str, ...]:
        """Every pod, to be deleted now; no more are created."""
        self.size = 0
        for name in self.slots:
            if self.slots[name].state != "deleting":
                self._delete(name, now, "")
        return tuple(self.slots)


def executor_port(template: Mapping[str, Any]) -> int:
    """The executor's port, from the operator's pod manifest (its one source)."""
    for container in template.get("spec", {}).get("containers", []):
        for entry in container.get("ports", []):
            if entry.get("name") == EXECUTOR_PORT_NAME:
                return int(entry["containerPort"])
    raise ValueError(f"sandbox pod template: no container port named {EXECUTOR_PORT_NAME!r}")


def named_pod(template: Mapping[str, Any], name: str, worker: str) -> dict[str, Any]:
    """The template with a name and the worker's label (the operator builds the template: mixrl.operator.builders.sandbox)."""
    pod: dict[str, Any] = copy.deepcopy(dict(template))
    if pod.get("kind") != "Pod" or not isinstance(pod.get("metadata"), dict):
        raise ValueError("sandbox pod template: not a Pod manifest")
    pod["metadata"]["name"] = name
    pod["metadata"]["labels"] = {**pod["metadata"].get("labels", {}), WORKER_LABEL: worker}
    return pod
