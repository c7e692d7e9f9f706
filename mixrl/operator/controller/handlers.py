"""kopf handlers: when to reconcile.  Every handler is a watch-event handler; what it asks for
runs in :mod:`mixrl.operator.controller.runtime` (level-triggered: a reconcile reads the object as
it is now and makes the children match, whichever event asked for it).

- RLRun and SamplerPool: an event that changes what the object's reconcile acts on (its spec,
  labels or annotations — not the status its reconciles write) reconciles it at once; the events
  of the operator's start (kopf's first listing) reconcile every object from the API server.  An
  invalid or refused spec is said on the status and in one Warning event, and not retried until
  the spec changes; conflicts, throttling, server errors and lost connections are retried with
  jittered exponential backoff (``Retry-After`` honoured), RBAC and quota refusals slowly.
- Children (every kind the operator creates: ConfigMaps, Services, claims, Deployments,
  StatefulSets, SamplerPools, and PodMonitors and ScaledObjects where they may exist):
  an event handler — deletions included — asks for a debounced reconcile of the owner, so status
  follows readiness, a hand edit is undone and a deleted child is recreated.
- A periodic resync (``resync_interval_s``) reconciles every known RLRun and SamplerPool again,
  which repairs what no event announced (a missed watch event, a change during a restart).  A
  reconcile writes only what differs from the live objects, so a resync — like an operator
  restart — of an unchanged cluster sends no write at all.
- No create or update handlers, so kopf keeps no bookkeeping on our objects (no diff base or
  progress annotations, no write of its own per change), and no finalizers: deletion is the garbage
  collector's job through owner references (kopf timers would add one, which is why the resync is
  our own loop).
- The built-in autoscaler (:mod:`mixrl.operator.autoscaling.loop`) runs in the same operator, on
  the same API client (so its calls are RBAC-checked like the reconcilers'), for the pools of runs
  whose ``autoscaling.engine`` is ``builtin``; in KEDA mode the pool's controller applies a
  ScaledObject instead (when the cluster serves keda.sh), and ``none`` leaves replicas alone.

This module is the kopf layer and nothing more: what kopf calls, and what it asks the runtime
for.  The work it hands to :mod:`mixrl.operator.controller.runtime` (locks, debounced and retried
reconciles, the resync, peering) and from there to the reconcilers, which never call back up here:
they return the events to post.

Everything is registered on a fresh :class:`kopf.OperatorRegistry` by :func:`build_registry`,
so tests run several operators, one after another, in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import kopf

from mixrl.api.kube_types import Obj
from mixrl.api.models import GROUP, VERSION
from mixrl.operator.autoscaling.loop import AutoscalingLoop
from mixrl.operator.builders import labels as L
from mixrl.operator.controller.observer import StatusObserver
from mixrl.operator.controller.runtime import OperatorConfig, Runtime
from mixrl.operator.kube.client import Connection
from mixrl.operator.kube.rbac import (
    CHILD_RESOURCES,
    NETWORKPOLICIES,
    PODMONITORS,
    RLRUNS,
    SAMPLERPOOLS,
    SCALEDOBJECTS,
    ApiResource,
)


def default_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the service account.  Elsewhere (``--dev``): the kubeconfig, through the kubernetes
    client when it is installed (exec plugins, OIDC), else kopf's own kubeconfig reader."""
    info = kopf.login_with_service_account(**kwargs)
    if info is None:
        try:
            info = kopf.login_via_client(**kwargs)
        except Exception:  # no usable kubeconfig for the client library; try kopf's reader
            info = None
    return info or kopf.login_with_kubeconfig(**kwargs)


def watched_object(event: kopf.RawEvent) -> Obj:
    """A watch event's object as kopf decoded it from the stream: a plain dict of its own, which kopf
    only reads after the handlers, so it is kept without a copy (the deep copies of every body were
    3–4 % of the operator's CPU while 20 runs start on 400 nodes: bench/cluster_scale.py under
    py-spy).
    Nothing in the operator changes an object it keeps: reconciles build new ones."""
    return cast(Obj, event["object"])


def post_event(obj: Obj, kind: str, reason: str, message: str) -> None:
    # kopf.event, not kopf.info: the posting level filters only log-derived events, not ours.
    # kopf types it for its Body; it reads only the metadata, which a plain dict has as well
    kopf.event(cast(kopf.Body, obj), type=kind, reason=reason, message=message)


class NoDiffBase(kopf.DiffBaseStorage):
    """The operator registers no create or update handler, so kopf has nothing to diff; its default
    storage still deep-copies every event's body into an "essence" to diff (about 8 % of the
    operator's CPU while 20 runs start: bench/cluster_scale.py under py-spy)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def watched_children(config: OperatorConfig) -> dict[str, tuple[ApiResource, ...]]:
    """API group -> the kinds of child watched in it: every kind the operator creates except
    SamplerPools (watched for their own handlers); events of any of them reconcile the owner.

    PodMonitors, ScaledObjects and NetworkPolicies only where this configuration may create them: the chart grants
    their RBAC only then, and a watch the RBAC refuses would fail forever.  Where the cluster does
    not serve them (no Prometheus Operator, no KEDA) kopf warns once at start and watches nothing."""
    skipped: set[ApiResource] = {SAMPLERPOOLS}
    if config.monitoring == "annotations":
        skipped.add(PODMONITORS)
    if config.keda == "off":
        skipped.add(SCALEDOBJECTS)
    if config.images.network_policies is None:  # --no-network-policies: leftovers are read by name
        skipped.add(NETWORKPOLICIES)
    groups: dict[str, tuple[ApiResource, ...]] = {}
    for resource in CHILD_RESOURCES:
        if resource not in skipped:
            groups[resource.group] = (*groups.get(resource.group, ()), resource)
    return groups


def selects(resources: tuple[ApiResource, ...]) -> Callable[[kopf.Resource], bool]:
    """A kopf selector for several kinds of one API group (kopf scans only the groups handlers
    name, so every selector names its group: a scan of all groups would fail on an unavailable
    aggregated API, such as a metrics server that is down)."""
    wanted = {(r.group, r.version, r.plural) for r in resources}

    def check(resource: kopf.Resource) -> bool:
        return (resource.group, resource.version, resource.plural) in wanted

    return check


def controller_of(obj: Obj) -> tuple[str, str] | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            return ref["kind"], ref["name"]
    return None


def register_autoscaling(registry: kopf.OperatorRegistry, loop: AutoscalingLoop, feed: bool = True) -> None:
    """Run the built-in autoscaler from startup to cleanup, and with ``feed`` hand it the RLRuns and
    SamplerPools kopf watches (the operator's registry feeds it from its own handlers of those kinds
    instead: :func:`build_registry`).  No kopf timer or daemon: those would put a finalizer on
    every pool."""
    if feed:

        @kopf.on.event(GROUP, VERSION, "rlruns", registry=registry)
        async def autoscaler_sees_run(event: kopf.RawEvent, type: str | None, **_: Any) -> None:
            loop.observe_run(watched_object(event), deleted=type == "DELETED")

        @kopf.on.event(GROUP, VERSION, "samplerpools", registry=registry)
        async def autoscaler_sees_pool(event: kopf.RawEvent, type: str | None, **_: Any) -> None:
            loop.observe_pool(watched_object(event), deleted=type == "DELETED")

    @kopf.on.startup(registry=registry)
    async def autoscaler_start(**_: Any) -> None:
        loop.start()

    @kopf.on.cleanup(registry=registry)
    async def autoscaler_stop(**_: Any) -> None:
        await loop.stop()


def register_live_status(registry: kopf.OperatorRegistry, observer: StatusObserver) -> None:
    """Run the live status loop from startup to cleanup (the RLRun events feed it: :func:`build_registry`)."""

    @kopf.on.startup(registry=registry)
    async def status_start(**_: Any) -> None:
        observer.start()

    @kopf.on.cleanup(registry=registry)
    async def status_stop(**_: Any) -> None:
        await observer.stop()


def build_registry(config: OperatorConfig) -> tuple[kopf.OperatorRegistry, Runtime]:
    registry = kopf.OperatorRegistry()
    rt = Runtime(config, post_event)
    managed = {L.MANAGED_BY: L.MANAGER}
    # What the watches below show is kept for the reconciles that events ask for.
    rt.client.cache.watch([(RLRUNS, {}), (SAMPLERPOOLS, {})])
    rt.client.cache.watch((r, managed) for rs in watched_children(config).values() for r in rs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        rt.peering = settings.peering
        settings.scanning.disabled = True  # the chart installs the CRDs: no need to list CRDs or namespaces
        settings.persistence.finalizer = f"{GROUP}/finalizer"  # never added: no handler needs one
        settings.persistence.diffbase_storage = NoDiffBase()
        settings.posting.reporting_component = L.MANAGER
        settings.posting.level = logging.WARNING  # our events are explicit; logs stay logs
        # Children are watched through a server-side label selector (a (group, plural) key: kopf
        # reads a "group/plural" string as one resource name and would match nothing).
        for resources in watched_children(config).values():
            for resource in resources:
                settings.watching.label_selectors[resource.group or "v1", resource.plural] = (
                    f"{L.MANAGED_BY}={L.MANAGER}"
                )
        if config.tune is not None:
            config.tune(settings)

    @kopf.on.startup(registry=registry)
    async def start_resync(**_: Any) -> None:
        rt.start()

    if config.autoscaling is not None:
        # The operator's API client, shared (so its calls are RBAC-checked like the reconcilers'),
        # and its per-SamplerPool lock, so the loop and the pool's controller never write the
        # pool's status from reads that crossed.
        rt.autoscaler = AutoscalingLoop(
            rt.client,
            config.autoscaling,
            lock=lambda namespace, name: rt.lock(f"SamplerPool/{namespace}/{name}"),  # as lock_key()
            may_act=rt.active_in,
            run_lock=lambda namespace, name: rt.lock(f"RLRun/{namespace}/{name}"),  # as lock_key()
        )
        register_autoscaling(registry, rt.autoscaler, feed=False)  # run_event and pool_event feed it

    if config.live_status is not None:
        rt.observer = StatusObserver(
            rt.client,
            config.live_status,
            reconcile=lambda namespace, name: rt.request("RLRun", namespace, name),
            may_act=rt.active_in,
            lock=rt.lock,  # keys as runtime.lock_key
        )
        register_live_status(registry, rt.observer)

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await rt.stop()  # pending retries and the resync: they use the client too
        if rt.autoscaler is not None:  # before closing: its last writes go through the shared client
            await rt.autoscaler.stop()
        if rt.observer is not None:
            await rt.observer.stop()
        await rt.client.close()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = (config.login or default_login)(**kwargs)
        if info is not None:
            rt.connection = Connection.from_kopf(info)
        return info

    def changed(obj: Obj, type: str | None) -> None:
        # A change of the object itself reconciles it now, ahead of the queued child events; the
        # operator's start (kopf's first listing, type None) reconciles everything from the API
        # server, in the queue.  Its own status writes do not count as a change.
        if rt.observe(obj, deleted=type == "DELETED", listed=type is None):
            meta = obj["metadata"]
            start = type is None
            rt.request(
                obj["kind"], meta["namespace"], meta["name"], fresh=start, debounce=False, limited=start
            )

    # One handler per kind, and async: kopf runs a plain function in a thread of its executor, and
    # each handler is a call of its own per event.
    @kopf.on.event(GROUP, VERSION, "rlruns", registry=registry)
    async def run_event(event: kopf.RawEvent, type: str | None, **_: Any) -> None:
        run, deleted = watched_object(event), type == "DELETED"
        if rt.autoscaler is not None:
            rt.autoscaler.observe_run(run, deleted)
        if rt.observer is not None:
            rt.observer.observe_run(run, deleted)
        changed(run, type)

    @kopf.on.event(GROUP, VERSION, "samplerpools", registry=registry)
    async def pool_event(event: kopf.RawEvent, type: str | None, **_: Any) -> None:
        pool = watched_object(event)
        if rt.autoscaler is not None:
            rt.autoscaler.observe_pool(pool, type == "DELETED")
        changed(pool, type)
        # Also: a pool's readiness is part of its run's status, while a deleted pool that the run
        # still declares is recreated by the run's reconcile.
        owner = controller_of(pool)
        if owner is not None:
            rt.request(owner[0], pool["metadata"]["namespace"], owner[1])

    async def child_event(event: kopf.RawEvent, type: str | None, **_: Any) -> None:
        # Any event, deletions included: the owner's reconcile restores what differs.
        child = watched_object(event)
        rt.seen(child, deleted=type == "DELETED")
        owner = controller_of(child)
        if owner is not None:
            rt.request(owner[0], child["metadata"]["namespace"], owner[1])

    for group, resources in watched_children(config).items():
        watch = kopf.on.event(
            selects(resources),
            group=group,
            labels=managed,
            id=f"child_event/{group or 'core'}",
            registry=registry,
        )
        watch(child_event)

    return registry, rt
