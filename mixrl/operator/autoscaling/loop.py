"""The built-in autoscaler: Prometheus → policy → each SamplerPool's scale subresource.

Three separable steps, so each is tested on its own:

1. ``query_prometheus`` (in :mod:`mixrl.operator.autoscaling.pool_api`) — one instant query against
   ``/api/v1/query``; a failure is a ``MetricsUnavailable`` with a CamelCase reason
   (``PrometheusUnreachable``, ``QueryFailed``, ``NoSeries``).
2. :func:`plan_pool` — pure: the pool's body, its run, what Prometheus said and the pool's
   memory → a :class:`PoolPlan`: the replica count to write (or none), the status patch
   (``lastScaleDecisions``, the MetricsAvailable and WrongGpuType conditions) and the event.
3. ``PoolApi`` (same module as 1) — the writes: ``PATCH …/samplerpools/NAME/scale``,
   ``PATCH …/status``, ``POST …/events``, and for ``objective: trainer`` the run's
   ``PATCH …/rlruns/NAME/status`` (``recommendedConcurrency``, :func:`concurrency_status`), through
   the operator's RBAC-checked API client.

No kopf here.  The kopf layer (:func:`mixrl.operator.controller.handlers.register_autoscaling`)
feeds :class:`AutoscalingLoop` the latest RLRuns and SamplerPools from its watch events, starts it
at operator startup and stops it at cleanup; no kopf timer or daemon, since those put a finalizer
on every SamplerPool and the operator keeps its objects finalizer-free.  One task visits every
pool of a run whose ``autoscaling.engine`` is ``builtin`` each tick, acting when its poll interval
has passed.  Pools of ``keda`` runs are KEDA's (the pool's controller applies their
ScaledObjects), pools of ``none`` runs are left alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from mixrl.api.gpus import price_per_gpu_hour
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedPool, ResolvedRun, resolve
from mixrl.operator.autoscaling.gpu_check import WRONG_GPU_TYPE, wrong_gpu_condition
from mixrl.operator.autoscaling.objective import (
    FleetPlan,
    FleetPool,
    ObjectiveConfig,
    ObjectiveMemory,
    TrainerSignals,
    stabilized_plan,
)
from mixrl.operator.autoscaling.policy import (
    BudgetRequest,
    Decision,
    PolicyConfig,
    PolicyState,
    PoolLoad,
    budget_step,
    decide,
    fleet_pending,
)
from mixrl.operator.autoscaling.pool_api import (
    MetricsUnavailable,
    Observation,
    PoolApi,
    observe,
    query_label_values,
    query_prometheus,
)
from mixrl.operator.autoscaling.promql import (
    SUSTAINED_STEP,
    SUSTAINED_WINDOW,
    TRAINER_WINDOW,
    gpu_models_query,
    load_query,
    paused_query,
    pool_busy_query,
    pool_rate_per_replica_query,
    trainer_queries,
)
from mixrl.operator.kube.client import ApiError, KubeClient
from mixrl.operator.kube.conditions import make_condition
from mixrl.operator.kube.events import rfc3339
from mixrl.operator.kube.rbac import SAMPLERPOOLS
from mixrl.operator.kube.ticker import Ticker

Obj = dict[str, Any]
Key = tuple[str, str]
log = logging.getLogger("mixrl.operator.autoscaling")

METRICS_AVAILABLE = "MetricsAvailable"
"""A SamplerPool condition this loop owns (Prometheus answered, or why not)."""
UPDATING_WEIGHTS = "UpdatingWeights"
"""A SamplerPool condition whoever syncs weights sets True while engines load a new version."""
BACKLOG_HORIZON_S = 300.0
"""The shortest time ``objective: trainer`` closes the backlog's distance from its band over."""
SCALED_REASON = "Scaled"
METRICS_REASON = "MetricsUnavailable"


# ----------------------------------------------------------------------------- the plan (pure)


@dataclass
class PoolMemory:
    """What the loop remembers of one pool between polls; the scale-down window is also written to
    the pool's ``status.autoscalerWindow`` and read back by a restarted operator."""

    state: PolicyState = field(default_factory=PolicyState)
    last_poll: float | None = None
    refused: str | None = None
    """The last bounds problem reported (one Warning event per problem, not one per poll)."""


def window_status(state: PolicyState, now: float, window_s: float) -> list[Obj]:
    """The part of the window that can still bound a scale-down: per kind, each entry not exceeded
    by a later one (a sliding maximum needs no more), for ``status.autoscalerWindow``."""
    out: list[Obj] = []
    for kind, entries in (("pool", state.recommendations), ("fleet", state.targets)):
        kept: list[tuple[float, int]] = []
        for t, r in entries:
            if t <= now - window_s:
                continue
            while kept and kept[-1][1] <= r:
                kept.pop()
            kept.append((t, r))
        out += [{"time": t, "replicas": r, "kind": kind} for t, r in kept]
    return out


def restored_state(pool_body: Obj, now: float, window_s: float) -> PolicyState:
    """The policy state of a pool this operator has no memory of: the window from the pool's
    status, or — a pool that never had one — its current replicas as a recommendation made now,
    so a restart never drops a pool below its replicas before a full window has passed."""
    status = pool_body.get("status") or {}
    entries = [e for e in status.get("autoscalerWindow") or [] if float(e.get("time", 0)) > now - window_s]
    pool = tuple((float(e["time"]), int(e["replicas"])) for e in entries if e.get("kind", "pool") == "pool")
    fleet = tuple((float(e["time"]), int(e["replicas"])) for e in entries if e.get("kind") == "fleet")
    if pool or fleet:
        return PolicyState(recommendations=pool, targets=fleet)
    return PolicyState.seeded(now, int((pool_body.get("spec") or {}).get("replicas") or 0))


@dataclass(frozen=True)
class PoolPlan:
    decision: Decision
    replicas: int | None
    """The replica count to write through the scale subresource; None = leave it."""
    status_patch: Obj
    """A merge patch for the status subresource (empty: nothing changed)."""
    event: tuple[str, str, str] | None
    """(type, reason, message) of the event to post, if any."""


def pool_of(run: ResolvedRun, pool_body: Obj) -> ResolvedPool:
    return run.pool(pool_body["spec"]["pool"])


def load_of(pool_body: Obj, observation: Observation, paused: float | None = None) -> PoolLoad:
    """The policy's view of one pool.  ``paused``: requests its engines hold paused (the weight
    update, :func:`mixrl.operator.autoscaling.promql.paused_query`); an ``UpdatingWeights``
    condition set by hand counts too."""
    spec, status = pool_body.get("spec") or {}, pool_body.get("status") or {}
    replicas = int(spec.get("replicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    conditions = status.get("conditions") or []
    updating = any(c.get("type") == UPDATING_WEIGHTS and c.get("status") == "True" for c in conditions)
    updating = updating or (paused or 0) > 0
    return PoolLoad(
        load=observation.load,
        sustained=observation.sustained,
        replicas=replicas,
        ready=min(ready, replicas) if replicas else ready,
        # Every requested replica that is not ready is on its way (pending, pulling, loading).
        starting=max(replicas - ready, 0),
        updating_weights=updating,
    )


RECOMMENDED_CONCURRENCY = "recommendedConcurrency"
"""The RLRun status field ``objective: trainer`` reports the concurrency in (mixrl.api.status.ConcurrencyRecommendation)."""


def concurrency_status(
    previous: Obj | None, plan: FleetPlan, configured: int, now: float, tolerance: float
) -> tuple[bool, Obj | None]:
    """Whether to write ``status.recommendedConcurrency`` and its new value (None: clear it).

    Set when the fill found the concurrency short; cleared only when a fill found it enough (a
    hold or a plan inside the dead band learns nothing about it); rewritten when the sessions
    figure moves by more than ``tolerance`` of it or the configured concurrency changed, so the
    estimate's wobble from poll to poll does not write the run every poll."""
    wanted = plan.recommended_concurrency
    if wanted is None:
        return (previous is not None and plan.filled), None
    if (
        previous is not None
        and previous.get("configured") == configured
        and abs(wanted - int(previous.get("sessions") or 0)) <= tolerance * wanted
    ):
        return False, previous
    value = {
        "sessions": wanted,
        "configured": configured,
        "time": rfc3339(now),
        "message": plan.summary[:500],
    }
    return True, value


class BoundsRefused(ValueError):
    """The SamplerPool's own bounds contradict each other: the loop does not scale it."""


def config_of(run: ResolvedRun, pool: ResolvedPool, pool_body: Obj) -> PolicyConfig:
    """The pool's policy; the SamplerPool's own bounds win (``kubectl edit`` may have changed them).
    Bounds that contradict each other are refused, never repaired: the CRD's CEL rule refuses them
    at admission, and a pool that got past it (an older CRD) is left alone with one Warning."""
    spec = pool_body.get("spec") or {}
    low = int(spec.get("minReplicas", pool.min_replicas))
    high = int(spec.get("maxReplicas", pool.max_replicas))
    if high < low:
        raise BoundsRefused(
            f"spec.maxReplicas: {high} is below spec.minReplicas {low}; not scaling this pool"
        )
    return PolicyConfig.from_spec(run.autoscaling, pool, min_replicas=low, max_replicas=high)


def metrics_condition(
    previous: list[Obj], observation: Observation, generation: int | None, now: float
) -> Obj:
    if observation.problem is None:
        status, reason, message = "True", "QueryReturned", f"load {observation.load:g}"
    else:
        status, reason, message = "False", observation.problem.reason, observation.problem.message
    return make_condition(
        METRICS_AVAILABLE, (status, reason, message[:300]), generation, rfc3339(now), previous
    )


def plan_pool(
    pool_body: Obj,
    run: ResolvedRun,
    observation: Observation,
    memory: PoolMemory,
    now: float,
    *,
    history: int = 10,
    decision: Decision | None = None,
    gpu_models: set[str] | None = None,
    window: list[Obj] | None = None,
) -> PoolPlan:
    """One poll of one pool, without I/O.  ``decision`` overrides the policy (the GPU budget);
    ``gpu_models`` are the GPU models the pool's pods report (None: unknown); ``window`` is the
    scale-down window to persist (:func:`window_status`; written when it changed)."""
    pool = pool_of(run, pool_body)
    load = load_of(pool_body, observation)
    if decision is None:
        decision = decide(load, memory.state, config_of(run, pool, pool_body), now)
    status = pool_body.get("status") or {}
    generation = (pool_body.get("metadata") or {}).get("generation")
    conditions = list(status.get("conditions") or [])
    condition = metrics_condition(conditions, observation, generation, now)
    old = next((c for c in conditions if c.get("type") == METRICS_AVAILABLE), None)
    patch: Obj = {}
    if old is None or any(old.get(k) != condition[k] for k in ("status", "reason")):
        others = [c for c in conditions if c.get("type") != METRICS_AVAILABLE]
        patch["conditions"] = [*others, condition]
    event = None
    wrong_gpu = wrong_gpu_condition(gpu_models or (), pool.gpu_products, conditions, generation, rfc3339(now))
    if wrong_gpu is not None:
        before = next((c for c in conditions if c.get("type") == WRONG_GPU_TYPE), None)
        if before is None or any(before.get(k) != wrong_gpu[k] for k in ("status", "reason", "message")):
            current = patch.get("conditions", conditions)
            patch["conditions"] = [*(c for c in current if c.get("type") != WRONG_GPU_TYPE), wrong_gpu]
            if wrong_gpu["status"] == "True":
                event = ("Warning", WRONG_GPU_TYPE, wrong_gpu["message"])
    if window is not None and window != status.get("autoscalerWindow"):
        patch["autoscalerWindow"] = window
    replicas = None
    if decision.changed:
        replicas = decision.desired
        record = {
            "time": rfc3339(now),
            "fromReplicas": decision.current,
            "toReplicas": decision.desired,
            "reason": decision.reason[:300],
        }
        if observation.load is not None:
            record["load"] = observation.load
        patch["lastScaleDecisions"] = [*(status.get("lastScaleDecisions") or []), record][-history:]
        event = ("Normal", SCALED_REASON, decision.reason[:1000])
    elif observation.problem is not None and (old is None or old.get("status") != "False"):
        event = (
            "Warning",
            METRICS_REASON,
            f"{observation.problem.reason}: {observation.problem.message}"[:1000],
        )
    return PoolPlan(decision, replicas, {"status": patch} if patch else {}, event)


# ----------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class LoopSettings:
    tick_s: float = 5.0
    """How often the loop looks at every pool; each acts when its run's poll interval has passed."""
    scale_via: Literal["subresource", "object"] = "subresource"
    history: int = 10
    """Scaling decisions kept in ``status.lastScaleDecisions``."""
    query_timeout_s: float = 10.0
    check_gpu_models: bool = True
    """Also ask Prometheus which GPU models DCGM sees under each pool (the WrongGpuType condition)."""
    sustained_window: tuple[str, str] = (SUSTAINED_WINDOW, SUSTAINED_STEP)
    """Window and step of the confirming ``avg_over_time`` subquery."""


PoolLock = Callable[[str, str], asyncio.Lock]
Gate = Callable[[str], Awaitable[bool]]
Observer = Callable[[aiohttp.ClientSession, str, str, float, tuple[str, str]], Awaitable[Observation]]
Scalar = Callable[[aiohttp.ClientSession, str, str, float], Awaitable[float]]
"""One instant query that returns one number (:func:`query_prometheus`)."""


class AutoscalingLoop(Ticker):
    """Keeps the latest RLRuns and SamplerPools (fed by watch events) and scales the pools."""

    tick_name = "mixrl-autoscaler"

    def __init__(
        self,
        client: KubeClient,
        settings: LoopSettings | None = None,
        clock: Callable[[], float] = time.time,
        observer: Observer = observe,
        owns_client: bool = False,
        lock: PoolLock | None = None,
        may_act: Gate | None = None,
        scalar: Scalar = query_prometheus,
    ):
        self.settings = settings or LoopSettings()
        super().__init__(self.settings.tick_s, log)
        self.client = client
        self.owns_client = owns_client
        """Close the client at :meth:`stop` (False when it is the operator's shared client)."""
        self._locks: dict[Key, asyncio.Lock] = {}
        self.lock: PoolLock = lock or self._own_lock
        """(namespace, name) -> the lock held while reading the live pool and writing it: the
        operator's per-object lock, shared with the pool's controller."""
        self.may_act = may_act
        """namespace -> whether this operator may scale pools there now (False while kopf's peering
        has paused it); None: always."""
        self._paused: set[str] = set()
        self.clock = clock
        self.observer = observer
        self.scalar = scalar
        self.runs: dict[Key, Obj] = {}
        self.pools: dict[Key, Obj] = {}
        self.memory: dict[Key, PoolMemory] = {}
        self._budget: dict[Key, dict[str, BudgetRequest]] = {}
        self.run_memory: dict[Key, ObjectiveMemory] = {}
        """(namespace, run) -> the trainer objective's estimates (``objective: trainer`` runs)."""
        self._run_polled: dict[Key, float] = {}
        self._fleet_said: dict[Key, str] = {}

    def _own_lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    # -- watch events
    def observe_run(self, body: Mapping[str, Any], deleted: bool) -> None:
        meta = body["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        if deleted:
            self.runs.pop(key, None)
            self.run_memory.pop(key, None)
            self._run_polled.pop(key, None)
        else:
            self.runs[key] = dict(body)

    def observe_pool(self, body: Mapping[str, Any], deleted: bool) -> None:
        meta = body["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        if deleted:
            self.pools.pop(key, None)
            self.memory.pop(key, None)
            self._locks.pop(key, None)
        else:
            self.pools[key] = dict(body)

    # -- lifecycle (start, the tick loop and the HTTP session: Ticker)
    async def stop(self) -> None:
        await super().stop()
        if self.owns_client:
            await self.client.close()

    # -- one tick
    def resolved_run(self, pool_body: Obj) -> ResolvedRun | None:
        namespace = pool_body["metadata"].get("namespace") or "default"
        run_body = self.runs.get((namespace, (pool_body.get("spec") or {}).get("run", "")))
        if run_body is None or (run_body.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return None  # an ended run's pools stay at zero (mixrl.operator.builders.resources.released)
        try:
            return resolve(
                RLRun.model_validate({k: run_body[k] for k in ("apiVersion", "kind", "metadata", "spec")})
            )
        except (ValueError, KeyError):
            return None  # the run's own controller reports an invalid spec

    async def active_in(self, namespace: str, verdicts: dict[str, bool]) -> bool:
        """Whether to act in ``namespace`` this tick (asked once per tick and namespace)."""
        if self.may_act is None:
            return True
        if namespace not in verdicts:
            try:
                verdicts[namespace] = await self.may_act(namespace)
            except ApiError as exc:  # unsure whether we are the active operator: do not scale
                log.warning("autoscaling in %s skipped: peering unknown (%s)", namespace, exc)
                verdicts[namespace] = False
            allowed, was_paused = verdicts[namespace], namespace in self._paused
            if allowed and was_paused:
                self._paused.discard(namespace)
                log.info("autoscaling in %s resumed", namespace)
            elif not allowed and not was_paused:
                self._paused.add(namespace)
                log.info("autoscaling in %s paused: another operator is active (kopf peering)", namespace)
        return verdicts[namespace]

    async def tick(self) -> list[tuple[Key, PoolPlan]]:
        """Poll every due pool once; returns what was done (for tests and logs)."""
        done = []
        verdicts: dict[str, bool] = {}
        fleets: dict[Key, tuple[ResolvedRun, list[Key]]] = {}
        for key, body in list(self.pools.items()):
            run = self.resolved_run(body)
            if run is None or run.autoscaling.engine != "builtin":
                continue
            if run.autoscaling.objective == "trainer":  # the run's fleet is planned as one
                fleets.setdefault((key[0], run.name), (run, []))[1].append(key)
                continue
            memory = self.memory.setdefault(key, PoolMemory())
            now = self.clock()
            if (
                memory.last_poll is not None
                and now - memory.last_poll < run.autoscaling.poll_interval_seconds
            ):
                continue
            try:
                pool = pool_of(run, body)
            except KeyError:
                continue  # the run no longer declares this pool; its controller deletes it
            if not await self.active_in(key[0], verdicts):
                continue
            try:
                plan = await self.poll(key, body, run, pool, memory, now)
            except ApiError as exc:  # this pool's write failed; the others still get their turn
                log.warning("autoscaling %s/%s: %s", *key, exc)
                continue
            if plan is not None:
                done.append((key, plan))
        for run_key, (run, keys) in fleets.items():
            now = self.clock()
            last = self._run_polled.get(run_key)
            if last is not None and now - last < run.autoscaling.poll_interval_seconds:
                continue
            if not await self.active_in(run_key[0], verdicts):
                continue
            self._run_polled[run_key] = now
            try:
                done += await self.poll_fleet(run_key, run, keys, now)
            except ApiError as exc:
                log.warning("autoscaling run %s/%s: %s", *run_key, exc)
        await self.clear_stale_concurrency(fleets, verdicts)
        return done

    async def clear_stale_concurrency(self, fleets: Mapping[Key, Any], verdicts: dict[str, bool]) -> None:
        """A run that left ``objective: trainer`` (or the built-in engine) keeps no recommendation
        nobody updates any more."""
        for run_key, body in list(self.runs.items()):
            if run_key in fleets or RECOMMENDED_CONCURRENCY not in (body.get("status") or {}):
                continue
            if (body.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue  # an ended run keeps what it was told last
            autoscaling = (body.get("spec") or {}).get("autoscaling") or {}
            if (
                autoscaling.get("objective") == "trainer"
                and autoscaling.get("engine", "builtin") == "builtin"
            ):
                continue  # planned on another tick (its pools not seen yet, or not due)
            if not await self.active_in(run_key[0], verdicts):
                continue
            try:
                await PoolApi(self.client).patch_run_status(*run_key, {RECOMMENDED_CONCURRENCY: None})
            except ApiError as exc:
                log.warning("autoscaling run %s/%s: %s", *run_key, exc)
                continue
            status = {k: v for k, v in (body.get("status") or {}).items() if k != RECOMMENDED_CONCURRENCY}
            self.runs[run_key] = {**body, "status": status}

    async def _value(self, run: ResolvedRun, query: str) -> float | None:
        """One number from Prometheus, or None (no series, or no answer: the objective holds)."""
        try:
            return await self.scalar(
                self.session(), run.autoscaling.prometheus_url, query, self.settings.query_timeout_s
            )
        except MetricsUnavailable:
            return None

    async def poll_fleet(
        self, run_key: Key, run: ResolvedRun, keys: list[Key], now: float
    ) -> list[tuple[Key, PoolPlan]]:
        """``objective: trainer``: read the run's and every pool's series, plan the fleet as one
        (:func:`mixrl.operator.autoscaling.objective.stabilized_plan`), then write each pool
        under its lock, from the live pool (a pool whose replicas moved meanwhile waits a poll)."""
        a = run.autoscaling
        url, timeout = a.prometheus_url, self.settings.query_timeout_s
        queries = trainer_queries(run.namespace, run.name)
        signals = TrainerSignals(**{name: await self._value(run, q) for name, q in queries.items()})
        views: list[FleetPool] = []
        seen: dict[str, tuple[Key, Obj, Observation, ResolvedPool]] = {}
        for key in keys:
            cached = self.pools.get(key)
            body = None if cached is None else await self.live_pool(key, cached)
            if body is None:
                continue
            try:
                pool = pool_of(run, body)
                config = config_of(run, pool, body)
            except KeyError:
                continue
            except BoundsRefused as exc:
                memory = self.memory.setdefault(key, PoolMemory())
                if memory.refused != str(exc):
                    memory.refused = str(exc)
                    await PoolApi(self.client).post_event(body, "Warning", "BoundsRefused", str(exc), now)
                continue
            memory = self.memory.setdefault(key, PoolMemory())
            if memory.last_poll is None:
                memory.state = restored_state(body, now, a.scale_down_window_seconds)
            memory.refused = None
            replicas = int((body.get("spec") or {}).get("replicas") or 0)
            window = (TRAINER_WINDOW, "15s")
            observation = (
                await self.observer(self.session(), url, load_query(a, run, pool), timeout, window)
            ).asleep(replicas)
            paused = await self._value(run, paused_query(run.namespace, pool.object_name))
            load = load_of(body, observation, paused)
            memory.state, stuck, ceiling = fleet_pending(memory.state, load, now, config)
            per_replica = await self._value(
                run, pool_rate_per_replica_query(run.namespace, run.name, pool.name)
            )
            price = price_per_gpu_hour(pool.gpu_type, pool.cost_per_gpu_hour)
            views.append(
                FleetPool(
                    pool.name,
                    replicas,
                    load.ready,
                    pool.capacity or 1.0,
                    pool.gpus_per_replica,
                    price,
                    config.min_replicas,
                    config.max_replicas,
                    # Per replica over the window, times the replicas ready now: the objective
                    # divides by those again (promql.pool_rate_per_replica_query says why).
                    throughput=None if per_replica is None else per_replica * load.ready,
                    load=observation.sustained,
                    busy_share=await self._value(
                        run,
                        pool_busy_query(
                            load_query(a, run, pool),
                            run.namespace,
                            run.name,
                            pool.name,
                            a.target_per_replica * (pool.capacity or 1.0),
                        ),
                    ),
                    stuck=stuck,
                    floor=replicas if load.updating_weights else 0,
                    ceiling=ceiling,
                )
            )
            seen[pool.name] = (key, body, observation, pool)
        if not views:
            return []
        objective = ObjectiveConfig(
            step_size=run.trainer.prompts_per_update * run.trainer.samples_per_prompt,
            concurrency=run.rollout.concurrency * run.rollout.workers,
            sessions_per_capacity=a.target_per_replica,
            idle_target=a.trainer_idle_target,
            min_steps_ahead=a.min_steps_ahead,
            max_steps_ahead=run.rollout.max_steps_ahead or None,
            tolerance=a.tolerance,
            # The backlog's distance closes over the window, at least BACKLOG_HORIZON_S: a window
            # of 0 (or seconds) would turn one step of backlog into hundreds of trajectories/s.
            horizon_s=max(a.scale_down_window_seconds, BACKLOG_HORIZON_S),
            gpu_budget=a.gpu_budget,
            cost_budget_per_hour=a.cost_budget_per_hour,
        )
        states = {name: self.memory[key].state for name, (key, _, _, _) in seen.items()}
        plan, states = stabilized_plan(
            views, signals, objective, self.run_memory.get(run_key, ObjectiveMemory()), states, now,
            a.scale_down_window_seconds,
        )  # fmt: skip
        self.run_memory[run_key] = plan.memory
        if plan.demand is None or plan.recommended_concurrency is not None:
            if self._fleet_said.get(run_key) != plan.summary:  # a hold's reason, once
                log.info("%s/%s: %s", *run_key, plan.summary)
            self._fleet_said[run_key] = plan.summary
        done = []
        for view in views:
            key, read, observation, pool = seen[view.name]
            memory = self.memory[key]
            memory.state, memory.last_poll = states[view.name], now
            async with self.lock(*key):
                body = await self.live_pool(key, read)
                if body is None or (body.get("spec") or {}).get("replicas") != (read.get("spec") or {}).get(
                    "replicas"
                ):
                    continue
                target = plan.targets[view.name]
                reason = f"{view.replicas} → {target}: {plan.reasons[view.name]}"
                decision = Decision(view.replicas, target, reason, None, None, memory.state)
                pool_plan = plan_pool(
                    body,
                    run,
                    observation,
                    memory,
                    now,
                    history=self.settings.history,
                    decision=decision,
                    window=window_status(memory.state, now, a.scale_down_window_seconds),
                )
                await self.write(key, body, pool_plan, now)
            done.append((key, pool_plan))
        await self.report_concurrency(run_key, plan, objective, now, a.tolerance)
        return done

    async def report_concurrency(
        self, run_key: Key, plan: FleetPlan, objective: ObjectiveConfig, now: float, tolerance: float
    ) -> None:
        """Write the concurrency the demand needs to the run's status (it cannot be set live)."""
        body = self.runs.get(run_key)
        if body is None:
            return
        status = body.get("status") or {}
        write, value = concurrency_status(
            status.get(RECOMMENDED_CONCURRENCY), plan, objective.concurrency, now, tolerance
        )
        if not write:
            return
        await PoolApi(self.client).patch_run_status(*run_key, {RECOMMENDED_CONCURRENCY: value})
        # The watch brings the run back; until then the cache must not ask for the same write.
        self.runs[run_key] = {**body, "status": {**status, RECOMMENDED_CONCURRENCY: value}}

    async def live_pool(self, key: Key, cached: Obj) -> Obj | None:
        """The pool as the API server has it now (None when it is gone or was replaced).

        The watch keeps the cache current while this operator is active; reading the live object
        before a decision also covers the time the watch lags (or is paused by kopf's peering),
        so replicas are never computed from a stale ``spec.replicas``."""
        fresh = await self.client.get(SAMPLERPOOLS, *key)
        uid = cached["metadata"].get("uid")
        if fresh is None or (uid and fresh["metadata"].get("uid") != uid):
            self.observe_pool(cached, deleted=True)
            return None
        self.pools[key] = fresh
        return fresh

    async def poll(
        self, key: Key, cached: Obj, run: ResolvedRun, pool: ResolvedPool, memory: PoolMemory, now: float
    ) -> PoolPlan | None:
        """Ask Prometheus, then — under the pool's lock, from the live pool — decide and write.

        The pool's controller writes the same status (readiness, AutoscalerReady) under the same
        lock; a merge patch replaces the whole ``conditions`` list, so two writers that each read
        before the other wrote would drop each other's conditions.  None: the pool is gone."""
        query = load_query(run.autoscaling, run, pool)
        observation = await self.observer(
            self.session(),
            run.autoscaling.prometheus_url,
            query,
            self.settings.query_timeout_s,
            self.settings.sustained_window,
        )
        models = None
        if self.settings.check_gpu_models and observation.problem is None:
            try:
                models = await query_label_values(
                    self.session(),
                    run.autoscaling.prometheus_url,
                    gpu_models_query(run.namespace, pool.object_name),
                    "modelName",
                    self.settings.query_timeout_s,
                )
            except MetricsUnavailable:
                models = None  # GPU telemetry is optional; the load decided the replicas
        paused = None
        if observation.problem is None:
            try:
                paused = await self.scalar(
                    self.session(),
                    run.autoscaling.prometheus_url,
                    paused_query(run.namespace, pool.object_name),
                    self.settings.query_timeout_s,
                )
            except MetricsUnavailable:
                paused = None  # no paused series: no engine holds requests for an update
        async with self.lock(*key):
            body = await self.live_pool(key, cached)
            if body is None:
                return None
            window_s = run.autoscaling.scale_down_window_seconds
            if memory.last_poll is None:
                memory.state = restored_state(body, now, window_s)
            try:
                config = config_of(run, pool, body)
            except BoundsRefused as exc:
                memory.last_poll = now
                if memory.refused != str(exc):
                    memory.refused = str(exc)
                    log.warning("autoscaling %s/%s: %s", *key, exc)
                    await PoolApi(self.client).post_event(body, "Warning", "BoundsRefused", str(exc), now)
                return None
            memory.refused = None
            observation = observation.asleep(int((body.get("spec") or {}).get("replicas") or 0))
            decision = decide(load_of(body, observation, paused), memory.state, config, now)
            memory.state, memory.last_poll = decision.state, now
            if run.autoscaling.gpu_budget is not None:
                decision = self.apply_budget(key, body, run, pool, decision, observation, now)
            plan = plan_pool(
                body,
                run,
                observation,
                memory,
                now,
                history=self.settings.history,
                decision=decision,
                gpu_models=models,
                window=window_status(memory.state, now, window_s),
            )
            await self.write(key, body, plan, now)
        return plan

    def apply_budget(
        self,
        key: Key,
        body: Obj,
        run: ResolvedRun,
        pool: ResolvedPool,
        decision: Decision,
        observation: Observation,
        now: float,
    ) -> Decision:
        """Share the run's GPU budget using every pool's latest own decision (cheapest first).

        Every poll updates this pool's request, metrics or not: a pool whose metrics are missing is
        pinned at its replicas (it will not apply a grant), so no stale request counts.  A cut
        waits for the window as rule 6 does: the allocation made without floors is remembered
        (:func:`record_target`) and the pool goes no lower than the highest of the window
        (:func:`stabilized_floor`)."""
        budget = run.autoscaling.gpu_budget
        assert budget is not None
        config = config_of(run, pool, body)
        memory = self.memory[key]
        pinned = observation.problem is not None
        requests = self._budget.setdefault((key[0], run.name), {})
        for name in [n for n in requests if n not in {p.name for p in run.pools}]:
            del requests[name]
        # A pool capped by rule 8 still wants its recommendation: the demand stays, other pools cover it.
        wanted = decision.desired
        if decision.ceiling is not None and decision.recommendation is not None:
            wanted = max(wanted, decision.recommendation)
        request = BudgetRequest(
            pool.name,
            wanted,
            config.min_replicas,
            config.max_replicas,
            pool.capacity or 1.0,
            pool.gpus_per_replica,
            pool.cost_per_gpu_hour,
            floor=decision.current if pinned else 0,
            ceiling=decision.current if pinned else decision.ceiling,
        )
        allocation, requests[pool.name], memory.state = budget_step(
            request,
            list(requests.values()),
            memory.state,
            decision.current,
            now,
            run.autoscaling.scale_down_window_seconds,
            budget,
        )
        if pinned:
            return decision
        desired = allocation.replicas
        if desired < decision.current and load_of(body, Observation(None, None)).updating_weights:
            desired = decision.current  # never remove a replica mid-update
        if desired == decision.desired:
            return decision
        reason = f"{decision.current} → {desired}: {allocation.reason} (policy said {decision.desired})"
        return Decision(
            decision.current, desired, reason, decision.recommendation, decision.ratio, decision.state
        )

    async def write(self, key: Key, body: Obj, plan: PoolPlan, now: float) -> None:
        namespace, name = key
        api = PoolApi(self.client, self.settings.scale_via)
        if plan.replicas is not None:
            await api.set_replicas(namespace, name, plan.replicas)
            body.setdefault("spec", {})["replicas"] = plan.replicas  # until the watch catches up
        if plan.status_patch:
            await api.patch_status(namespace, name, plan.status_patch)
            body.setdefault("status", {}).update(plan.status_patch["status"])
        if plan.event is not None:
            kind, reason, message = plan.event
            try:
                await api.post_event(body, kind, reason, message, now)
            except ApiError as exc:  # an event is worth a log line, not a failed poll
                log.warning("event for %s/%s not posted: %s", namespace, name, exc)
        if plan.replicas is not None:
            log.info("%s/%s: %s", namespace, name, plan.decision.reason)
