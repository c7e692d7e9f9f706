"""A pool's replicas as the cluster reports them: ready, starting (a cold start) or stuck.

Pure: pods and events in, a :class:`Census` out.  The autoscaler's rule 8
(:mod:`mixrl.operator.autoscaling.policy`) releases stuck replicas; a cold start, however long,
is capacity on its way.  A replica is **stuck** only when the cluster says so:

- its pod is ``Unschedulable`` (the scheduler's ``PodScheduled=False`` condition) and no node is
  on its way for it: a cluster autoscaler that provisions one says so with an event on the pod
  (cluster-autoscaler's ``TriggeredScaleUp``, Karpenter's ``Nominated``), and such a pod is a
  cold start — a new GPU node takes 10–12 minutes, which is exactly the wait a timeout mistook
  for a stuck pool;
- a container cannot start: the image cannot be pulled, the container keeps crashing, its
  configuration is missing (the kubelet's waiting reasons in :data:`STUCK_WAITING_REASONS`);
- the pod failed (``phase: Failed``, e.g. evicted) and was not yet replaced.

Everything else not ready — scheduled and pulling, running and loading the model — is a cold
start.  Pods being deleted are not counted.  The pool's **cold-start time** is learned from the
pods that came up: the median, over the ready pods, of the time from the pod's creation to its
``Ready`` condition.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from mixrl.api.kube_types import Obj

STUCK_WAITING_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
"""A container waiting for one of these will not start by itself (the kubelet's reasons)."""

NODE_ON_ITS_WAY_REASONS = ("TriggeredScaleUp", "Nominated")
"""Events on an unschedulable pod saying a node is being provisioned for it (cluster-autoscaler,
Karpenter): the pod is a cold start, not stuck."""


@dataclass(frozen=True)
class Census:
    """One pool's pods, counted."""

    ready: int
    starting: int
    """Not ready, not stuck: a cold start (scheduled, pulling, loading; or waiting for a node
    the cluster autoscaler is bringing)."""
    stuck: int
    why_stuck: str | None = None
    """The first stuck pod and the cluster's reason, one line (None: nothing stuck)."""
    cold_start_s: float | None = None
    """Median seconds from creation to Ready over the ready pods (None: none is ready)."""


def _time(value: object) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _condition(pod: Obj, kind: str) -> Obj | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return dict(condition)
    return None


def _one_line(text: object, limit: int = 200) -> str:
    line = " ".join(str(text or "").split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def is_ready(pod: Obj) -> bool:
    ready = _condition(pod, "Ready")
    return (pod.get("status") or {}).get("phase") == "Running" and bool(
        ready and ready.get("status") == "True"
    )


def unschedulable_message(pod: Obj, limit: int = 200) -> str | None:
    """The scheduler's reason, one line, when it cannot place ``pod`` (``PodScheduled=False``,
    ``Unschedulable``); None otherwise."""
    scheduled = _condition(pod, "PodScheduled")
    if scheduled is None or scheduled.get("status") != "False" or scheduled.get("reason") != "Unschedulable":
        return None
    return _one_line(scheduled.get("message") or "no node fits", limit)


def stuck_reason(pod: Obj, node_on_its_way: bool = False) -> str | None:
    """Why the cluster says this pod will not become ready by itself; None: it may (a cold start)."""
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return f"Failed: {_one_line(status.get('reason') or status.get('message') or 'the pod failed')}"
    message = unschedulable_message(pod)
    if message is not None and not node_on_its_way:
        return f"Unschedulable: {message}"
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING_REASONS:
            detail = _one_line(waiting.get("message"))
            return f"{waiting['reason']} ({container.get('name', '?')})" + (f": {detail}" if detail else "")
    return None


def pods_with_a_node_on_its_way(events: Iterable[Obj]) -> set[str]:
    """The names of the pods a cluster autoscaler is provisioning a node for (from their events)."""
    return {
        str((event.get("involvedObject") or {}).get("name"))
        for event in events
        if event.get("reason") in NODE_ON_ITS_WAY_REASONS
        and (event.get("involvedObject") or {}).get("kind") == "Pod"
    }


def unschedulable(pods: Sequence[Obj]) -> bool:
    """Whether any of ``pods`` waits for the scheduler (only then are events worth reading)."""
    return any(stuck_reason(pod) is not None and stuck_reason(pod, True) is None for pod in pods)


GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
"""LeaderWorkerSet's label on every pod of a group (LWS v0.9's ``GroupIndexLabelKey``): a
multi-node pool's replica is the group, not the pod."""


def replicas_of(pods: Sequence[Obj]) -> list[list[Obj]]:
    """``pods`` as replicas: a pod each, or for a multi-node pool (a LeaderWorkerSet) the pods of
    one group together; pods being deleted are left out."""
    groups: dict[str, list[Obj]] = {}
    single: list[list[Obj]] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        group = (meta.get("labels") or {}).get(GROUP_INDEX_LABEL)
        if group is None:
            single.append([pod])
        else:
            groups.setdefault(str(group), []).append(pod)
    return single + [groups[key] for key in sorted(groups)]


def census(pods: Sequence[Obj], node_on_its_way: set[str] | None = None) -> Census:
    """Count ``pods`` (one pool's) as replicas (:func:`replicas_of`): ready when every pod of the
    replica is, stuck when one is (the first such pod's reason), else starting; and the cold-start
    time learned, from the first pod's creation to the last one's ``Ready``."""
    coming = node_on_its_way or set()
    ready = starting = stuck = 0
    why: str | None = None
    starts: list[float] = []
    for members in replicas_of(pods):
        if all(is_ready(pod) for pod in members):
            ready += 1
            created = [_time((pod.get("metadata") or {}).get("creationTimestamp")) for pod in members]
            became = [_time((_condition(pod, "Ready") or {}).get("lastTransitionTime")) for pod in members]
            if None not in created and None not in became:
                first, last = (
                    min(t for t in created if t is not None),
                    max(t for t in became if t is not None),
                )
                if last >= first:
                    starts.append(last - first)
            continue
        reasons = [
            (pod, stuck_reason(pod, (pod.get("metadata") or {}).get("name") in coming)) for pod in members
        ]
        blocked = [(pod, reason) for pod, reason in reasons if reason is not None]
        if not blocked:
            starting += 1
            continue
        stuck += 1
        if why is None:
            pod, reason = blocked[0]
            why = f"{(pod.get('metadata') or {}).get('name', '?')}: {reason}"
    cold_start = statistics.median(starts) if starts else None
    return Census(ready, starting, stuck, why, cold_start)
