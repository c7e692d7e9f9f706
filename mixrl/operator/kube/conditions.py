"""Status conditions as the Kubernetes API conventions want them (pure).

Every condition carries ``observedGeneration``; ``lastTransitionTime`` changes only when the
condition's status flips; a writer replaces its own conditions and keeps everyone else's.  The
run's and pools' controllers (:mod:`mixrl.operator.controller.status`) and the built-in autoscaler
(:mod:`mixrl.operator.autoscaling.loop`) write conditions on the same objects, this way.
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def make_condition(
    kind: str, value: tuple[str, str, str], generation: int | None, now: str, previous: list[Obj]
) -> Obj:
    status, reason, message = value
    before = next((c for c in previous if c.get("type") == kind), None)
    flipped = before is None or before.get("status") != status
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if flipped else before.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


def merge_conditions(previous: list[Obj], ours: list[Obj]) -> list[Obj]:
    """Ours in a fixed order, then everyone else's as they were."""
    own = {c["type"] for c in ours}
    return [*ours, *(c for c in previous if c.get("type") not in own)]


def update_conditions(previous: list[Obj], ours: list[Obj]) -> list[Obj]:
    """Ours where they stood (new ones at the end), everyone else's untouched: for a writer whose
    conditions sit after another writer's, so that neither reorders the list the other wrote (two
    writers that each put their own first would rewrite the list back and forth)."""
    by_type = {c["type"]: c for c in ours}
    kept = [by_type.pop(c.get("type"), c) for c in previous]
    return [*kept, *(c for c in ours if c["type"] in by_type)]
