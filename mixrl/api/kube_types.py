"""Kubernetes objects as mixrl's code holds them: the types every layer that reads or writes objects
shares (the operator, the dev cluster's enforcer, the sandbox's pod client), declared once.

An object read from or sent to the API server is JSON: :data:`Obj`.  Where one shape is built and
read in several places, a TypedDict names its fields (:class:`Condition`); the whole object tree
stays a plain dict, as the API server's schema, not this module, is what validates it.  Status
goes through its pydantic models (:mod:`mixrl.api.status`).
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

Obj = dict[str, Any]
"""A Kubernetes object, or a part of one, as JSON."""

ConditionStatus = Literal["True", "False", "Unknown"]
ConditionValue = tuple[ConditionStatus, str, str]
"""A condition's (status, reason, message), as the pure code that judges it returns it."""


class Condition(TypedDict):
    """One entry of ``status.conditions`` as the API conventions want it (metav1.Condition)."""

    type: str
    status: ConditionStatus
    reason: str
    message: str
    lastTransitionTime: str
    observedGeneration: int | None
