"""Pure builders of the Kueue Workloads that admit a run as a whole (``spec.scheduling.queue``).

One Workload per RLRun, named like the run and owned by it: a pod set ``trainer`` of ``nodes``
pods and one ``pool-<name>`` per pool of its starting replicas (``minReplicas``, at least 1; a
multi-node pool's leaders, with its workers in ``workers-<name>``: :func:`pool_pod_sets`), each
with what Kueue reads of the pod template — the containers' resource requests and the placement
(node affinity on the GPU product, node selector, tolerations) — so Kueue's flavour assignment
finds the ResourceFlavor of the pool's GPU type.  Kueue reserves quota for every pod set or for
none; the operator creates the run's workloads only once it has (:func:`admitted`).

Replicas a pool scales to above its starting replicas are admitted elastically: one Workload per
extra replica (:func:`extra_workload`, owned by the SamplerPool, a single pod set of one replica's
pods), so Kueue admits each as its quota allows and the others wait; the pool's workload is held at
its starting replicas plus the admitted extras (docs/operator.md#gang-admission-with-kueue).

With ``--kueue-workload-priority`` a Workload has the priority of its pods' PriorityClass — that
of its first pod set whose pods name one, as Kueue's own job integrations take it (the trainer's
before the pools') — by which Kueue orders its queue and preempts (:func:`with_priority`).

The pod sets carry no image, command or environment: an admitted Workload's pod sets cannot change
(Kueue's webhook), and a new image must not send a running run back to the queue.  A change of
what Kueue counts (GPUs, nodes, minReplicas, placement) does: the Workload is created again.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from mixrl.api.kube_types import Obj
from mixrl.api.resolve import ResolvedPool, ResolvedRun
from mixrl.operator.builders import labels as L
from mixrl.operator.builders.objects import BuildOptions, Owner, metadata, with_hash
from mixrl.operator.builders.pools import pool_objects
from mixrl.operator.builders.resources import seed_replicas, trainer_objects

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
QUEUE_LABEL = f"{KUEUE_GROUP}/queue-name"
"""The label Kueue's own integrations put on what a queue admits (kept for ``kubectl -l``)."""
TRAINER_POD_SET = "trainer"
EXTRA_LABEL = "mixrl.dev/extra-replica"
"""On a pool's extra-replica Workloads: its index (1, 2, …), so they are listed apart from the run's."""

MAX_POD_SETS = 8
"""Pod sets a Workload may have (Kueue's CRD: ``spec.podSets`` maxItems 8); a run may have more
pools than that (validation allows 32), so :func:`too_many_pod_sets` says so before the API
server's 422 would."""

ADMITTED = "Admitted"
QUOTA_RESERVED = "QuotaReserved"
EVICTED = "Evicted"


def _requests(container: Obj) -> Obj:
    """A container's requests as the pod will have them: a limit without a request (GPUs, an
    extended resource, are given as limits alone) is the request, as Kubernetes defaults it."""
    resources = container.get("resources") or {}
    requests = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {"name": container["name"], "resources": {"requests": requests}}


def pod_set_template(template: Obj) -> Obj:
    """The part of a pod template Kueue reads: each container's requests (init containers too:
    a pod's effective request is the larger of its init containers' and its containers' sum) and
    its placement."""
    spec = template["spec"]
    out: Obj = {"containers": [_requests(c) for c in spec["containers"]]}
    if spec.get("initContainers"):
        out["initContainers"] = [_requests(c) for c in spec["initContainers"]]
    node_affinity = (spec.get("affinity") or {}).get("nodeAffinity")
    if node_affinity:
        out["affinity"] = {"nodeAffinity": node_affinity}
    for key in ("nodeSelector", "tolerations", "priorityClassName"):
        if spec.get(key):
            out[key] = spec[key]
    return {"metadata": {"labels": dict(template["metadata"].get("labels") or {})}, "spec": out}


def pool_pod_set_name(pool: ResolvedPool) -> str:
    """A pool's pod set: its Deployment's pods, or its LeaderWorkerSet's leaders."""
    return f"pool-{pool.name}"


def pool_workers_pod_set_name(pool: ResolvedPool) -> str:
    """A multi-node pool's workers (every node of a group but the leader's).  Its own prefix, so it
    can never be another pool's ``pool-<name>`` (pool names are DNS labels: any suffix could be)."""
    return f"workers-{pool.name}"


def pool_pod_sets(
    resolved: ResolvedRun, pool: ResolvedPool, owner: Owner, options: BuildOptions, replicas: int
) -> list[Obj]:
    """The pod sets of ``replicas`` of the pool's replicas, as its workload runs them: a
    Deployment's pods, or a LeaderWorkerSet's groups of ``size`` pods — the leaders and their
    workers apart, each with its own template, since only the leader has the weight-sync sidecar
    (a worker's template counted for the leader left the sidecar's CPU and memory, the model's
    size in conversion memory, out of the quota Kueue reserved)."""
    for obj in pool_objects(resolved, pool, 0, owner, options):
        if obj["kind"] == "Deployment":
            return [_pod_set(pool_pod_set_name(pool), replicas, obj["spec"]["template"])]
        if obj["kind"] == "LeaderWorkerSet":
            group = obj["spec"]["leaderWorkerTemplate"]
            workers = int(group.get("size", 1)) - 1
            leader = group.get("leaderTemplate") or group["workerTemplate"]  # LWS: absent, the worker's
            sets = [_pod_set(pool_pod_set_name(pool), replicas, leader)]
            if workers > 0:
                sets.append(
                    _pod_set(pool_workers_pod_set_name(pool), replicas * workers, group["workerTemplate"])
                )
            return sets
    raise ValueError(f"pool {pool.name}: no engine workload built")


def _pod_set(name: str, count: int, template: Obj) -> Obj:
    return {"name": name, "count": count, "template": pod_set_template(template)}


def workload_labels(resolved: ResolvedRun, queue: str) -> dict[str, str]:
    return {**L.component_labels(resolved, "run"), QUEUE_LABEL: queue}


def run_workload(resolved: ResolvedRun, owner: Owner, options: BuildOptions, queue: str) -> Obj:
    """The run's Workload in LocalQueue ``queue``: the trainer's nodes and every pool's starting
    replicas, admitted together (``owner``: the RLRun)."""
    trainer = next(o for o in trainer_objects(resolved, owner, options) if o["kind"] == "StatefulSet")
    pod_sets = [
        {
            "name": TRAINER_POD_SET,
            "count": trainer["spec"]["replicas"],
            "template": pod_set_template(trainer["spec"]["template"]),
        }
    ]
    for pool in resolved.pools:
        replicas = seed_replicas(pool)
        if replicas > 0:
            pod_sets += pool_pod_sets(resolved, pool, owner, options, replicas)
    return with_hash(
        {
            "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}",
            "kind": "Workload",
            "metadata": metadata(resolved.name, resolved.namespace, workload_labels(resolved, queue), owner),
            "spec": {"queueName": queue, "podSets": pod_sets},
        }
    )


def priority_class_name(workload: Obj) -> str | None:
    """The PriorityClass a Workload's priority comes from: the first of its pod sets' that names one."""
    names = (p["template"]["spec"].get("priorityClassName") for p in workload["spec"]["podSets"])
    return next((name for name in names if name), None)


PRIORITY_FIELDS = ("priorityClassRef", "priority")
"""What a Workload says of its priority (Kueue v1beta2): the class, and its value."""


def with_priority(workload: Obj, name: str, value: int) -> Obj:
    """``workload`` at PriorityClass ``name``'s priority ``value`` (Kueue needs the value beside the
    class: it does not read the class itself for a Workload it did not make)."""
    ref = {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": name}
    return _with_spec(workload, {**workload["spec"], "priorityClassRef": ref, "priority": value})


def with_priority_of(workload: Obj, live: Obj) -> Obj:
    """``workload`` at the priority ``live`` was made with (none when it had none): a Workload that
    holds quota cannot change its class (Kueue's API)."""
    spec = {k: v for k, v in workload["spec"].items() if k not in PRIORITY_FIELDS}
    spec.update({k: live["spec"][k] for k in PRIORITY_FIELDS if k in (live.get("spec") or {})})
    return _with_spec(workload, spec)


def _with_spec(workload: Obj, spec: Obj) -> Obj:
    return with_hash({**workload, "metadata": copy.deepcopy(workload["metadata"]), "spec": spec})


def too_many_pod_sets(workload: Obj, queue: str) -> str | None:
    """Why Kueue can never admit the run's Workload as built, in one line; None when it can."""
    names = [p["name"] for p in workload["spec"]["podSets"]]
    if len(names) <= MAX_POD_SETS:
        return None
    return (
        f"LocalQueue {queue}: the run needs {len(names)} Kueue pod sets ({', '.join(names)}) and "
        f"a Workload holds at most {MAX_POD_SETS}: give fewer pools starting replicas (minReplicas "
        "and maxReplicas 0 leave one out), fewer pools, or no queue; until then nothing of the run "
        "is created"
    )[:1000]


def _condition(workload: Obj, kind: str) -> Obj | None:
    return next(
        (c for c in (workload.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None
    )


def admitted(workload: Obj | None) -> bool:
    """Kueue admitted it (quota reserved and every admission check passed), and has not evicted it."""
    if workload is None:
        return False
    done = _condition(workload, ADMITTED)
    evicted = _condition(workload, EVICTED)
    return bool(done and done.get("status") == "True") and not (evicted and evicted.get("status") == "True")


def has_quota(workload: Obj | None) -> bool:
    """Kueue holds quota for it: its pod sets can no longer change."""
    reserved = _condition(workload or {}, QUOTA_RESERVED)
    return bool(reserved and reserved.get("status") == "True")


def waiting_message(workload: Obj | None, queue: str, what: str = "the run") -> str:
    """Why a Workload is not admitted, in Kueue's words: its eviction's message, else its
    QuotaReserved condition's (``couldn't assign flavors to pod set trainer: insufficient unused
    quota …``), once Kueue has said anything."""
    evicted = _condition(workload or {}, EVICTED)
    reserved = _condition(workload or {}, QUOTA_RESERVED)
    for found in (evicted, reserved):
        if (
            found
            and found.get("status") == ("True" if found is evicted else "False")
            and found.get("message")
        ):
            return f"LocalQueue {queue}: {found['message']}"[:1000]
    return f"waiting for Kueue to admit {what} in LocalQueue {queue}"


# ----------------------------------------------------------------------------- elastic extras


def extra_workload_name(pool: ResolvedPool, index: int) -> str:
    return f"{pool.object_name}-extra-{index}"


def extra_labels(resolved: ResolvedRun, pool: ResolvedPool) -> dict[str, str]:
    """What selects a pool's extra-replica Workloads (the run's own Workload has component ``run``)."""
    return L.selector_labels(resolved.name, "sampler", pool.name)


def extra_workload(
    resolved: ResolvedRun, pool: ResolvedPool, owner: Owner, options: BuildOptions, queue: str, index: int
) -> Obj:
    """The Workload of the pool's ``index``-th replica above its starting ones, in LocalQueue
    ``queue`` (``owner``: the SamplerPool, so it goes with the pool): one replica's pod sets, named
    as in the run's Workload (a LeaderWorkerSet group: its leader and its workers)."""
    labels = {**L.pool_labels(resolved, pool), QUEUE_LABEL: queue, EXTRA_LABEL: str(index)}
    return with_hash(
        {
            "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}",
            "kind": "Workload",
            "metadata": metadata(extra_workload_name(pool, index), resolved.namespace, labels, owner),
            "spec": {"queueName": queue, "podSets": pool_pod_sets(resolved, pool, owner, options, 1)},
        }
    )


def extra_index(workload: Obj) -> int:
    raw = ((workload.get("metadata") or {}).get("labels") or {}).get(EXTRA_LABEL, "")
    return int(raw) if raw.isdigit() else 0


@dataclass(frozen=True)
class ExtrasPlan:
    keep: tuple[Obj, ...]
    """Live extra Workloads that stay: the admitted ones first, then the longest waiting."""
    create: tuple[int, ...]
    """Indexes of the extra Workloads to create (the lowest free ones)."""
    delete: tuple[Obj, ...]
    """Live extra Workloads beyond the wanted count: the waiting ones go before the admitted."""


def plan_extras(live: Sequence[Obj], wanted: int) -> ExtrasPlan:
    """Which of a pool's extra Workloads stay, are created, or go, for ``wanted`` extras: a scale
    down gives back what Kueue has not admitted before what runs, so the pool keeps its admitted
    replicas as long as it wants that many."""
    ranked = sorted(live, key=lambda w: (not admitted(w), extra_index(w)))
    keep, delete = ranked[:wanted], ranked[wanted:]
    taken = {extra_index(w) for w in keep}
    free = (i for i in range(1, wanted + len(taken) + 1) if i not in taken)
    create = tuple(next(free) for _ in range(wanted - len(keep)))
    return ExtrasPlan(tuple(keep), create, tuple(delete))


@dataclass(frozen=True)
class Elastic:
    """A queued run's pool: its replicas as Kueue admits them."""

    start: int
    """Replicas admitted with the run (its Workload's pod set; fewer when the pool wants fewer)."""
    wanted: int
    """Extra replicas the pool asks for (its replicas above the start)."""
    admitted: int
    """Of those, the ones Kueue admitted."""
    queue: str
    reason: str = ""
    """Kueue's words for the first extra still waiting (:func:`waiting_message`)."""
    run_held: bool = False
    """Kueue holds the whole run (evicted, or queued again): none of the pool's replicas may run."""

    @property
    def held(self) -> int:
        """The replicas the pool's workload is given: the start and the admitted extras."""
        return self.start + self.admitted

    @property
    def waiting(self) -> int:
        return self.wanted - self.admitted


def held_with_run(replicas: int, queue: str, run_workload: Obj | None) -> Elastic:
    """A pool of a run whose own Workload Kueue has not admitted (evicted, or queued again in a new
    shape): the run's controller holds the pool at zero, but whoever scales it (the autoscaler, KEDA,
    ``kubectl scale``) may move its replicas first, and engines started then would run outside
    Kueue's quota.  So every replica waits, with the run's reason, and no extra is asked for."""
    return Elastic(
        start=0,
        wanted=replicas,
        admitted=0,
        queue=queue,
        reason=waiting_message(run_workload, queue),
        run_held=True,
    )


def elastic_admission(start: int, replicas: int, queue: str, extras: Sequence[Obj]) -> Elastic:
    """What a queued run's pool of ``replicas`` may run now: ``start`` of them came with the run,
    and each live extra Workload Kueue admitted adds one."""
    waiting = [w for w in extras if not admitted(w)]
    return Elastic(
        start=min(start, replicas),
        wanted=max(replicas - start, 0),
        admitted=len(extras) - len(waiting),
        queue=queue,
        reason=waiting_message(waiting[0], queue, waiting[0]["metadata"]["name"]) if waiting else "",
    )
