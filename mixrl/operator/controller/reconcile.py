"""The two reconcilers: RLRun -> its children; SamplerPool -> its Deployment and Service (and, in
KEDA mode, its ScaledObject).

Framework-free (no kopf here), and calling only downward: the API models and the builders, the
apply step and the API client, the status composition, and API discovery.  Each reconcile reads
the live children, writes only what differs from the desired objects
(:mod:`mixrl.operator.controller.apply`), and writes status only when it changed.  A child that
cannot be applied does not stop the others: every child is tried and the failures are reported
on the owner's Progressing condition.  What happened comes back as an :class:`Outcome` — the
events to post included — and :mod:`mixrl.operator.controller.runtime` posts them and retries
(with backoff) when the report says a retry can help.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from mixrl.api.errors import InvalidSpec, Problem
from mixrl.api.kube_types import ConditionValue, Obj
from mixrl.api.loader import parse_document
from mixrl.api.models import API_VERSION, RLRun, SamplerPool
from mixrl.api.resolve import ResolvedPool, ResolvedRun, resolve
from mixrl.operator.autoscaling.plan import loop_conditions_to_drop
from mixrl.operator.builders import labels as L
from mixrl.operator.builders import sandbox
from mixrl.operator.builders.keda import pool_scaled_object
from mixrl.operator.builders.kueue import (
    EXTRA_LABEL,
    Elastic,
    admitted,
    elastic_admission,
    extra_labels,
    extra_workload,
    extra_workload_name,
    has_quota,
    held_with_run,
    plan_extras,
    priority_class_name,
    run_workload,
    too_many_pod_sets,
    waiting_message,
    with_priority,
    with_priority_of,
)
from mixrl.operator.builders.lws import lws_name
from mixrl.operator.builders.network import policy_names
from mixrl.operator.builders.objects import (
    AUTH_TOKEN_HASH,
    BuildOptions,
    Monitoring,
    Owner,
    pod_templates,
    token_hash,
    with_hash,
)
from mixrl.operator.builders.podspec import AUTH_TOKEN_KEY
from mixrl.operator.builders.pools import pool_children
from mixrl.operator.builders.resources import (
    auth_secret,
    clamp_replicas,
    pod_monitor,
    run_objects,
    seed_replicas,
)
from mixrl.operator.controller.apply import (
    ApplyReport,
    Child,
    Failure,
    OwnerGone,
    apply_object,
    apply_objects,
    label,
    live_hash,
)
from mixrl.operator.controller.discovery import Discovery
from mixrl.operator.controller.observed_status import (
    ADMITTED,
    FINAL_PHASES,
    PoolState,
    Reason,
    WorkloadState,
    autoscaler_value,
    invalid_run_status,
    pool_status,
    refused_run_status,
    run_status,
)
from mixrl.operator.install.cluster_policy import OPEN, Policy, violation
from mixrl.operator.kube.client import ApiError, KubeClient
from mixrl.operator.kube.rbac import (
    DEPLOYMENTS,
    LEADERWORKERSETS,
    NETWORKPOLICIES,
    PODMONITORS,
    PODS,
    PRIORITY_CLASSES,
    RLRUNS,
    ROLEBINDINGS,
    ROLES,
    SAMPLERPOOLS,
    SCALEDOBJECTS,
    SERVICEACCOUNTS,
    STATEFULSETS,
    WORKLOADS,
    ApiResource,
)

Event = tuple[str, str, str]
"""(type Normal|Warning, reason, message) of an event about the reconciled object."""


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Context:
    client: KubeClient
    discovery: Discovery
    """What the cluster serves, and so the build options of this reconcile."""
    now: Callable[[], str] = utc_now
    policy: Policy = OPEN
    """What the cluster lets an RLRun ask for (the chart's ``policy`` values, as flags)."""
    default_queue: str | None = None
    """The Kueue LocalQueue of runs whose spec names none (``--default-queue``); None: such runs
    are not queued."""
    workload_priority: bool = False
    """Build a queued run's Workloads at the priority of its pods' PriorityClass, read from the
    cluster (``--kueue-workload-priority``; :func:`at_priority`); False: Kueue's default priority."""
    cached_reads: bool = False
    """Read the children (and a pool's run) as the watches last showed them
    (:mod:`mixrl.operator.kube.cache`) instead of from the API server: for reconciles an event
    or the resync (which lists every watched kind first) asked for, not for a restart's."""
    unseen_children_absent: bool = False
    """With ``cached_reads``: a child the watches never showed does not exist, so it is created
    without a read first (:func:`mixrl.operator.controller.apply.absent_as_watched`) — for an
    object created while the operator's watches ran, whose children the watches saw from the
    start (or the operator made itself)."""


@dataclass
class Outcome:
    invalid: str | None = None
    """The one-line validation message when the spec is invalid (nothing was written but status)."""
    refused: str | None = None
    """The one line naming what the cluster's policy refuses (nothing was written but status)."""
    report: ApplyReport = field(default_factory=ApplyReport)
    """What was written, and what failed (a retryable failure asks the caller to retry)."""
    status_written: bool = False
    events: list[Event] = field(default_factory=list)
    """To post on the reconciled object, in order."""


# ----------------------------------------------------------------------------- parsing


def manifest(body: Obj) -> Obj:
    """The part of a live object the API models validate (server fields and status dropped)."""
    meta = body.get("metadata", {})
    return {
        "apiVersion": body.get("apiVersion", API_VERSION),
        "kind": body.get("kind"),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
        "spec": body.get("spec"),
    }


EVALUATOR_NOT_IN_CLUSTER = (
    "bf16 (the BF16 evaluator) runs with mixrl run only: the operator does not start an evaluator "
    "and its engine; use pools"
)

BROADCAST_NOT_IN_CLUSTER = (
    "true runs with mixrl run only: in a cluster each engine pod's weight-sync sidecar loads every "
    "version from the weight store; leave it false"
)


class PolicyRefused(Exception):
    """A valid run asks for what the cluster's policy does not allow; the message is one line."""


def resolve_run(body: Obj, policy: Policy = OPEN) -> ResolvedRun:
    """Validate and resolve a live RLRun; raises InvalidSpec with one line per problem, then
    PolicyRefused when the policy refuses a valid spec (an invalid one is reported as invalid).

    Remembered for the last specs resolved: a run is resolved again by its own reconciles and by
    each of its pools', whenever a child's status moves, and its spec rarely changes.  What it
    returns is immutable (frozen models), so every caller may share it."""
    return resolve_manifest(json.dumps(manifest(body), sort_keys=True), policy)


@functools.lru_cache(maxsize=256)
def resolve_manifest(text: str, policy: Policy) -> ResolvedRun:
    """:func:`resolve_run` of a run's :func:`manifest`, as canonical JSON (a refusal is not
    remembered: it is raised again each time)."""
    run = parse_document(json.loads(text))
    assert isinstance(run, RLRun)
    resolved = resolve(run)  # pool names that would collide with a component's objects are invalid
    if resolved.evaluation_pool is not None:
        raise InvalidSpec([Problem("spec.evaluation.sampler", EVALUATOR_NOT_IN_CLUSTER)])
    if run.spec.weights.broadcast:
        raise InvalidSpec([Problem("spec.weights.broadcast", BROADCAST_NOT_IN_CLUSTER)])
    refused = violation(policy, run.spec)
    if refused is not None:
        raise PolicyRefused(refused)
    return resolved


def owner_of(body: Obj) -> Owner:
    meta = body["metadata"]
    return Owner(body.get("apiVersion", API_VERSION), body["kind"], meta["name"], meta["uid"])


def owned_by(obj: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


def owner_check(client: KubeClient, resource: ApiResource, body: Obj) -> Callable[[], Awaitable[None]]:
    """Before creating a child, make sure its owner still exists (once per reconcile): a reconcile
    that started before a deletion must not recreate what the garbage collector just removed."""
    meta = body["metadata"]
    checked = False
    one_at_a_time = asyncio.Lock()  # children are applied concurrently: one read, not one each

    async def check() -> None:
        nonlocal checked
        async with one_at_a_time:
            if checked:
                return
            live = await client.get(resource, meta["namespace"], meta["name"])
            if (
                live is None
                or live["metadata"].get("uid") != meta["uid"]
                or live["metadata"].get("deletionTimestamp")
            ):
                raise OwnerGone(f"{body['kind']} {meta['namespace']}/{meta['name']} is gone")
            checked = True

    return check


async def write_status(client: KubeClient, resource: ApiResource, body: Obj, new: Obj) -> bool:
    """Merge-patch the status subresource when it differs from what the object carries."""
    if new == (body.get("status") or {}):
        return False
    meta = body["metadata"]
    await client.merge_patch(resource, meta["namespace"], meta["name"], {"status": new}, subresource="status")
    return True


# ----------------------------------------------------------------------------- RLRun


async def reconcile_run(ctx: Context, body: Obj) -> Outcome:
    meta = body["metadata"]
    generation = meta.get("generation")
    previous = body.get("status") or {}
    if meta.get("deletionTimestamp"):
        return Outcome()  # the garbage collector removes the children through their owner references
    # A run that ended (the live status loop decides: mixrl.operator.controller.observer) keeps its
    # objects but releases its GPUs: trainer, rollout and router at zero, every pool at zero.  An
    # invalid or refused spec keeps the phase, so a finished run is never started again.
    finished = previous.get("phase") in FINAL_PHASES
    try:
        resolved = resolve_run(body, ctx.policy)
    except InvalidSpec as exc:
        new = invalid_run_status(previous, generation, exc.first_line, ctx.now())
        return Outcome(
            invalid=exc.first_line, status_written=await write_status(ctx.client, RLRUNS, body, new)
        )
    except PolicyRefused as exc:
        # Like an invalid spec: nothing is applied, so children that exist keep what they had.
        line = str(exc)
        new = refused_run_status(previous, generation, line, ctx.now())
        return Outcome(refused=line, status_written=await write_status(ctx.client, RLRUNS, body, new))

    options = await ctx.discovery.options()
    owner = owner_of(body)
    report = ApplyReport()
    alive = owner_check(ctx.client, RLRUNS, body)
    queue = None if finished else run_queue(body, ctx.default_queue)
    admission: ConditionValue | None = None
    held = False
    workload_left = False
    try:
        if queue is None:
            workload_left = await release_workload(ctx, resolved, owner, previous, report)
        else:
            # An API error reading the Workload propagates (the reconcile is retried, nothing
            # changed): only Kueue saying the Workload is not admitted holds the run.
            admission = await admit(ctx, resolved, owner, options, queue, report, alive)
        if admission is not None and admission[0] != "True":
            # Queued: nothing that runs is created; a run Kueue evicted (or that must be admitted
            # again) keeps its objects with every workload at zero, as a finished run does.
            held = (
                await ctx.client.get(STATEFULSETS, resolved.namespace, L.child_name(resolved.name, "trainer"))
                is not None
            )
            if not held:
                return await queued(ctx, body, resolved, owner, options, admission, report)
    except OwnerGone:
        return Outcome(report=report)
    try:
        hashed = await apply_token_secret(ctx, resolved, owner, report, alive)
    except OwnerGone:
        return Outcome(report=report)
    objects = run_objects(resolved, owner, options, finished=finished or held, token_hash=hashed)
    children: list[Child] = []
    for desired in objects:
        if hashed is None and carries_token_hash(desired):
            # The Secret's failure is in the report and the reconcile is retried; applied without
            # the token's hash, every workload would restart for nothing.
            continue
        if desired["kind"] == "SamplerPool":
            pool = resolved.pool(desired["spec"]["pool"])
            # A finished run's pools carry replicas 0 in what is desired (the builder's released()).
            seed = None if finished else {"spec": {"replicas": seed_replicas(pool)}}
            update = None if finished else (remember_replicas if held else within_bounds(pool))
            children.append(Child(desired, seed, update))
        elif desired["kind"] == "Secret":  # applied first (apply_token_secret)
            continue
        else:
            children.append(Child(desired))
    try:
        # The pools first: each has a reconcile of its own to go through before its engines start.
        applied = await apply_objects(
            ctx.client,
            children,
            report,
            alive,
            "weights.volumeSize",
            first=is_sampler_pool,
            cached=ctx.cached_reads,
            unseen_absent=ctx.unseen_children_absent,
        )
    except OwnerGone:
        return Outcome(report=report)
    removed = await remove_stale_pools(ctx.client, resolved, meta["uid"], report, ctx.cached_reads)
    if options.monitoring is Monitoring.ANNOTATIONS:
        await remove_leftover_pod_monitor(ctx, resolved, owner, options, report)
    if options.images.network_policies is None:
        await remove_leftover_network_policies(ctx, resolved, owner, report)
    if sandbox.enabled(resolved) is None:
        await remove_leftover_sandbox_objects(ctx, resolved, owner, report)

    def live(kind: str, suffix: str) -> Obj | None:
        found = applied.get(f"{kind}/{L.child_name(resolved.name, suffix)}")
        return found.after if found else None

    def pool_live(pool: ResolvedPool) -> Obj:
        found = applied.get(f"SamplerPool/{pool.object_name}")
        # Not readable this time: report it as the spec says, with nothing ready.
        return (
            found.after
            if found
            else next(o for o in objects if label(o) == f"SamplerPool/{pool.object_name}")
        )

    components = {
        "TrainerReady": WorkloadState.of(live("StatefulSet", "trainer")),
        "BufferReady": WorkloadState.of(live("StatefulSet", "buffer")),
        "RouterReady": WorkloadState.of(live("Deployment", "router")),
        "RolloutReady": WorkloadState.of(live("StatefulSet", "rollout")),
    }
    pools = [pool_state(pool.name, pool_live(pool)) for pool in resolved.pools]
    autoscaler = autoscaler_of(resolved.autoscaling.engine, options)
    new = run_status(
        previous,
        generation,
        components,
        pools,
        ctx.now(),
        autoscaler,
        report.failures,
        admission,
        keep_admitted=workload_left,
    )
    written = await write_status(ctx.client, RLRUNS, body, new)

    events: list[Event] = admission_events(previous, new)
    events += [
        ("Normal", Reason.POOL_ADDED, f"created {name}")
        for name in report.created
        if name.startswith("SamplerPool/")
    ]
    events += [("Normal", Reason.POOL_REMOVED, f"deleted {name}") for name in removed]
    events += outcome_events(report, written)
    return Outcome(report=report, status_written=written, events=events)


def run_queue(body: Obj, default: str | None) -> str | None:
    """The Kueue LocalQueue that admits the run: its ``spec.scheduling.queue`` (already validated),
    else the operator's default."""
    return ((body.get("spec") or {}).get("scheduling") or {}).get("queue") or default


KUEUE_MISSING = (
    "the run names Kueue LocalQueue {queue} (spec.scheduling.queue, or the operator's default queue), "
    "but the cluster does not serve kueue.x-k8s.io/v1beta2 workloads: install Kueue, or remove the "
    "queue; until then nothing of the run is created"
)


async def release_workload(
    ctx: Context, resolved: ResolvedRun, owner: Owner, previous: Obj, report: ApplyReport
) -> bool:
    """A run without a queue (none, or it ended) deletes the Workload an earlier reconcile made, so
    its quota frees.  Only a run that was queued can have one (its status has Admitted: no read for
    every other run's reconcile).  Returns whether the Workload may still be there (its deletion
    failed, reported): the run's Admitted condition then stays, so the retry deletes it."""
    was_queued = any(c.get("type") == ADMITTED for c in previous.get("conditions") or [])
    if not was_queued or not await ctx.discovery.serves(WORKLOADS):
        return False
    try:
        await delete_leftover(ctx.client, WORKLOADS, resolved.namespace, resolved.name, owner.uid, report)
    except ApiError as exc:
        report.failures.append(
            Failure(f"Workload/{resolved.name}", str(exc), True, exc.status, exc.retry_after)
        )
        return True
    return False


async def admit(
    ctx: Context,
    resolved: ResolvedRun,
    owner: Owner,
    options: BuildOptions,
    queue: str,
    report: ApplyReport,
    alive: Callable[[], Awaitable[None]],
) -> ConditionValue:
    """Apply the run's Kueue Workload and say whether Kueue admitted it (the Admitted value).  An
    admitted Workload whose pod sets must change (more GPUs, nodes, replicas; other placement)
    cannot be changed in place: it is deleted and created again, and the run waits in the queue
    for its new shape.

    Raises the :class:`ApiError` when the Workload cannot be read: a failed read is not an
    eviction, so nothing of the run changes and the reconcile is retried.  When the read worked
    but the write did not, the Workload as read says whether Kueue admits the run."""
    if not await ctx.discovery.serves(WORKLOADS):
        return "False", Reason.KUEUE_NOT_INSTALLED, KUEUE_MISSING.format(queue=queue)
    desired = run_workload(resolved, owner, options, queue)
    live = await ctx.client.get(WORKLOADS, resolved.namespace, resolved.name)
    refused = too_many_pod_sets(desired, queue)
    if refused is not None:
        # The API server would refuse the Workload (422) on every retry, and the run would wait
        # "for Kueue" forever: say why instead.  One left by an earlier spec (it had fewer pod
        # sets) is not what the run asks for now: it goes, so its quota frees while the run waits.
        if live is not None:
            await ctx.client.delete(
                WORKLOADS, resolved.namespace, resolved.name, uid=live["metadata"].get("uid")
            )
            report.deleted.append(f"Workload/{resolved.name}")
        return "False", Reason.QUEUED, refused
    if live is not None and has_quota(live) and live_hash(live) != live_hash(with_priority_of(desired, live)):
        await alive()
        await ctx.client.delete(WORKLOADS, resolved.namespace, resolved.name, uid=live["metadata"].get("uid"))
        report.recreated.append(f"Workload/{resolved.name} (its pod sets changed; admitted again)")
        live = None
    built = await at_priority(ctx, desired, live)
    if isinstance(built, str):
        return "False", Reason.PRIORITY_CLASS_MISSING, f"LocalQueue {queue}: {built}"
    applied = await apply_object(ctx.client, built, report, None, alive)
    workload = applied.after if applied is not None else live
    if admitted(workload):
        return "True", Reason.ADMITTED, f"admitted by Kueue in LocalQueue {queue} (Workload {resolved.name})"
    return "False", Reason.QUEUED, waiting_message(workload, queue)


async def at_priority(ctx: Context, desired: Obj, live: Obj | None) -> Obj | str:
    """A Workload as it is to be applied over ``live``, or why it cannot be: one that holds quota keeps
    the priority it has (Kueue refuses a new class then; whether its pod sets changed decides if it
    is made again); otherwise, with ``ctx.workload_priority``, its pods' PriorityClass gives it its
    priority (read from the cluster: Kueue needs the value beside the name)."""
    if live is not None and has_quota(live):
        return with_priority_of(desired, live)
    name = priority_class_name(desired)
    if name is None or not ctx.workload_priority:
        return desired
    found = await ctx.client.get_cluster(PRIORITY_CLASSES, name)
    if found is None:
        return (
            f"priorityClassName {name}: no PriorityClass of that name in the cluster, so the Workload "
            "has no priority to take (nor could its pods be created); create it or name another"
        )
    return with_priority(desired, name, int(found.get("value") or 0))


def priority_class_missing(workload: str, message: str) -> Failure:
    """A Workload that :func:`at_priority` could not build (retrying cannot help until the spec or
    the cluster's PriorityClasses change)."""
    return Failure(f"Workload/{workload}", message, retry=False, reason=Reason.PRIORITY_CLASS_MISSING)


async def apply_token_secret(
    ctx: Context,
    resolved: ResolvedRun,
    owner: Owner,
    report: ApplyReport,
    alive: Callable[[], Awaitable[None]],
) -> str | None:
    """The run's token Secret applied, created with a random token when it is absent (docs/auth.md),
    and the hash of its token (:data:`AUTH_TOKEN_HASH`); None when it could not be applied or holds
    no token (its failure is in ``report``)."""
    desired = with_hash(auth_secret(resolved, owner))
    seed = {"stringData": {AUTH_TOKEN_KEY: secrets.token_urlsafe(32)}}
    applied = await apply_objects(
        ctx.client,
        [Child(desired, seed)],
        report,
        alive,
        cached=ctx.cached_reads,
        unseen_absent=ctx.unseen_children_absent,
    )
    live = applied.get(label(desired))
    data = ((live.after.get("data") or {}) if live is not None else {}).get(AUTH_TOKEN_KEY)
    if not data:
        if live is not None:
            missing = (
                f"no {AUTH_TOKEN_KEY!r} in its data: delete the Secret, and the operator makes it again"
                " with a new token (every pod of the run restarts to take it)"
            )
            report.failures.append(Failure(label(desired), missing, retry=False))
        return None
    return token_hash(data)


def carries_token_hash(obj: Obj) -> bool:
    return obj["kind"] == "SamplerPool" or bool(pod_templates(obj))


async def queued(
    ctx: Context,
    body: Obj,
    resolved: ResolvedRun,
    owner: Owner,
    options: BuildOptions,
    admission: ConditionValue,
    report: ApplyReport,
) -> Outcome:
    """A run waiting for Kueue with nothing created: its status says why (Kueue's reason), with
    its pools as the spec declares them, none ready."""
    meta, previous = body["metadata"], body.get("status") or {}
    declared = [o for o in run_objects(resolved, owner, options) if o["kind"] == "SamplerPool"]
    components: dict[str, WorkloadState | None] = dict.fromkeys(
        ("TrainerReady", "BufferReady", "RouterReady", "RolloutReady")
    )
    pools = [pool_state(pool.name, obj) for pool, obj in zip(resolved.pools, declared, strict=True)]
    autoscaler = autoscaler_of(resolved.autoscaling.engine, options)
    new = run_status(
        previous, meta.get("generation"), components, pools, ctx.now(), autoscaler, report.failures, admission
    )
    written = await write_status(ctx.client, RLRUNS, body, new)
    events = admission_events(previous, new) + outcome_events(report, written)
    return Outcome(report=report, status_written=written, events=events)


def admission_events(previous: Obj, new: Obj) -> list[Event]:
    """Queued (with Kueue's reason) when the run starts waiting or its reason changes; Admitted
    when Kueue admits it."""

    def admission_of(status: Obj) -> Obj:
        return next((c for c in status.get("conditions") or [] if c.get("type") == ADMITTED), {})

    before, after = admission_of(previous), admission_of(new)
    if not after or (before.get("status"), before.get("message")) == (
        after.get("status"),
        after.get("message"),
    ):
        return []
    if after.get("status") == "True":
        return (
            [("Normal", Reason.ADMITTED, after.get("message", ""))] if before.get("status") != "True" else []
        )
    warned = (Reason.KUEUE_NOT_INSTALLED, Reason.PRIORITY_CLASS_MISSING)
    kind = "Warning" if after.get("reason") in warned else "Normal"
    return [(kind, Reason.QUEUED, after.get("message", "")[:1000])]


def outcome_events(report: ApplyReport, status_written: bool, applied_event: bool = True) -> list[Event]:
    """Recreated (per object), Applied (what changed), and one Warning per refusal, the refusals only
    when the status changed with them — a resync that finds the same refusal again does not repeat it."""
    events: list[Event] = [
        ("Normal", Reason.RECREATED, f"deleting {name} to create it again"[:1000])
        for name in report.recreated
    ]
    if report.changed and applied_event:
        events.append(("Normal", Reason.APPLIED, report.summary()[:1000]))
    if status_written:
        for failure in report.failures:
            if not failure.retry:
                message = f"{failure.object}: {failure.message}"[:1000]
                events.append(("Warning", failure.reason, message))
    return events


def pool_state(name: str, live: Obj) -> PoolState:
    spec, status = live.get("spec", {}), live.get("status") or {}
    generation = live.get("metadata", {}).get("generation")
    observed = status.get("observedGeneration")
    ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    return PoolState(
        name=name,
        gpu_type=spec.get("gpuType", ""),
        weight_precision=spec.get("weightPrecision", ""),
        desired=int(spec.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        rolling_out=(generation is not None and (observed is None or observed < generation))
        or ready.get("reason") == Reason.ROLLING_OUT,
    )


def is_sampler_pool(obj: Obj) -> bool:
    return obj["kind"] == SAMPLERPOOLS.kind


HELD_REPLICAS_ANNOTATION = "mixrl.dev/replicas-before-hold"
"""On a pool of a run Kueue holds (evicted, or queued again): the replicas it had before it was
held at zero, which it gets back when the run is admitted again."""


def remember_replicas(live: Obj) -> Obj:
    """The write that holds a pool at zero also keeps the replicas it had (once: a later write of a
    held pool finds it at zero already)."""
    annotations = live.get("metadata", {}).get("annotations") or {}
    if HELD_REPLICAS_ANNOTATION in annotations:
        return {}
    replicas = int(live.get("spec", {}).get("replicas") or 0)
    return {"metadata": {"annotations": {HELD_REPLICAS_ANNOTATION: str(replicas)}}}


def within_bounds(pool: ResolvedPool) -> Callable[[Obj], Obj]:
    """New bounds that exclude the current replica count move it to the nearest bound (in the same
    write as the new bounds); otherwise replicas stay whoever scaled the pool set them to.  A pool
    that was held comes back to the replicas it had (within the bounds), not to zero."""

    def extra(live: Obj) -> Obj:
        replicas = int(live.get("spec", {}).get("replicas") or 0)
        held = (live.get("metadata", {}).get("annotations") or {}).get(HELD_REPLICAS_ANNOTATION)
        if held is not None:
            before = int(held) if held.isdigit() else seed_replicas(pool)
            restored = {"replicas": clamp_replicas(before, pool)}
            return {"metadata": {"annotations": {HELD_REPLICAS_ANNOTATION: None}}, "spec": restored}
        clamped = clamp_replicas(replicas, pool)
        return {"spec": {"replicas": clamped}} if clamped != replicas else {}

    return extra


async def remove_stale_pools(
    client: KubeClient, resolved: ResolvedRun, uid: str, report: ApplyReport, cached: bool = False
) -> list[str]:
    """Delete SamplerPools this run owns but no longer declares (their Deployments follow by GC);
    ``cached``: those the watches showed (one they have not shown yet goes on its own event)."""
    wanted = {pool.object_name for pool in resolved.pools}
    selector = L.selector_labels(resolved.name, "sampler")
    found = await client.list(SAMPLERPOOLS, resolved.namespace, selector, cached=cached)
    removed = []
    for pool in found:
        meta = pool["metadata"]
        if meta["name"] in wanted or not owned_by(pool, uid) or meta.get("deletionTimestamp"):
            continue
        if await client.delete(SAMPLERPOOLS, meta["namespace"], meta["name"]):
            name = f"SamplerPool/{meta['name']}"
            report.deleted.append(name)
            removed.append(name)
    return removed


async def remove_leftover_pod_monitor(
    ctx: Context, resolved: ResolvedRun, owner: Owner, options: BuildOptions, report: ApplyReport
) -> None:
    """Annotations mode: delete the run's PodMonitor that an earlier PodMonitor mode left (an
    operator restarted with ``--monitoring annotations``, the chart's ``monitoring.mode`` changed),
    or Prometheus would scrape the run twice — through the monitor and through the annotations.

    Nothing is asked of a cluster that does not serve PodMonitors: there can be none.  A failure
    (discovery included) is reported like a child's, and the rest of the run is still applied."""
    name = pod_monitor(resolved, owner, options)["metadata"]["name"]  # the builder's name for it
    try:
        if await ctx.discovery.serves(PODMONITORS):
            await delete_leftover(ctx.client, PODMONITORS, resolved.namespace, name, owner.uid, report)
    except ApiError as exc:
        report.failures.append(Failure(f"PodMonitor/{name}", str(exc), True, exc.status, exc.retry_after))


async def remove_leftover_network_policies(
    ctx: Context, resolved: ResolvedRun, owner: Owner, report: ApplyReport
) -> None:
    """``--no-network-policies``: delete the run's NetworkPolicies that an earlier operator made
    (the platform now manages policies; two sets would both apply).  A failure is reported like a
    child's, and the rest of the run is still applied."""
    for name in policy_names(resolved):
        try:
            await delete_leftover(ctx.client, NETWORKPOLICIES, resolved.namespace, name, owner.uid, report)
        except ApiError as exc:
            failure = Failure(f"NetworkPolicy/{name}", str(exc), True, exc.status, exc.retry_after)
            report.failures.append(failure)


async def remove_leftover_sandbox_objects(
    ctx: Context, resolved: ResolvedRun, owner: Owner, report: ApplyReport
) -> None:
    """A run whose ``spec.rollout.sandbox`` was removed: delete what it made for sandbox pods — the
    pods a worker killed before it could delete them, the rollout workers' account, Role and
    RoleBinding (no pod runs under them now), and the sandboxes' NetworkPolicy.  That policy, which
    the watches show at no cost, tells they are there; it goes last, so a deletion that fails is
    tried again by the retry (reported like a child's failure).  Runs that never had sandbox pods
    cost no call once the watches have listed the policies."""
    namespace = resolved.namespace
    marker = sandbox.sandbox_network_policy(resolved, owner)["metadata"]["name"]
    client = ctx.client
    if client.cache.keeps(NETWORKPOLICIES):
        if client.cache.get(NETWORKPOLICIES, namespace, marker) is None:
            return
    elif await client.get(NETWORKPOLICIES, namespace, marker) is None:
        return
    account = sandbox.account_name(resolved)
    try:
        for pod in await client.list(PODS, namespace, sandbox.selector(resolved.name)):
            name = pod["metadata"]["name"]
            going = pod["metadata"].get("deletionTimestamp")
            if owned_by(pod, owner.uid) and not going and await client.delete(PODS, namespace, name):
                report.deleted.append(f"Pod/{name}")
        for resource, name in (
            (ROLEBINDINGS, account),
            (ROLES, account),
            (SERVICEACCOUNTS, account),
            (NETWORKPOLICIES, marker),
        ):
            await delete_leftover(client, resource, namespace, name, owner.uid, report)
    except ApiError as exc:
        report.failures.append(
            Failure(f"NetworkPolicy/{marker}", f"removing the sandbox objects: {exc}", True, exc.status)
        )


# ----------------------------------------------------------------------------- SamplerPool


WORKLOAD_KINDS = ("Deployment", LEADERWORKERSETS.kind)
"""The kinds of a pool's engines: one-node replicas, replicas across nodes."""
LWS_MISSING = (
    "a replica of this pool spans nodes, which needs LeaderWorkerSet (leaderworkerset.x-k8s.io/v1), "
    "and this cluster does not serve it: install LWS (docs/operator.md#multi-node-engine-pools)"
)


async def reconcile_pool(ctx: Context, body: Obj) -> Outcome:
    """A SamplerPool -> its Deployment (a LeaderWorkerSet for replicas across nodes) and headless
    Service (and in KEDA mode its ScaledObject).

    The SamplerPool carries its bounds and replicas, not its pod: the pod is built from the parent
    RLRun, read and resolved here again, for three reasons.  The RLRun is the one object the
    cluster's policy and admission checks guard, while a SamplerPool is writable by whoever may
    scale it, so engine images, arguments and scheduling copied into it would be a way around
    them.  The engines read the whole resolved run from the run's ConfigMap anyway (and the pod
    template carries its hash), so a copy would be a second source that can disagree with the
    first.  And the run gives what no pool holds alone: its weight store, its autoscaling engine
    and, for KEDA, its query.  Re-resolving costs one read of the run per pool reconcile."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return Outcome()
    try:
        pool_spec = parse_document(manifest(body))
        assert isinstance(pool_spec, SamplerPool)
    except InvalidSpec as exc:
        return Outcome(invalid=exc.first_line)
    spec = pool_spec.spec
    run_body = await ctx.client.get(RLRUNS, meta["namespace"], spec.run, cached=ctx.cached_reads)
    if (
        run_body is None
        or run_body["metadata"].get("deletionTimestamp")
        or not owned_by(body, run_body["metadata"]["uid"])
    ):
        return Outcome()  # an orphan: the garbage collector is about to remove it
    try:
        resolved = resolve_run(run_body, ctx.policy)
        pool = resolved.pool(spec.pool)
    except (InvalidSpec, PolicyRefused, KeyError):
        # The run's controller reports the problem, or deletes this pool; a refused run's engines
        # get nothing it asks for (its image, its flags), so its Deployment is left as it was.
        return Outcome()

    options = await ctx.discovery.options()
    report = ApplyReport()
    alive = owner_check(ctx.client, SAMPLERPOOLS, body)
    across_nodes = pool.nodes_per_replica > 1
    lws_served = await ctx.discovery.serves(LEADERWORKERSETS)
    finished = (run_body.get("status") or {}).get("phase") in FINAL_PHASES
    queue = None if finished else run_queue(run_body, ctx.default_queue)
    elastic: Elastic | None = None
    held = spec.replicas
    if queue is not None and await ctx.discovery.serves(WORKLOADS):
        # Extras that cannot be read raise the API error: the pool keeps what it runs (a failed
        # read admits nothing and evicts nothing) and the reconcile is retried.
        # Kueue's word on the run itself first: while it holds the run (evicted, or queued again),
        # the run's controller holds this pool at zero, yet whoever scales the pool may move its
        # replicas before that write lands; they must not start engines outside Kueue's quota, nor
        # keep extras' quota for a run that is not running.  A failed read of it raises too.
        run_workload_live = await ctx.client.get(WORKLOADS, resolved.namespace, resolved.name)
        try:
            if admitted(run_workload_live):
                elastic = await admit_extras(ctx, resolved, pool, body, options, queue, report, alive)
            else:
                await admit_extras(ctx, resolved, pool, body, options, None, report, alive)
                elastic = held_with_run(spec.replicas, queue, run_workload_live)
        except OwnerGone:
            return Outcome(report=report)
        assert elastic is not None
        held = elastic.held
    elif "awaitingAdmission" in (body.get("status") or {}) and await ctx.discovery.serves(WORKLOADS):
        # The run left its queue (or ended): the extras' quota frees; the pool scales as it asks.
        # A failed deletion raises before the status drops awaitingAdmission, so the retry
        # deletes what is left.
        await admit_extras(ctx, resolved, pool, body, options, None, report, alive)
    hashed = (meta.get("labels") or {}).get(AUTH_TOKEN_HASH)  # the run's controller sets it
    children = pool_children(resolved, pool, held, owner_of(body), options, token_hash=hashed)
    if across_nodes and not lws_served:
        # Said plainly instead of the API server's 404 for an unknown kind.  Only the cluster can
        # fix it (retry False: Progressing False), yet the reconcile is still retried, so installing
        # LWS is enough (discovery is asked again after its TTL).
        workload = next(c for c in children if c["kind"] == LEADERWORKERSETS.kind)
        missing = Failure(f"{workload['kind']}/{workload['metadata']['name']}", LWS_MISSING, retry=False)
        report.failures.append(missing)
        children = [c for c in children if c is not workload]
    try:
        applied = await apply_objects(
            ctx.client,
            [Child(desired) for desired in children],
            report,
            alive,
            cached=ctx.cached_reads,
            unseen_absent=ctx.unseen_children_absent,
        )
    except OwnerGone:
        return Outcome(report=report)
    deployment = next(
        (applied.get(label(desired)) for desired in children if desired["kind"] in WORKLOAD_KINDS), None
    )
    # A pool whose replicas moved between one node and several changed its workload's kind: the
    # other kind's object goes (its pods hold the GPUs the new one needs).
    uid = meta["uid"]
    leftovers = [(DEPLOYMENTS, pool.object_name)] if across_nodes else []
    if lws_served and not across_nodes:
        leftovers.append((LEADERWORKERSETS, lws_name(pool)))
    for resource, name in leftovers:
        try:
            await delete_leftover(ctx.client, resource, resolved.namespace, name, uid, report)
        except ApiError as exc:
            report.failures.append(
                Failure(f"{resource.kind}/{name}", str(exc), True, exc.status, exc.retry_after)
            )
    try:
        autoscaler = await reconcile_scaled_object(
            ctx.client, resolved, pool, body, options, report, alive, finished
        )
    except OwnerGone:
        return Outcome(report=report)
    selector = L.selector_string(L.selector_labels(resolved.name, "sampler", pool.name))
    engine = resolved.autoscaling.engine
    new = pool_status(
        body.get("status") or {},
        meta.get("generation"),
        deployment.after if deployment is not None else None,
        selector,
        ctx.now(),
        autoscaler,
        drop=loop_conditions_to_drop(engine),
        problems=report.failures,
        elastic=elastic,
    )
    written = await write_status(ctx.client, SAMPLERPOOLS, body, new)

    # Scaled: the Deployment was updated (a failed write leaves `after` the object read) to the
    # pool's new replica count; a repaired hand edit is reported as such (Applied), not as scaling.
    scaled_from = None
    if deployment is not None and deployment.before is not None and deployment.after is not deployment.before:
        changed = f"{deployment.after.get('kind')}/{deployment.after['metadata']['name']} "
        repaired = any(entry.startswith(changed) for entry in report.repaired)
        scaled_from = None if repaired else deployment.before.get("spec", {}).get("replicas")
    scaled = scaled_from is not None and scaled_from != held
    events: list[Event] = []
    if scaled:
        admitted_by = f" (of {spec.replicas} asked; the rest wait for Kueue)" if held < spec.replicas else ""
        events.append(("Normal", Reason.SCALED, f"replicas {scaled_from} -> {held}{admitted_by}"))
    events += outcome_events(report, written, applied_event=not scaled)
    return Outcome(report=report, status_written=written, events=events)


async def admit_extras(
    ctx: Context,
    resolved: ResolvedRun,
    pool: ResolvedPool,
    body: Obj,
    options: BuildOptions,
    queue: str | None,
    report: ApplyReport,
    alive: Callable[[], Awaitable[None]],
) -> Elastic | None:
    """A queued run's pool: one Kueue Workload per replica above its starting ones (which the run's
    Workload admitted), created as the pool's replicas rise and deleted — the ones still waiting
    first — as they fall; returns how many Kueue admitted (the pool's workload is held at the start
    plus those).  ``queue`` None: the run left its queue, so every extra Workload goes (and None
    comes back).  An :class:`ApiError` reading or deleting the extras propagates: not knowing
    what Kueue admitted is no reason to scale the pool."""
    namespace, uid = resolved.namespace, body["metadata"]["uid"]
    replicas = int((body.get("spec") or {}).get("replicas") or 0)
    start = seed_replicas(pool)
    owner = owner_of(body)
    found = await ctx.client.list(WORKLOADS, namespace, extra_labels(resolved, pool))
    live = [w for w in found if owned_by(w, uid) and not w["metadata"].get("deletionTimestamp")]
    plan = plan_extras(live, 0 if queue is None else max(replicas - start, 0))
    for workload in plan.delete:
        name = workload["metadata"]["name"]
        if await ctx.client.delete(WORKLOADS, namespace, name, uid=workload["metadata"].get("uid")):
            report.deleted.append(f"Workload/{name}")
    if queue is None:
        return None
    kept = []
    for workload in plan.keep:
        index = int(workload["metadata"]["labels"][EXTRA_LABEL])
        built = await at_priority(ctx, extra_workload(resolved, pool, owner, options, queue, index), workload)
        if isinstance(built, str):
            report.failures.append(priority_class_missing(workload["metadata"]["name"], built))
            kept.append(workload)
        elif live_hash(workload) == live_hash(built):
            kept.append(workload)
        elif has_quota(workload):  # admitted pod sets are immutable: queued again in its new shape
            await alive()
            await ctx.client.delete(
                WORKLOADS, namespace, built["metadata"]["name"], uid=workload["metadata"].get("uid")
            )
            report.recreated.append(f"Workload/{built['metadata']['name']} (its pod set changed)")
        else:
            applied = await apply_object(ctx.client, built, report, None, alive)
            kept.append(applied.after if applied is not None else workload)
    for index in plan.create:
        built = await at_priority(ctx, extra_workload(resolved, pool, owner, options, queue, index), None)
        if isinstance(built, str):
            report.failures.append(priority_class_missing(extra_workload_name(pool, index), built))
            continue
        applied = await apply_object(ctx.client, built, report, None, alive)
        if applied is not None:
            kept.append(applied.after)
    return elastic_admission(start, replicas, queue, kept)


async def reconcile_scaled_object(
    client: KubeClient,
    resolved: ResolvedRun,
    pool: ResolvedPool,
    body: Obj,
    options: BuildOptions,
    report: ApplyReport,
    alive: Callable[[], Awaitable[None]],
    finished: bool = False,
) -> ConditionValue:
    """KEDA mode: apply the pool's ScaledObject (owned by the SamplerPool, so removing the pool
    removes it).  Otherwise — or once the run has ended (``finished``: KEDA would scale the pool
    back to its minimum) — delete the one an earlier KEDA mode left.  Returns AutoscalerReady.

    Nothing is asked of a cluster without KEDA (discovery says so): there can be no ScaledObject to
    delete, and in KEDA mode the condition says KEDA is missing."""
    engine = resolved.autoscaling.engine
    if options.keda and engine == "keda" and not finished:
        desired = pool_scaled_object(resolved, pool, owner_of(body))
        await apply_object(client, desired, report, None, alive)
        return autoscaler_of(engine, options, desired["metadata"]["name"])
    if options.keda:
        uid = body["metadata"]["uid"]
        try:
            await delete_leftover(client, SCALEDOBJECTS, resolved.namespace, pool.object_name, uid, report)
        except ApiError as exc:
            failure = Failure(f"ScaledObject/{pool.object_name}", str(exc), True, exc.status, exc.retry_after)
            report.failures.append(failure)
    return autoscaler_of(engine, options)


def autoscaler_of(engine: str, options: BuildOptions, scaled_object: str | None = None) -> ConditionValue:
    """AutoscalerReady for ``autoscaling.engine`` under this operator's settings and cluster."""
    return autoscaler_value(
        engine,
        options.keda,
        scaled_object,
        keda_off=options.keda_off,
        builtin_loop=options.builtin_autoscaler,
    )


async def delete_leftover(
    client: KubeClient, resource: ApiResource, namespace: str, name: str, owner_uid: str, report: ApplyReport
) -> None:
    """Delete a child its owner no longer wants, if it is there, owned by it and not already going."""
    left = await client.get(resource, namespace, name)
    if left is None or not owned_by(left, owner_uid) or left["metadata"].get("deletionTimestamp"):
        return
    if await client.delete(resource, namespace, name):
        report.deleted.append(f"{resource.kind}/{name}")
