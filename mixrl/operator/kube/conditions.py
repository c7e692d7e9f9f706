"""Status conditions as the Kubernetes API conventions want them (pure).

Every condition carries ``observedGeneration``; ``lastTransitionTime`` changes only when the
condition's status flips; a writer replaces its own conditions and keeps everyone else's.  The
run's and pools' controllers (:mod:`mixrl.operator.controller.observed_status`) and the built-in autoscaler
(:mod:`mixrl.operator.autoscaling.loop`) write conditions on the same objects, this way.
"""

from __future__ import annotations

from collections.abc import Sequence

from mixrl.api.kube_types import Condition, ConditionValue, Obj


def make_condition(
    kind: str, value: ConditionValue, generation: int | None, now: str, previous: list[Obj]
) -> Condition:
    status, reason, message = value
    before = next((c for c in previous if c.get("type") == kind), None)
    flipped = before is None or before.get("status") != status
    since = now if flipped or before is None else before.get("lastTransitionTime", now)
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def merge_conditions(previous: Sequence[Obj], ours: Sequence[Condition]) -> list[Obj]:
    """Ours in a fixed order, then everyone else's as they were."""
    own = {c["type"] for c in ours}
    return [*(dict(c) for c in ours), *(c for c in previous if c.get("type") not in own)]


def update_conditions(previous: Sequence[Obj], ours: Sequence[Condition]) -> list[Obj]:
    """Ours where they stood (new ones at the end), everyone else's untouched: for a writer whose
    conditions sit after another writer's, so that neither reorders the list the other wrote (two
    writers that each put their own first would rewrite the list back and forth)."""
    by_type: dict[str, Obj] = {c["type"]: dict(c) for c in ours}
    kept = [by_type.pop(c.get("type", ""), c) for c in previous]
    return [*kept, *(dict(c) for c in ours if c["type"] in by_type)]
