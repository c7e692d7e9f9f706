"""Kubernetes Events as the operator's loops post them (pure: the object only)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

from mixrl.api.kube_types import Obj
from mixrl.operator.kube.rbac import ApiResource


def rfc3339(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_SERIAL = itertools.count()
"""Tells apart the events of one moment: a loop posts several with the same ``now``."""


def event_object(
    resource: ApiResource, body: Obj, kind: str, reason: str, message: str, now: float, component: str
) -> Obj:
    """A core/v1 Event about ``body``, an object of ``resource``, named as client-go's event
    recorder names them, ``<object>.<unix nanoseconds in hex>``, plus a serial number: every event
    this process makes has a name of its own, those of one ``now`` included."""
    meta = body["metadata"]
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta['name']}.{int(now * 1e9):x}.{next(_SERIAL):x}",
            "namespace": meta["namespace"],
        },
        "involvedObject": {
            "apiVersion": resource.api_version,
            "kind": resource.kind,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": kind,
        "reason": reason,
        "message": message[:1000],
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "source": {"component": component},
        "reportingComponent": component,
    }
