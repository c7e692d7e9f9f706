"""kopf handlers: when to reconcile, and how failures are retried.

- RLRun and SamplerPool: create, update and resume handlers reconcile the object.  An invalid
  spec is a ``kopf.PermanentError`` (InvalidSpec condition, one Warning event, no requeue);
  conflicts, throttling, server errors and lost connections are ``kopf.TemporaryError`` with an
  exponential backoff (``Retry-After`` honoured).
- Children (the run's Deployments and StatefulSets, the SamplerPools' status): an event handler
  reconciles the owner, so status follows readiness and a deleted child is recreated.
- No finalizers: deletion is the garbage collector's job through owner references, and no
  handler here needs one (kopf timers would add one; drift is caught by watching the children).
- kopf keeps its bookkeeping in ``mixrl.dev/*`` annotations, never in our status.
- The built-in autoscaler (:mod:`mixrl.operator.autoscaling_loop`) runs in the same operator, on
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
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from mixrl.api.models import GROUP, VERSION
from mixrl.operator import labels as L
from mixrl.operator.apply import StillTerminating
from mixrl.operator.autoscaling_loop import AutoscalingLoop, LoopSettings, register_autoscaling
from mixrl.operator.kube import ApiError, Connection, KubeClient
from mixrl.operator.peering import paused_by_peers
from mixrl.operator.rbac import RLRUNS, SAMPLERPOOLS, peering_resource
from mixrl.operator.reconcile import Context, Outcome, reconcile_pool, reconcile_run
from mixrl.operator.resources import BuildOptions, Images, Monitoring
from mixrl.operator.status import PROGRESSING, Reason, make_condition, merge_conditions

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
    login: LoginFn | None = None
    """How to reach the API server; default: in-cluster service account, then kubeconfig."""
    tune: Callable[[kopf.OperatorSettings], None] | None = None
    """Extra kopf settings (tests shorten timeouts)."""
    autoscaling: LoopSettings | None = field(default_factory=LoopSettings)
    """The built-in autoscaler's settings; None runs no built-in autoscaler (pools of ``builtin``
    runs then keep their replicas)."""
    keda: str = "auto"
    """``auto`` (ScaledObjects when keda.sh/v1alpha1 serves scaledobjects), ``on`` or ``off``."""


def backoff(retry: int, config: OperatorConfig, retry_after: float | None = None) -> float:
    """Exponential backoff for the ``retry``-th retry, at least what the server asked for."""
    delay = min(config.backoff_cap_s, config.backoff_base_s * 2 ** min(retry, 16))
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

    def context(self) -> Context:
        return Context(client=self.client, options=self.options, events=post_event)


def post_event(obj: Obj, kind: str, reason: str, message: str) -> None:
    # kopf.event, not kopf.info: the posting level filters only log-derived events, not ours.
    kopf.event(obj, type=kind, reason=reason, message=message)


async def report_failure(rt: Runtime, body: Obj, error: Exception) -> None:
    """Best effort: say on the run's Progressing condition why it is stuck (the API may be down)."""
    conditions = list((body.get("status") or {}).get("conditions") or [])
    generation = body["metadata"].get("generation")
    value = ("True", Reason.APPLY_FAILED, str(error)[:300])
    failed = make_condition(PROGRESSING, value, generation, rt.context().now(), conditions)
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
    except StillTerminating as exc:
        raise kopf.TemporaryError(str(exc), delay=backoff(retry, rt.config)) from exc
    if outcome.invalid is not None:
        post_event(body, "Warning", Reason.INVALID_SPEC, outcome.invalid)
        raise kopf.PermanentError(outcome.invalid)
    return outcome


async def coalesced(rt: Runtime, body: Obj, reconcile: Callable[[Context, Obj], Awaitable[Outcome]]) -> None:
    """Reconcile on behalf of a child's event; if one is already queued for this owner, it will see
    the latest state, so this one is dropped.  Errors are logged: the change handlers retry."""
    key = lock_key(body)
    if key in rt._queued:
        return
    rt._queued.add(key)
    try:
        await asyncio.sleep(rt.config.event_debounce_s)
        async with rt.lock(key):
            rt._queued.discard(key)
            fresh = await read_fresh(rt, body)
            if fresh is not None:
                await reconcile(rt.context(), fresh)
    except (ApiError, StillTerminating) as exc:
        log.warning("resync of %s failed: %s", key, exc)
    finally:
        rt._queued.discard(key)


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
        for plural in ("deployments", "statefulsets"):
            settings.watching.label_selectors[f"apps/{plural}"] = f"{L.MANAGED_BY}={L.MANAGER}"
        if config.tune is not None:
            config.tune(settings)

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
        if rt.autoscaler is not None:  # first: its last writes go through the shared client
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

    @kopf.on.event(GROUP, VERSION, "samplerpools", registry=registry)
    async def pool_event(body: kopf.Body, type: str | None, **_: Any) -> None:
        # A pool's readiness is part of its run's status.
        owner = controller_of(plain(body))
        if owner is not None and type != "DELETED":
            await reconcile_owner(rt, body["metadata"]["namespace"], *owner)

    @kopf.on.event("apps", "v1", "deployments", labels=managed, registry=registry)
    @kopf.on.event("apps", "v1", "statefulsets", labels=managed, registry=registry)
    async def workload_event(body: kopf.Body, **_: Any) -> None:
        owner = controller_of(plain(body))
        if owner is not None:
            await reconcile_owner(rt, body["metadata"]["namespace"], *owner)

    return registry, rt


async def reconcile_owner(rt: Runtime, namespace: str, kind: str, name: str) -> None:
    stub = {"kind": kind, "metadata": {"namespace": namespace, "name": name}}
    await coalesced(rt, stub, reconcile_run if kind == "RLRun" else reconcile_pool)
