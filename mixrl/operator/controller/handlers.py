"""kopf handlers: when to reconcile, and how failures are retried.

- RLRun and SamplerPool: create, update and resume handlers reconcile the object.  An invalid
  spec is a ``kopf.PermanentError`` (InvalidSpec condition, one Warning event, no requeue);
  conflicts, throttling, server errors and lost connections are ``kopf.TemporaryError`` with an
  exponential backoff (``Retry-After`` honoured).
- Children (every kind the operator creates: ConfigMaps, Services, claims, Deployments,
  StatefulSets, SamplerPools, and PodMonitors and ScaledObjects where they may exist):
  an event handler — deletions included — asks for a debounced reconcile of the owner, so status
  follows readiness, a hand edit is undone and a deleted child is recreated.  Such a reconcile
  runs in a task of its own and, when it fails, is retried with jittered exponential backoff.
- A periodic resync (``resync_interval_s``) reconciles every known RLRun and SamplerPool again,
  which repairs what no event announced (a missed watch event, a change during a restart).  A
  reconcile writes only what differs from the live objects, so a resync — like an operator
  restart — of an unchanged cluster sends no write at all.
- No finalizers: deletion is the garbage collector's job through owner references, and no
  handler here needs one (kopf timers would add one, which is why the resync is our own loop).
- kopf keeps its bookkeeping in ``mixrl.dev/*`` annotations, never in our status.
- The built-in autoscaler (:mod:`mixrl.operator.autoscaling.loop`) runs in the same operator, on
  the same API client (so its calls are RBAC-checked like the reconcilers'), for the pools of runs
  whose ``autoscaling.engine`` is ``builtin``; in KEDA mode the pool's controller applies a
  ScaledObject instead (when the cluster serves keda.sh), and ``none`` leaves replicas alone.

Everything is registered on a fresh :class:`kopf.OperatorRegistry` by :func:`build_registry`,
so tests run several operators, one after another, in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from mixrl.api.models import GROUP, VERSION
from mixrl.operator.autoscaling.loop import AutoscalingLoop, LoopSettings, register_autoscaling
from mixrl.operator.build import labels as L
from mixrl.operator.build.objects import BuildOptions, Images, Monitoring
from mixrl.operator.controller.apply import ApplyFailed, StillTerminating
from mixrl.operator.controller.kube import ApiError, Connection, KubeClient
from mixrl.operator.controller.peering import paused_by_peers
from mixrl.operator.controller.rbac import (
    CHILD_RESOURCES,
    PODMONITORS,
    RLRUNS,
    SAMPLERPOOLS,
    SCALEDOBJECTS,
    ApiResource,
    peering_resource,
)
from mixrl.operator.controller.reconcile import Context, Outcome, reconcile_pool, reconcile_run
from mixrl.operator.controller.status import PROGRESSING, Reason, make_condition, merge_conditions
from mixrl.operator.install.policy import OPEN, Policy

Obj = dict[str, Any]
LoginFn = Callable[..., kopf.ConnectionInfo | None]

log = logging.getLogger("mixrl.operator")


@dataclass
class OperatorConfig:
    images: Images = field(default_factory=Images)
    monitoring: str = "auto"
    """``auto`` (PodMonitor when monitoring.coreos.com/v1 serves podmonitors), ``podmonitor`` or
    ``annotations``."""
    discovery_ttl_s: float = 300.0
    event_debounce_s: float = 1.0
    """Child events within this window cause one reconcile of their owner, not one each."""
    drain_seconds: int = 300
    backoff_base_s: float = 2.0
    backoff_cap_s: float = 120.0
    backoff_jitter: float = 0.5
    """Each retry waits a random time in [(1 - jitter) × delay, delay]: retries of a failure many
    objects share (an API server outage) spread out instead of arriving in lockstep."""
    uniform: Callable[[], float] = random.random
    """The jitter's source of uniform [0, 1) numbers (tests pass a seeded ``random.Random(n).random``)."""
    resync_interval_s: float | None = 60.0
    """How often every known RLRun and SamplerPool is reconciled again whatever the events said;
    None turns the resync off (watch events still reconcile)."""
    reconcile_concurrency: int = 4
    """At most this many event- or resync-triggered reconciles run at once (a resync of many runs
    does not flood the API server)."""
    login: LoginFn | None = None
    """How to reach the API server; default: in-cluster service account, then kubeconfig."""
    tune: Callable[[kopf.OperatorSettings], None] | None = None
    """Extra kopf settings (tests shorten timeouts)."""
    autoscaling: LoopSettings | None = field(default_factory=LoopSettings)
    """The built-in autoscaler's settings; None runs no built-in autoscaler (pools of ``builtin``
    runs then keep their replicas)."""
    keda: str = "auto"
    """``auto`` (ScaledObjects when keda.sh/v1alpha1 serves scaledobjects), ``on`` or ``off``."""
    policy: Policy = OPEN
    """What an RLRun may ask for (images, engine arguments, scheduling); a run asking for more is
    marked PolicyViolation and nothing of it is created."""


def backoff(retry: int, config: OperatorConfig, retry_after: float | None = None) -> float:
    """Jittered exponential backoff for the ``retry``-th retry, at least what the server asked for:
    base × 2^retry, capped, then shortened by up to ``backoff_jitter`` of itself."""
    delay = min(config.backoff_cap_s, config.backoff_base_s * 2 ** min(retry, 16))
    delay *= 1.0 - config.backoff_jitter * config.uniform()
    return max(delay, retry_after or 0.0)


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


def plain(value: Any) -> Any:
    """kopf's bodies are read-only views; the reconcilers take plain dicts."""
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


class Runtime:
    """Per-operator state: the API client, the connection kopf logged in with, per-object locks."""

    def __init__(self, config: OperatorConfig):
        self.config = config
        self.connection: Connection | None = None
        self.client = KubeClient(self._current_connection)
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._queued: set[str] = set()
        self._wake: dict[str, asyncio.Event] = {}
        """Per owner whose failed reconcile waits for its retry: set by a new request for it."""
        self.known: dict[str, tuple[str, str, str]] = {}
        """lock key -> (kind, namespace, name) of every RLRun and SamplerPool kopf's watches have
        shown (an index the resync walks: it costs no API call of its own)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots: asyncio.Semaphore | None = None
        self._resync: asyncio.Task[None] | None = None
        self._served: dict[str, tuple[set[str] | None, float]] = {}
        self.autoscaler: AutoscalingLoop | None = None
        self.kopf_settings: kopf.OperatorSettings | None = None
        """kopf's settings once it started (the peering name, scope and priority it runs with)."""

    def _current_connection(self) -> Connection:
        if self.connection is None:
            raise ApiError(0, "NotLoggedIn", "no API credentials yet")
        return self.connection

    def lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the cluster serves a resource (API discovery, remembered for ``discovery_ttl_s``)."""
        key = f"{group}/{version}"
        now = asyncio.get_running_loop().time()
        known = self._served.get(key)
        if known is None or now - known[1] > self.config.discovery_ttl_s:
            known = (await self.client.served_resources(group, version), now)
            self._served[key] = known
        return known[0] is not None and plural in known[0]

    async def monitoring(self) -> Monitoring:
        if self.config.monitoring != "auto":
            return Monitoring(self.config.monitoring)
        served = await self.serves("monitoring.coreos.com", "v1", "podmonitors")
        return Monitoring.POD_MONITOR if served else Monitoring.ANNOTATIONS

    async def keda(self) -> bool:
        if self.config.keda != "auto":
            return self.config.keda == "on"
        return await self.serves("keda.sh", "v1alpha1", "scaledobjects")

    async def options(self) -> BuildOptions:
        return BuildOptions(
            images=self.config.images,
            monitoring=await self.monitoring(),
            drain_seconds=self.config.drain_seconds,
            keda=await self.keda(),
        )

    async def active_in(self, namespace: str) -> bool:
        """Whether kopf's peering lets this operator act in ``namespace`` (for the autoscaler, which
        is not a kopf handler and is not paused by kopf)."""
        settings = self.kopf_settings
        if settings is None or settings.peering.standalone:
            return True
        peering = await self.client.get(
            peering_resource(settings.peering.clusterwide), namespace, settings.peering.name
        )
        if peering is None:  # kopf runs standalone when optional peering finds no object
            return not settings.peering.mandatory
        status = peering.get("status") or {}
        return not paused_by_peers(status, settings.peering.priority, datetime.now(UTC))

    async def serves_resource(self, resource: ApiResource) -> bool:
        return await self.serves(resource.group, resource.version, resource.plural)

    def context(self) -> Context:
        return Context(
            client=self.client,
            options=self.options,
            events=post_event,
            serves=self.serves_resource,
            policy=self.config.policy,
        )

    # ------------------------------------------------------------------ event- and resync-driven work

    def observe(self, body: Obj, deleted: bool) -> None:
        key = lock_key(body)
        if deleted:
            self.known.pop(key, None)
        else:
            meta = body["metadata"]
            self.known[key] = (body["kind"], meta["namespace"], meta["name"])

    def request(self, kind: str, namespace: str, name: str) -> None:
        """Reconcile an RLRun or SamplerPool soon (debounced), in a task of its own; nothing when
        one is already queued for it, since that one will see the latest state."""
        stub = {"kind": kind, "metadata": {"namespace": namespace, "name": name}}
        key = lock_key(stub)
        if key in self._queued:
            # One is queued.  If it is a retry waiting out its backoff, something changed since it
            # failed (the old StatefulSet of a recreation is finally gone): try again now.
            wake = self._wake.get(key)
            if wake is not None:
                wake.set()
            return
        reconcile = reconcile_run if kind == "RLRun" else reconcile_pool
        self.spawn(coalesced(self, stub, reconcile))

    def spawn(self, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def slots(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(max(1, self.config.reconcile_concurrency))
        return self._slots

    async def resync_once(self) -> int:
        """Ask for a reconcile of every known object where this operator is the active peer;
        returns how many were asked for."""
        active: dict[str, bool] = {}
        asked = 0
        for kind, namespace, name in sorted(self.known.values()):
            if namespace not in active:
                active[namespace] = await self.active_in(namespace)
            if active[namespace]:
                self.request(kind, namespace, name)
                asked += 1
        return asked

    async def resync_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                asked = await self.resync_once()
            except ApiError as exc:  # the peering read failed: try again next time
                log.warning("resync skipped: %s", exc)
            else:
                log.debug("resync: %d objects", asked)

    def start(self) -> None:
        interval = self.config.resync_interval_s
        if interval and self._resync is None:
            self._resync = asyncio.create_task(self.resync_forever(interval))

    async def stop(self) -> None:
        tasks = [*self._tasks, *([self._resync] if self._resync is not None else [])]
        self._resync = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def post_event(obj: Obj, kind: str, reason: str, message: str) -> None:
    # kopf.event, not kopf.info: the posting level filters only log-derived events, not ours.
    kopf.event(obj, type=kind, reason=reason, message=message)


async def report_failure(rt: Runtime, body: Obj, error: Exception) -> None:
    """Best effort: say on the run's Progressing condition why it is stuck (the API may be down);
    no write when the condition already says so."""
    conditions = list((body.get("status") or {}).get("conditions") or [])
    generation = body["metadata"].get("generation")
    value = ("True", Reason.APPLY_FAILED, str(error)[:300])
    failed = make_condition(PROGRESSING, value, generation, rt.context().now(), conditions)
    before = next((c for c in conditions if c.get("type") == PROGRESSING), None)
    if before is not None and {k: before.get(k) for k in failed} == failed:
        return
    meta = body["metadata"]
    patch = {"status": {"conditions": merge_conditions(conditions, [failed])}}
    with contextlib.suppress(ApiError):
        await rt.client.merge_patch(RLRUNS, meta["namespace"], meta["name"], patch, subresource="status")


def lock_key(body: Obj) -> str:
    meta = body["metadata"]
    return f"{body.get('kind')}/{meta['namespace']}/{meta['name']}"


async def read_fresh(rt: Runtime, body: Obj) -> Obj | None:
    """The object as the API server has it now, or None when it is gone (or was replaced).

    kopf hands a handler the body of the event it is processing, which can be older than the
    object (a pool scaled twice in a row); acting on it would write stale replicas back."""
    meta = body["metadata"]
    resource = RLRUNS if body.get("kind") == "RLRun" else SAMPLERPOOLS
    fresh = await rt.client.get(resource, meta["namespace"], meta["name"])
    if fresh is None or ("uid" in meta and fresh["metadata"].get("uid") != meta["uid"]):
        return None
    return fresh


async def guarded(
    rt: Runtime,
    body: Obj,
    reconcile: Callable[[Context, Obj], Awaitable[Outcome]],
    retry: int,
) -> Outcome:
    """Reconcile one object under its lock, from its current state; map failures to kopf's retries."""
    try:
        async with rt.lock(lock_key(body)):
            fresh = await read_fresh(rt, body)
            if fresh is None:
                return Outcome()
            body = fresh
            outcome = await reconcile(rt.context(), body)
    except ApiError as exc:
        if body.get("kind") == "RLRun":
            await report_failure(rt, body, exc)
        if exc.retryable:
            raise kopf.TemporaryError(str(exc), delay=backoff(retry, rt.config, exc.retry_after)) from exc
        if exc.status in (401, 403):  # credentials or RBAC: fixable outside, so keep trying, slowly
            raise kopf.TemporaryError(
                f"{exc} (check the operator's RBAC)", delay=rt.config.backoff_cap_s
            ) from exc
        raise kopf.PermanentError(str(exc)) from exc  # the API server rejected what we built
    except ApplyFailed as exc:  # some children failed; the status says which (no report_failure)
        if exc.forbidden_only:  # RBAC, or admission (a quota): fixable outside, so retry slowly
            raise kopf.TemporaryError(
                f"{exc} (refused: check the operator's RBAC and the namespace's quotas)",
                delay=rt.config.backoff_cap_s,
            ) from exc
        raise kopf.TemporaryError(str(exc), delay=backoff(retry, rt.config, exc.retry_after)) from exc
    except StillTerminating as exc:
        raise kopf.TemporaryError(str(exc), delay=backoff(retry, rt.config)) from exc
    if outcome.invalid is not None:
        post_event(body, "Warning", Reason.INVALID_SPEC, outcome.invalid)
        raise kopf.PermanentError(outcome.invalid)
    if outcome.refused is not None:
        # Not retried until the spec changes; a changed policy restarts the operator (new flags),
        # and its resume handlers reconcile every run again.
        post_event(body, "Warning", Reason.POLICY_VIOLATION, outcome.refused)
        raise kopf.PermanentError(outcome.refused)
    return outcome


RETRIED = (ApiError, StillTerminating, ApplyFailed)


async def coalesced(rt: Runtime, body: Obj, reconcile: Callable[[Context, Obj], Awaitable[Outcome]]) -> None:
    """Reconcile on behalf of a child's event or the resync, after ``event_debounce_s``; if one is
    already queued for this owner, it will see the latest state, so this one is dropped.

    A failed reconcile is retried with jittered exponential backoff until it succeeds, the owner is
    gone or another peer took over; a new request for the owner while a retry waits ends the wait
    (after the usual debounce), since what failed may have changed."""
    key = lock_key(body)
    if key in rt._queued:
        return
    rt._queued.add(key)
    queued = True  # the marker in rt._queued is ours to remove
    delay, attempt = rt.config.event_debounce_s, 0
    try:
        while True:
            await asyncio.sleep(delay)
            if attempt and not await rt.active_in(body["metadata"]["namespace"]):
                return
            async with rt.slots(), rt.lock(key):
                rt._queued.discard(key)
                queued = False
                try:
                    fresh = await read_fresh(rt, body)
                    if fresh is not None:
                        await reconcile(rt.context(), fresh)
                    return
                except RETRIED as exc:
                    error: Exception = exc
            if key in rt._queued:
                return
            wait = backoff(attempt, rt.config, getattr(error, "retry_after", None))
            attempt += 1
            log.warning("reconcile of %s failed (retry %d in %.1f s): %s", key, attempt, wait, error)
            rt._queued.add(key)
            queued = True
            woken = rt._wake[key] = asyncio.Event()
            try:
                await asyncio.wait_for(woken.wait(), timeout=wait)
            except TimeoutError:
                delay = 0.0  # the backoff has passed
            else:
                delay = rt.config.event_debounce_s  # a new event: debounced, as any
            finally:
                rt._wake.pop(key, None)
    except ApiError as exc:  # the peering read before a retry
        log.warning("reconcile of %s not retried: %s", key, exc)
    finally:
        if queued:
            rt._queued.discard(key)


def watched_children(config: OperatorConfig) -> dict[str, tuple[ApiResource, ...]]:
    """API group -> the kinds of child watched in it: every kind the operator creates except
    SamplerPools (watched for their own handlers); events of any of them reconcile the owner.

    PodMonitors and ScaledObjects only where this configuration may create them: the chart grants
    their RBAC only then, and a watch the RBAC refuses would fail forever.  Where the cluster does
    not serve them (no Prometheus Operator, no KEDA) kopf warns once at start and watches nothing."""
    skipped: set[ApiResource] = {SAMPLERPOOLS}
    if config.monitoring == "annotations":
        skipped.add(PODMONITORS)
    if config.keda == "off":
        skipped.add(SCALEDOBJECTS)
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


def build_registry(config: OperatorConfig) -> tuple[kopf.OperatorRegistry, Runtime]:
    registry = kopf.OperatorRegistry()
    rt = Runtime(config)
    managed = {L.MANAGED_BY: L.MANAGER}

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        rt.kopf_settings = settings
        settings.scanning.disabled = True  # the chart installs the CRDs: no need to list CRDs or namespaces
        settings.persistence.finalizer = f"{GROUP}/finalizer"  # never added: no handler needs one
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
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
        rt.autoscaler = register_autoscaling(
            registry,
            lambda: rt.connection,
            config.autoscaling,
            client=rt.client,
            lock=lambda namespace, name: rt.lock(f"SamplerPool/{namespace}/{name}"),  # as lock_key()
            may_act=rt.active_in,
        )

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await rt.stop()  # pending retries and the resync: they use the client too
        if rt.autoscaler is not None:  # before closing: its last writes go through the shared client
            await rt.autoscaler.stop()
        await rt.client.close()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = (config.login or default_login)(**kwargs)
        if info is not None:
            rt.connection = Connection.from_kopf(info)
        return info

    @kopf.on.resume(GROUP, VERSION, "rlruns", registry=registry)
    @kopf.on.create(GROUP, VERSION, "rlruns", registry=registry)
    @kopf.on.update(GROUP, VERSION, "rlruns", registry=registry)
    async def run_changed(body: kopf.Body, retry: int, **_: Any) -> None:
        await guarded(rt, plain(body), reconcile_run, retry)

    @kopf.on.resume(GROUP, VERSION, "samplerpools", registry=registry)
    @kopf.on.create(GROUP, VERSION, "samplerpools", registry=registry)
    @kopf.on.update(GROUP, VERSION, "samplerpools", registry=registry)
    async def pool_changed(body: kopf.Body, retry: int, **_: Any) -> None:
        await guarded(rt, plain(body), reconcile_pool, retry)

    @kopf.on.event(GROUP, VERSION, "rlruns", registry=registry)
    async def run_event(body: kopf.Body, type: str | None, **_: Any) -> None:
        rt.observe(plain(body), deleted=type == "DELETED")

    @kopf.on.event(GROUP, VERSION, "samplerpools", registry=registry)
    async def pool_event(body: kopf.Body, type: str | None, **_: Any) -> None:
        # Indexed for the resync; and a pool's readiness is part of its run's status, while a
        # deleted pool that the run still declares is recreated by the run's reconcile.
        pool = plain(body)
        rt.observe(pool, deleted=type == "DELETED")
        owner = controller_of(pool)
        if owner is not None:
            rt.request(owner[0], body["metadata"]["namespace"], owner[1])

    async def child_event(body: kopf.Body, **_: Any) -> None:
        # Any event, deletions included: the owner's reconcile restores what differs.
        owner = controller_of(plain(body))
        if owner is not None:
            rt.request(owner[0], body["metadata"]["namespace"], owner[1])

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
