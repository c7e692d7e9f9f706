"""Idempotent writes: compare the desired object's hash with the live one, write only on change.

An unchanged spec therefore costs one GET per child and no write.  Children are written with
server-side apply (the operator is their only manager, so fields it stops setting disappear), and
created the same way.  Two exceptions: a PersistentVolumeClaim is only ever created (its spec is
immutable once bound), and a SamplerPool is created with its seed replicas and later merge-patched
without them, because after creation ``spec.replicas`` belongs to whoever scales the pool.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from mixrl.operator.kube import ApiError, KubeClient
from mixrl.operator.rbac import PVCS, SAMPLERPOOLS, resource_of
from mixrl.operator.resources import HASH_ANNOTATION

Obj = dict[str, Any]


# Created by POST, never by apply: their later writes are not server-side applies (see above).
CREATED_BY_POST = (SAMPLERPOOLS, PVCS)


class OwnerGone(Exception):
    """The owner was deleted while we reconciled it: creating children now would orphan them."""


class StillTerminating(Exception):
    """A child with our name is being deleted; it must be gone before we can create it again."""


@dataclass
class ApplyReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated or self.deleted)

    def summary(self) -> str:
        parts = [f"{verb} {', '.join(names)}" for verb, names in self._groups() if names]
        return "; ".join(parts) if parts else "no changes"

    def _groups(self) -> list[tuple[str, list[str]]]:
        return [("created", self.created), ("updated", self.updated), ("deleted", self.deleted)]


def label(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def live_hash(obj: Obj) -> str | None:
    annotations: dict[str, str] = obj.get("metadata", {}).get("annotations") or {}
    return annotations.get(HASH_ANNOTATION)


def merged(base: Obj, extra: Obj) -> Obj:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclass(frozen=True)
class Applied:
    before: Obj | None
    """The live object before this call (None when it did not exist)."""
    after: Obj
    """The live object after this call."""


async def apply_object(
    client: KubeClient,
    desired: Obj,
    report: ApplyReport,
    seed: Obj | None = None,
    before_create: Callable[[], Awaitable[None]] | None = None,
    on_update: Callable[[Obj], Obj] | None = None,
) -> Applied:
    """Make one child match ``desired``.

    ``seed`` holds fields set only on creation (a SamplerPool's first ``spec.replicas``);
    ``before_create`` runs before any creation and may raise :class:`OwnerGone`; ``on_update``
    maps the live object to extra fields for the same update (a SamplerPool's replicas brought
    within new bounds), so an update stays one write."""
    resource = resource_of(desired)
    namespace = desired["metadata"]["namespace"]
    name = desired["metadata"]["name"]
    live = await client.get(resource, namespace, name)
    if live is not None and live.get("metadata", {}).get("deletionTimestamp"):
        raise StillTerminating(f"{label(desired)} is still being deleted")
    if live is None:
        if before_create is not None:
            await before_create()
        try:
            if resource in CREATED_BY_POST:
                created = await client.create(resource, namespace, merged(desired, seed or {}))
            else:
                created = await client.apply(resource, namespace, name, merged(desired, seed or {}))
            report.created.append(label(desired))
            return Applied(None, created)
        except ApiError as exc:
            if exc.status != 409:
                raise
            # Someone (our previous attempt, whose answer was lost) created it: compare and patch.
            live = await client.get(resource, namespace, name)
            if live is None:
                raise
    if live_hash(live) == live_hash(desired) or resource is PVCS:
        report.unchanged.append(label(desired))
        return Applied(live, live)
    body = merged(desired, on_update(live)) if on_update is not None else desired
    if resource is SAMPLERPOOLS:
        updated = await client.merge_patch(resource, namespace, name, body)
    else:
        updated = await client.apply(resource, namespace, name, body)
    report.updated.append(label(desired))
    return Applied(live, updated)
