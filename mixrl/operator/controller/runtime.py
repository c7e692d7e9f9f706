"""The operator's machinery between kopf and the reconcilers: one API client, per-object locks,
debounced and retried reconciles, the periodic resync, API discovery and kopf's peering.

No kopf here: :mod:`mixrl.operator.controller.handlers` (the kopf layer) calls in, and everything
below is called downward — the reconcilers (:mod:`mixrl.operator.controller.reconcile`), the API
client, discovery.  A reconcile's outcome says which events to post; this module posts them
through the sink it was given (kopf's), and turns a retryable failure into a retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from mixrl.api.kube_types import ConditionValue, Obj
from mixrl.operator.autoscaling.loop import AutoscalingLoop, LoopSettings
from mixrl.operator.builders.objects import Images
from mixrl.operator.controller.apply import ApplyFailed, StillTerminating
from mixrl.operator.controller.discovery import Discovery
from mixrl.operator.controller.observed_status import PROGRESSING, Reason
from mixrl.operator.controller.observer import ObserverSettings, StatusObserver
from mixrl.operator.controller.peering import paused_by_peers
from mixrl.operator.controller.reconcile import Context, Outcome, reconcile_pool, reconcile_run
from mixrl.operator.install.cluster_policy import OPEN, Policy
from mixrl.operator.kube.client import ApiError, Connection, KubeClient
from mixrl.operator.kube.conditions import make_condition, merge_conditions
from mixrl.operator.kube.rbac import BY_KIND, RLRUNS, SAMPLERPOOLS, peering_resource

EventSink = Callable[[Obj, str, str, str], None]
"""(object, type Normal|Warning, reason, message) -> posts a Kubernetes event."""

log = logging.getLogger("mixrl.operator")


class PeeringSettings(Protocol):
    """How kopf peers this operator (kopf's ``settings.peering``, read when it is needed)."""

    name: str
    clusterwide: bool
    priority: int
    standalone: bool
    mandatory: bool


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
    """At most this many of the resync's and a restart's reconciles run at once, so a resync of
    many runs does not flood the API server; and as many that child events asked for, in slots of
    their own, so a resync does not hold back what the events announced."""
    login: Callable[..., Any] | None = None
    """How to reach the API server (a kopf login handler, returning kopf's ConnectionInfo);
    default: in-cluster service account, then kubeconfig."""
    tune: Callable[[Any], None] | None = None
    """Extra kopf settings, given kopf's OperatorSettings at startup (tests shorten timeouts)."""
    autoscaling: LoopSettings | None = field(default_factory=LoopSettings)
    """The built-in autoscaler's settings; None runs no built-in autoscaler (pools of ``builtin``
    runs then keep their replicas)."""
    live_status: ObserverSettings | None = field(default_factory=ObserverSettings)
    """The live status loop's settings (mixrl.operator.controller.observer); None writes no figures,
    phase end or CollapseRisk (the reconcilers' conditions are written either way)."""
    keda: str = "auto"
    """``auto`` (ScaledObjects when keda.sh/v1alpha1 serves scaledobjects), ``on`` or ``off``."""
    policy: Policy = OPEN
    """What an RLRun may ask for (images, engine arguments, scheduling); a run asking for more is
    marked PolicyViolation and nothing of it is created."""
    default_queue: str | None = None
    """The Kueue LocalQueue of runs whose spec names none (None: those runs are not queued)."""
    workload_priority: bool = False
    """A queued run's Kueue Workloads at its pods' PriorityClass (``--kueue-workload-priority``)."""


def backoff(retry: int, config: OperatorConfig, retry_after: float | None = None) -> float:
    """Jittered exponential backoff for the ``retry``-th retry, at least what the server asked for:
    base × 2^retry, capped, then shortened by up to ``backoff_jitter`` of itself."""
    delay = min(config.backoff_cap_s, config.backoff_base_s * 2 ** min(retry, 16))
    delay *= 1.0 - config.backoff_jitter * config.uniform()
    return max(delay, retry_after or 0.0)


def retry_delay(error: Exception, retry: int, config: OperatorConfig) -> float:
    """How long a failed reconcile waits before its ``retry``-th retry: credentials, RBAC and
    quotas are fixed outside the operator, so those retry slowly (the cap); the rest back off."""
    if isinstance(error, ApplyFailed) and error.forbidden_only:
        return config.backoff_cap_s
    if isinstance(error, ApiError) and error.status in (401, 403):
        return config.backoff_cap_s
    return backoff(retry, config, getattr(error, "retry_after", None))


class Runtime:
    """Per-operator state: the API client and the connection kopf logged in with, API discovery,
    per-object locks, the queue of debounced reconciles; ``post_event`` is kopf's event sink."""

    def __init__(self, config: OperatorConfig, post_event: EventSink):
        self.config = config
        self.post_event = post_event
        self.connection: Connection | None = None
        self.client = KubeClient(self._current_connection)
        self.discovery = Discovery(
            self.client,
            config.images,
            monitoring_mode=config.monitoring,
            keda_mode=config.keda,
            drain_seconds=config.drain_seconds,
            ttl_s=config.discovery_ttl_s,
            builtin_autoscaler=config.autoscaling is not None,
        )
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._queued: set[str] = set()
        self._fresh: set[str] = set()
        """Owners whose next reconcile reads from the API server (asked for by a restart)."""
        self._background: set[str] = set()
        """Owners whose next reconcile the resync asked for (it takes the slots of its own)."""
        self._wake: dict[str, asyncio.Event] = {}
        """Per owner whose failed reconcile waits for its retry: set by a new request for it."""
        self.known: dict[str, tuple[str, str, str]] = {}
        """lock key -> (kind, namespace, name) of every RLRun and SamplerPool kopf's watches have
        shown (an index the resync walks: it costs no API call of its own)."""
        self.started = datetime.now(UTC).replace(microsecond=0)
        self._created_while_watched: set[str] = set()
        """lock keys of the RLRuns and SamplerPools created while this operator's watches ran:
        first shown by a running watch (not kopf's first listing) and created after the operator
        started.  Their children were all made while the watches ran, so one the watches never
        showed does not exist (``Context.unseen_children_absent``).  Not "an ADDED event": kopf
        hands a handler only the last of the events that arrive together, so a busy operator sees
        a new pool's creation and its first status write as one MODIFIED event."""
        self._acted_on: dict[str, tuple[Any, ...]] = {}
        """lock key -> what a reconcile of that RLRun or SamplerPool acts on, as its last event
        showed it (:meth:`observe`)."""
        self._warned: dict[str, tuple[Any, ...]] = {}
        """lock key -> the (generation, reason, message) of the last InvalidSpec or PolicyViolation
        Warning posted for that object: a resync that finds the same refusal says nothing new."""
        self.reconciled: Counter[str] = Counter()
        """lock key -> reconciles run (for logs and tests)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots: dict[bool, asyncio.Semaphore] = {}
        """Concurrency slots: those of the resync's and a restart's reconciles (True), and those of
        the ones child events asked for (False)."""
        self._resync: asyncio.Task[None] | None = None
        self.autoscaler: AutoscalingLoop | None = None
        self.observer: StatusObserver | None = None
        self.peering: PeeringSettings | None = None
        """kopf's peering settings once it started (the peering name, scope and priority it runs with)."""

    def _current_connection(self) -> Connection:
        if self.connection is None:
            raise ApiError(0, "NotLoggedIn", "no API credentials yet")
        return self.connection

    def lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def active_in(self, namespace: str) -> bool:
        """Whether kopf's peering lets this operator act in ``namespace`` (for the autoscaler, which
        is not a kopf handler and is not paused by kopf)."""
        settings = self.peering
        if settings is None or settings.standalone:
            return True
        peering = await self.client.get(peering_resource(settings.clusterwide), namespace, settings.name)
        if peering is None:  # kopf runs standalone when optional peering finds no object
            return not settings.mandatory
        status = peering.get("status") or {}
        return not paused_by_peers(status, settings.priority, datetime.now(UTC))

    def context(self, cached_reads: bool = False, unseen_children_absent: bool = False) -> Context:
        return Context(
            client=self.client,
            discovery=self.discovery,
            policy=self.config.policy,
            default_queue=self.config.default_queue,
            workload_priority=self.config.workload_priority,
            cached_reads=cached_reads,
            unseen_children_absent=cached_reads and unseen_children_absent,
        )

    async def reconcile(self, body: Obj, cached_reads: bool = False) -> Outcome:
        """Reconcile one RLRun or SamplerPool (the caller holds its lock) and post the events its
        outcome names; :class:`ApplyFailed` when some children failed in a way a retry can fix (the
        status already says which): the caller retries the whole reconcile with backoff."""
        key = lock_key(body)
        self.reconciled[key] += 1
        ctx = self.context(cached_reads, key in self._created_while_watched)
        if body.get("kind") == "RLRun":
            outcome = await reconcile_run(ctx, body)
        else:
            outcome = await reconcile_pool(ctx, body)
        for kind, reason, message in outcome.events:
            self.post_event(body, kind, reason, message)
        self._warn_once(body, outcome)
        if outcome.report.retryable:
            raise ApplyFailed(outcome.report.retryable)
        return outcome

    def _warn_once(self, body: Obj, outcome: Outcome) -> None:
        """One Warning per invalid or refused spec (per generation and message), not one per
        reconcile: a refused run is reconciled again by every resync and child event."""
        key = lock_key(body)
        if outcome.invalid is None and outcome.refused is None:
            self._warned.pop(key, None)
            return
        reason = Reason.INVALID_SPEC if outcome.invalid is not None else Reason.POLICY_VIOLATION
        message = outcome.invalid if outcome.invalid is not None else outcome.refused
        said = (body["metadata"].get("generation"), reason, message)
        if self._warned.get(key) != said:
            self._warned[key] = said
            self.post_event(body, "Warning", reason, message or "")

    # ------------------------------------------------------------------ event- and resync-driven work

    def seen(self, body: Obj, deleted: bool) -> None:
        """A watch event of anything the operator watches: kept for the reconciles events ask for."""
        resource = BY_KIND.get((body.get("apiVersion", ""), body.get("kind", "")))
        if resource is not None:
            if deleted:
                self.client.cache.deleted(resource, body)
            else:
                self.client.cache.store(resource, body)

    def observe(self, body: Obj, deleted: bool, listed: bool = False) -> bool:
        """A watch event of an RLRun or a SamplerPool (``listed``: from kopf's first listing):
        indexed for the resync, and kept.  Returns whether what the object's own reconcile acts on
        changed since its last event — its spec (the generation), labels or annotations; not its
        status, which its reconciles write."""
        self.seen(body, deleted)
        key = lock_key(body)
        if deleted:
            self.known.pop(key, None)
            self._acted_on.pop(key, None)
            self._warned.pop(key, None)
            self._created_while_watched.discard(key)
            return False
        meta = body["metadata"]
        if key not in self.known and not listed and created_after(meta, self.started):
            self._created_while_watched.add(key)
        self.known[key] = (body["kind"], meta["namespace"], meta["name"])
        acted_on = (meta.get("uid"), meta.get("generation"), meta.get("labels"), meta.get("annotations"))
        if self._acted_on.get(key) == acted_on:
            return False
        self._acted_on[key] = acted_on
        return True

    def request(
        self,
        kind: str,
        namespace: str,
        name: str,
        fresh: bool = False,
        debounce: bool = True,
        limited: bool = True,
        background: bool = False,
    ) -> None:
        """Reconcile an RLRun or SamplerPool soon, in a task of its own; nothing when one is
        already queued for it, since that one will see the latest state.  ``fresh``: it reads from
        the API server, not from what the watches showed (a restart's reconciles).
        ``debounce``: it waits ``event_debounce_s`` first, so a burst of child events costs one
        reconcile; a change of the object itself does not wait.  ``limited``: it takes one of the
        ``reconcile_concurrency`` slots (child events; the resync's, ``background``, and a
        restart's in slots of their own, :meth:`slots`); a change of the object
        itself does not queue behind them (50 new runs' 400 new pools waited tens of seconds there
        for their Deployments: bench/cluster_scale.py)."""
        stub = {"kind": kind, "metadata": {"namespace": namespace, "name": name}}
        key = lock_key(stub)
        if fresh:
            self._fresh.add(key)
        if background:
            self._background.add(key)
        if key in self._queued:
            # One is queued.  If it is a retry waiting out its backoff, something changed since it
            # failed (the old StatefulSet of a recreation is finally gone): try again now.
            wake = self._wake.get(key)
            if wake is not None:
                wake.set()
            return
        self.spawn(coalesced(self, stub, self.config.event_debounce_s if debounce else 0.0, limited))

    def spawn(self, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def slots(self, background: bool) -> asyncio.Semaphore:
        """The slots of the resync's and a restart's reconciles (``background``), or of those child
        events asked for."""
        if background not in self._slots:
            self._slots[background] = asyncio.Semaphore(max(1, self.config.reconcile_concurrency))
        return self._slots[background]

    async def resync_once(self) -> int:
        """Where this operator is the active peer: refresh what the watches showed from one list
        per watched kind and namespace (so what no event announced — a missed event, a change
        while the operator was down — is seen), then ask for a reconcile of every RLRun and
        SamplerPool there, each reading from that; returns how many were asked for.

        A list per kind, not a read per child: at 50 runs, one resync was 3,650 reads, and those
        arriving while runs start took the CPU their pools' status waited for."""
        active: dict[str, bool] = {}
        # A copy: kopf's handlers add runs and pools to ``known`` while this awaits the peering.
        for _, namespace, _ in list(self.known.values()):
            if namespace in active:
                continue
            # One namespace's failed read (a 429, its peering object gone) skips that namespace only.
            active[namespace] = False
            try:
                if await self.active_in(namespace):
                    await self.refresh(namespace)
                    active[namespace] = True
            except ApiError as exc:
                log.warning("resync of namespace %s failed: %s", namespace, exc)
        asked = 0
        for kind, namespace, name in sorted(self.known.values()):
            if active.get(namespace):
                self.request(kind, namespace, name, background=True)
                asked += 1
        return asked

    async def refresh(self, namespace: str) -> None:
        """List every watched kind in ``namespace`` into the cache; runs and pools the lists show
        are indexed for the resync, and those they no longer show are dropped from it."""
        for resource, labels in self.client.cache.watched():
            try:
                items, version = await self.client.list_as_of(resource, namespace, labels)
            except ApiError as exc:
                if exc.status == 404:  # a kind this cluster does not serve (kopf watches nothing)
                    continue
                raise
            self.client.cache.replace(resource, namespace, items, version)
            if resource in (RLRUNS, SAMPLERPOOLS):
                listed = {item["metadata"]["name"] for item in items}
                for key, (kind, ns, name) in list(self.known.items()):
                    if kind == resource.kind and ns == namespace and name not in listed:
                        self.known.pop(key, None)
                for name in listed:
                    stub = {"kind": resource.kind, "metadata": {"namespace": namespace, "name": name}}
                    self.known.setdefault(lock_key(stub), (resource.kind, namespace, name))

    async def resync_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                asked = await self.resync_once()
            except Exception:  # as the operator's other loops: one failed resync must not end them
                log.exception("resync failed; the next in %s s", interval)
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


async def report_failure(rt: Runtime, body: Obj, error: Exception) -> None:
    """Best effort: say on the run's Progressing condition why it is stuck (the API may be down);
    no write when the condition already says so."""
    conditions = list((body.get("status") or {}).get("conditions") or [])
    generation = body["metadata"].get("generation")
    value: ConditionValue = ("True", Reason.APPLY_FAILED, str(error)[:300])
    failed = make_condition(PROGRESSING, value, generation, rt.context().now(), conditions)
    before = next((c for c in conditions if c.get("type") == PROGRESSING), None)
    if before is not None and {k: before.get(k) for k in failed} == failed:
        return
    meta = body["metadata"]
    patch = {"status": {"conditions": merge_conditions(conditions, [failed])}}
    with contextlib.suppress(ApiError):
        await rt.client.merge_patch(RLRUNS, meta["namespace"], meta["name"], patch, subresource="status")


def created_after(meta: Obj, moment: datetime) -> bool:
    """Whether the object's ``creationTimestamp`` (whole seconds, the API server's clock) is not
    before ``moment`` (whole seconds); not when it has none."""
    stamp = meta.get("creationTimestamp")
    if not isinstance(stamp, str):
        return False
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")) >= moment
    except ValueError:
        return False


def lock_key(body: Obj) -> str:
    meta = body["metadata"]
    return f"{body.get('kind')}/{meta['namespace']}/{meta['name']}"


async def read_fresh(rt: Runtime, body: Obj, cached: bool = False) -> Obj | None:
    """The object as the API server has it now, or None when it is gone (or was replaced);
    ``cached``: the newest the operator knows of it (its last watch event or the answer to its
    own last write, whichever is newer: :mod:`mixrl.operator.kube.cache`), for the reconciles
    events ask for — the event that announces a newer one asks for another.

    Never the body of the event that asked: kopf hands a handler the event it is processing,
    which can be older than the object (a pool scaled twice in a row); acting on it would write
    stale replicas back."""
    meta = body["metadata"]
    resource = RLRUNS if body.get("kind") == "RLRun" else SAMPLERPOOLS
    fresh = await rt.client.get(resource, meta["namespace"], meta["name"], cached=cached)
    if fresh is None or ("uid" in meta and fresh["metadata"].get("uid") != meta["uid"]):
        return None
    return fresh


RETRIED = (ApiError, StillTerminating, ApplyFailed)


async def coalesced(rt: Runtime, body: Obj, delay: float, limited: bool = True) -> None:
    """Reconcile an RLRun or SamplerPool after ``delay`` seconds (in one of the concurrency slots
    when ``limited``); if one is already queued for it, that one will see the latest state, so this
    one is dropped.

    A failed reconcile is retried with jittered exponential backoff (slowly where only something
    outside the operator can fix it: :func:`retry_delay`) until it succeeds, the object is gone or
    another peer took over; a new request for it while a retry waits ends the wait (after the
    usual debounce), since what failed may have changed.  An API error on a run is said on its
    Progressing condition first (best effort)."""
    key = lock_key(body)
    if key in rt._queued:
        return
    rt._queued.add(key)
    queued = True  # the marker in rt._queued is ours to remove
    attempt = 0
    try:
        while True:
            await asyncio.sleep(delay)
            if attempt and not await rt.active_in(body["metadata"]["namespace"]):
                return
            behind = key in rt._fresh or key in rt._background
            slots = rt.slots(background=behind) if limited else contextlib.nullcontext()
            async with slots, rt.lock(key):
                rt._queued.discard(key)
                rt._background.discard(key)
                queued = False
                cached_reads = key not in rt._fresh
                rt._fresh.discard(key)
                fresh: Obj | None = None
                try:
                    fresh = await read_fresh(rt, body, cached_reads)
                    if fresh is not None:
                        await rt.reconcile(fresh, cached_reads)
                    return
                except RETRIED as exc:
                    error: Exception = exc
                    if isinstance(exc, ApiError) and fresh is not None and fresh.get("kind") == "RLRun":
                        await report_failure(rt, fresh, exc)
            if key in rt._queued:
                return
            wait = retry_delay(error, attempt, rt.config)
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
