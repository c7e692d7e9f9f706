"""The built-in autoscaler's loop: observe, plan, write — for each SamplerPool of a builtin run.

Three separable steps, so each is tested on its own:

1. observe (:mod:`mixrl.operator.autoscaling.pool_api`) — instant queries against Prometheus's
   ``/api/v1/query``; a failure is a ``MetricsUnavailable`` with a CamelCase reason
   (``PrometheusUnreachable``, ``QueryFailed``, ``NoSeries``).
2. plan (:mod:`mixrl.operator.autoscaling.plan`, pure) — the pool's body, its run, what
   Prometheus said and the pool's memory → a ``PoolPlan``: the replica count to write (or none),
   the status patch (``lastScaleDecisions``, ``autoscalerWindow``, ``coldStartSeconds``, the
   MetricsAvailable, ReplicasStuck and WrongGpuType conditions) and the events.
3. write (``PoolApi``, same module as 1) — ``PATCH …/samplerpools/NAME/scale``,
   ``PATCH …/status``, ``POST …/events``, and for ``objective: trainer`` the run's
   ``PATCH …/rlruns/NAME/status`` (``recommendedConcurrency``, ``concurrency_status``), through
   the operator's RBAC-checked API client.

This module holds only what joins them: the watch cache, the clock, the locks, the peering gate
and the memory kept between polls.  No kopf here.  The kopf layer
(:func:`mixrl.operator.controller.handlers.register_autoscaling`) feeds :class:`AutoscalingLoop`
the latest RLRuns and SamplerPools from its watch events, starts it at operator startup and stops
it at cleanup; no kopf timer or daemon, since those put a finalizer on every SamplerPool and the
operator keeps its objects finalizer-free.  One task visits every pool of a run whose
``autoscaling.engine`` is ``builtin`` each tick, acting when its poll interval has passed.  Pools
of ``keda`` runs are KEDA's (the pool's controller applies their ScaledObjects), pools of ``none``
runs are left alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import aiohttp

from mixrl.api.kube_types import Obj
from mixrl.api.resolve import ResolvedPool, ResolvedRun
from mixrl.operator.autoscaling.fleet_objective import (
    FleetPlan,
    FleetPool,
    ObjectiveConfig,
    ObjectiveMemory,
    TrainerSignals,
    stabilized_plan,
)
from mixrl.operator.autoscaling.plan import (
    RECOMMENDED_CONCURRENCY,
    TRAINER_STARVED,
    BoundsRefused,
    MetricsUnavailable,
    Observation,
    PoolMemory,
    PoolPlan,
    as_routed,
    budget_decision,
    cold_start_of,
    concurrency_status,
    config_of,
    fleet_decision,
    fleet_view,
    load_of,
    objective_config,
    plan_pool,
    pool_of,
    restored_state,
    run_to_scale,
    stale_recommendation,
    window_status,
)
from mixrl.operator.autoscaling.policy import BudgetRequest, Decision, decide, fleet_pending
from mixrl.operator.autoscaling.pool_api import PoolApi, observe, query_label_values, query_prometheus
from mixrl.operator.autoscaling.promql import (
    SUSTAINED_STEP,
    SUSTAINED_WINDOW,
    TRAINER_WINDOW,
    gpu_models_query,
    load_query,
    paused_query,
    pool_busy_query,
    pool_capacity_query,
    pool_rate_per_replica_query,
    trainer_queries,
)
from mixrl.operator.autoscaling.replicas import (
    NODE_ON_ITS_WAY_REASONS,
    Census,
    census,
    pods_with_a_node_on_its_way,
    unschedulable,
)
from mixrl.operator.kube.client import ApiError, KubeClient
from mixrl.operator.kube.rbac import EVENTS, PODS, RLRUNS, SAMPLERPOOLS
from mixrl.operator.kube.ticker import Ticker

Key = tuple[str, str]
UNREACHABLE = "PrometheusUnreachable"
"""The MetricsUnavailable reason of a Prometheus that did not answer (refused or timed out)."""
log = logging.getLogger("mixrl.operator.autoscaling")


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


def failed(what: str, exc: Exception) -> None:
    """One warning line for a pool (or run) whose poll failed unexpectedly; the traceback at debug
    level (the poll is retried every tick: a traceback each time would bury the log)."""
    log.warning("autoscaling %s failed: %s: %s", what, type(exc).__name__, exc)
    log.debug("autoscaling %s failed", what, exc_info=exc)


def cache_event(
    cache: dict[Key, Obj],
    body: Mapping[str, Any],
    deleted: bool,
    forget: Iterable[MutableMapping[Key, Any]],
) -> None:
    """Keep the latest body of a watched object by (namespace, name); a deleted one takes what the
    loop remembered of it (``forget``) along."""
    meta = body["metadata"]
    key = (meta.get("namespace") or "default", meta["name"])
    if deleted:
        for remembered in (cache, *forget):
            remembered.pop(key, None)
    else:
        cache[key] = dict(body)


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
        run_lock: PoolLock | None = None,
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
        self._run_locks: dict[Key, asyncio.Lock] = {}
        self.run_lock: PoolLock = run_lock or (
            lambda namespace, name: self._run_locks.setdefault((namespace, name), asyncio.Lock())
        )
        """(namespace, run) -> the lock held while writing the run's status: the operator's
        per-object lock, shared with the run's controller and its live status loop (each writes
        the whole status from what it read under that lock)."""
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
        self._resolved: dict[Key, tuple[Obj | None, ResolvedRun | None]] = {}
        """(namespace, run) -> (the body last resolved, what it resolved to)."""
        self._fleet_said: dict[Key, str] = {}
        self._stall_said: dict[Key, str | None] = {}
        self._unreachable: dict[str, MetricsUnavailable] = {}
        """Prometheus URL -> why it did not answer this tick: its other queries wait for the next
        tick.  A Prometheus that hangs costs one timeout per tick, not one per query of every
        pool on it (minutes a tick, with the pools on a healthy Prometheus waiting behind)."""

    def _own_lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    # -- watch events
    def observe_run(self, body: Mapping[str, Any], deleted: bool) -> None:
        cache_event(
            self.runs,
            body,
            deleted,
            forget=(self.run_memory, self._run_polled, self._resolved, self._run_locks),
        )

    def observe_pool(self, body: Mapping[str, Any], deleted: bool) -> None:
        cache_event(self.pools, body, deleted, forget=(self.memory, self._locks))

    # -- lifecycle (start, the tick loop and the HTTP session: Ticker)
    async def stop(self) -> None:
        await super().stop()
        if self.owns_client:
            await self.client.close()

    # -- one tick
    def resolved_run(self, pool_body: Obj) -> ResolvedRun | None:
        """The pool's run, resolved once per watch event of it, not at every tick: a tick asks for
        every pool's run, autoscaled or not (400 resolutions every 5 s at 50 runs of 8 pools under
        bench/cluster_scale.py)."""
        key = (
            pool_body["metadata"].get("namespace") or "default",
            (pool_body.get("spec") or {}).get("run", ""),
        )
        run_body = self.runs.get(key)
        known = self._resolved.get(key)
        if known is None or known[0] is not run_body:  # each event keeps a new body (cache_event)
            known = self._resolved[key] = (run_body, run_to_scale(run_body))
        return known[1]

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
        self._unreachable.clear()  # a Prometheus that did not answer last tick is asked again
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
            except Exception as exc:  # so does a bug or an odd object in one pool (not a cancel)
                failed(f"{key[0]}/{key[1]}", exc)
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
            except Exception as exc:  # the other runs still get their turn
                failed(f"run {run_key[0]}/{run_key[1]}", exc)
        await self.clear_stale_concurrency(fleets, verdicts)
        return done

    async def clear_stale_concurrency(self, fleets: Mapping[Key, Any], verdicts: dict[str, bool]) -> None:
        """A run that left ``objective: trainer`` (or the built-in engine) keeps no recommendation
        nobody updates any more."""
        for run_key, body in list(self.runs.items()):
            if run_key in fleets or not stale_recommendation(body):
                continue
            if not await self.active_in(run_key[0], verdicts):
                continue
            try:
                await PoolApi(self.client).patch_run_status(*run_key, {RECOMMENDED_CONCURRENCY: None})
            except ApiError as exc:
                log.warning("autoscaling run %s/%s: %s", *run_key, exc)
                continue
            status = {k: v for k, v in (body.get("status") or {}).items() if k != RECOMMENDED_CONCURRENCY}
            self.runs[run_key] = {**body, "status": status}

    def _answered(self, url: str, problem: MetricsUnavailable | None) -> None:
        """Note a Prometheus that did not answer (timed out, refused): not asked again this tick."""
        if problem is not None and problem.reason == UNREACHABLE:
            self._unreachable[url] = problem

    async def _observe(self, url: str, query: str, window: tuple[str, str]) -> Observation:
        """A pool's load (:data:`Observer`), or the problem of a Prometheus that did not answer
        earlier this tick (the pool's MetricsAvailable condition says why)."""
        problem = self._unreachable.get(url)
        if problem is not None:
            return Observation(None, None, problem)
        observation = await self.observer(self.session(), url, query, self.settings.query_timeout_s, window)
        self._answered(url, observation.problem)
        return observation

    async def _value(self, run: ResolvedRun, query: str) -> float | None:
        """One number from Prometheus, or None (no series, or no answer: the objective holds)."""
        url = run.autoscaling.prometheus_url
        if url in self._unreachable:
            return None
        try:
            return await self.scalar(self.session(), url, query, self.settings.query_timeout_s)
        except MetricsUnavailable as exc:
            self._answered(url, exc)
            return None

    async def poll_fleet(
        self, run_key: Key, run: ResolvedRun, keys: list[Key], now: float
    ) -> list[tuple[Key, PoolPlan]]:
        """``objective: trainer``: read the run's and every pool's series, plan the fleet as one
        (:func:`mixrl.operator.autoscaling.fleet_objective.stabilized_plan`), then write each pool
        under its lock, from the live pool (a pool whose replicas moved meanwhile waits a poll)."""
        a = run.autoscaling
        url = a.prometheus_url
        queries = trainer_queries(run.namespace, run.name)
        signals = TrainerSignals(**{name: await self._value(run, q) for name, q in queries.items()})
        views: list[FleetPool] = []
        seen: dict[str, tuple[Key, Obj, Observation, ResolvedPool, Census | None, set[str] | None]] = {}
        for key in keys:
            cached = self.pools.get(key)
            body = None if cached is None else await self.live_pool(key, cached)
            if body is None:
                continue
            try:
                pool = pool_of(run, body)
            except KeyError:
                continue
            pool = as_routed(
                pool, await self._value(run, pool_capacity_query(run.namespace, run.name, pool.name))
            )
            try:
                config = config_of(run, pool, body)
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
            observation = (await self._observe(url, load_query(a, run, pool), window)).asleep(replicas)
            paused = await self._value(run, paused_query(run.namespace, pool.object_name))
            pods = await self.pods_of(key, body)
            load = load_of(body, observation, paused, pods)
            memory.state, stuck, ceiling = fleet_pending(memory.state, load, now, config)
            per_replica = await self._value(
                run, pool_rate_per_replica_query(run.namespace, run.name, pool.name)
            )
            busy_share = await self._value(
                run,
                pool_busy_query(
                    load_query(a, run, pool),
                    run.namespace,
                    run.name,
                    pool.name,
                    a.target_per_replica * (pool.capacity or 1.0),
                ),
            )
            views.append(
                fleet_view(
                    pool,
                    config,
                    load,
                    observation,
                    per_replica=per_replica,
                    busy_share=busy_share,
                    stuck=stuck,
                    ceiling=ceiling,
                    cold_start_s=cold_start_of(body, pods),
                )
            )
            models = await self.gpu_models(run, pool, observation)
            seen[pool.name] = (key, body, observation, pool, pods, models)
        if not views:
            return []
        objective = objective_config(run)
        states = {name: self.memory[key].state for name, (key, *_) in seen.items()}
        plan, states = stabilized_plan(
            views, signals, objective, self.run_memory.get(run_key, ObjectiveMemory()), states, now,
            a.scale_down_window_seconds,
        )  # fmt: skip
        self.run_memory[run_key] = plan.memory
        await self.report_stall(run_key, plan, now)
        if plan.demand is None or plan.recommended_concurrency is not None:
            if self._fleet_said.get(run_key) != plan.summary:  # a hold's reason, once
                log.info("%s/%s: %s", *run_key, plan.summary)
            self._fleet_said[run_key] = plan.summary
        done = []
        for view in views:
            key, read, observation, pool, pods, models = seen[view.name]
            memory = self.memory[key]
            memory.state, memory.last_poll = states[view.name], now
            async with self.lock(*key):
                body = await self.live_pool(key, read)
                if body is None or (body.get("spec") or {}).get("replicas") != (read.get("spec") or {}).get(
                    "replicas"
                ):
                    continue
                decision = fleet_decision(plan, view, memory.state)
                try:
                    pool_plan = await self.plan_and_write(
                        key, body, run, observation, memory, decision, now, models, pods
                    )
                except ApiError as exc:  # this pool's write failed (a conflict); the others' still count
                    log.warning("autoscaling %s/%s: %s", *key, exc)
                    continue
            done.append((key, pool_plan))
        await self.report_concurrency(run_key, plan, objective, now, a.tolerance)
        return done

    async def report_stall(self, run_key: Key, plan: FleetPlan, now: float) -> None:
        """A TrainerStarved Warning on the run when no pool can grow for a starving trainer (once
        per distinct reason, not once per poll)."""
        said = self._stall_said.get(run_key)
        self._stall_said[run_key] = plan.stalled
        body = self.runs.get(run_key)
        if plan.stalled is None or plan.stalled == said or body is None:
            return
        # On the run (before, it was posted with the SamplerPool kind under the run's name, so
        # `kubectl describe rlrun` never showed it).
        await PoolApi(self.client).post_event(body, "Warning", TRAINER_STARVED, plan.summary, now, RLRUNS)

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
        async with self.run_lock(*run_key):
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

    async def gpu_models(
        self, run: ResolvedRun, pool: ResolvedPool, observation: Observation
    ) -> set[str] | None:
        """The GPU models DCGM reports under the pool's pods (the WrongGpuType condition), asked
        by both objectives' polls; None: not asked (switched off, or Prometheus did not answer
        the load query) or no answer."""
        url = run.autoscaling.prometheus_url
        if not self.settings.check_gpu_models or observation.problem is not None or url in self._unreachable:
            return None
        try:
            return await query_label_values(
                self.session(),
                url,
                gpu_models_query(run.namespace, pool.object_name),
                "modelName",
                self.settings.query_timeout_s,
            )
        except MetricsUnavailable as exc:
            self._answered(url, exc)
            return None  # GPU telemetry is optional; the load decided the replicas

    async def pods_of(self, key: Key, body: Obj) -> Census | None:
        """The pool's pods as the cluster reports them (:mod:`mixrl.operator.autoscaling.replicas`);
        None when they cannot be read (rule 8's clock decides then).  Events are read only when a
        pod is unschedulable: whether a cluster autoscaler is bringing a node for it."""
        selector = str((body.get("status") or {}).get("selector") or "")
        labels = dict(part.split("=", 1) for part in selector.split(",") if "=" in part)
        if not labels:
            return None  # the pool's controller has not written its selector yet
        try:
            pods = await self.client.list(PODS, key[0], labels)
            coming: set[str] = set()
            if unschedulable(pods):
                for reason in NODE_ON_ITS_WAY_REASONS:
                    found = await self.client.request(
                        "list",
                        "GET",
                        EVENTS,
                        namespace=key[0],
                        params={"fieldSelector": f"involvedObject.kind=Pod,reason={reason}"},
                    )
                    coming |= pods_with_a_node_on_its_way((found or {}).get("items") or [])
        except ApiError as exc:
            log.warning("autoscaling %s/%s: pods not read (%s); the pending timeout decides", *key, exc)
            return None
        return census(pods, coming)

    async def poll(
        self, key: Key, cached: Obj, run: ResolvedRun, pool: ResolvedPool, memory: PoolMemory, now: float
    ) -> PoolPlan | None:
        """Ask Prometheus, then — under the pool's lock, from the live pool — decide and write.

        The pool's controller writes the same status (readiness, AutoscalerReady) under the same
        lock; a merge patch replaces the whole ``conditions`` list, so two writers that each read
        before the other wrote would drop each other's conditions.  None: the pool is gone."""
        query = load_query(run.autoscaling, run, pool)
        observation = await self._observe(
            run.autoscaling.prometheus_url, query, self.settings.sustained_window
        )
        models = await self.gpu_models(run, pool, observation)
        paused = None
        if observation.problem is None:  # None also when no series: no engine holds requests for an update
            paused = await self._value(run, paused_query(run.namespace, pool.object_name))
        pool = as_routed(
            pool, await self._value(run, pool_capacity_query(run.namespace, run.name, pool.name))
        )
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
            pods = await self.pods_of(key, body)
            decision = decide(load_of(body, observation, paused, pods), memory.state, config, now)
            memory.last_poll = now
            if run.autoscaling.gpu_budget is not None:
                decision = self.apply_budget(key, body, run, pool, decision, observation, now, paused)
            plan = await self.plan_and_write(key, body, run, observation, memory, decision, now, models, pods)
            # Kept only once written: after a failed scale write the state would count a scale-up
            # that never happened against the next poll's rate limit.
            memory.state = decision.state
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
        paused: float | None = None,
    ) -> Decision:
        """Share the run's GPU budget using every pool's latest own request
        (:func:`mixrl.operator.autoscaling.plan.budget_decision`; ``paused``: the requests the
        pool's engines hold paused, which keep the budget from removing replicas mid-update); the
        requests of pools the run no longer declares are forgotten.  The decision returned carries
        the pool's next state (the caller keeps it once the decision is written)."""
        requests = self._budget.setdefault((key[0], run.name), {})
        for name in [n for n in requests if n not in {p.name for p in run.pools}]:
            del requests[name]
        decision, requests[pool.name], state = budget_decision(
            decision, list(requests.values()), decision.state, body, run, pool, observation, now, paused
        )
        return replace(decision, state=state)

    async def plan_and_write(
        self,
        key: Key,
        body: Obj,
        run: ResolvedRun,
        observation: Observation,
        memory: PoolMemory,
        decision: Decision,
        now: float,
        gpu_models: set[str] | None = None,
        pods: Census | None = None,
    ) -> PoolPlan:
        """The pool's writes for this decision (:func:`mixrl.operator.autoscaling.plan.plan_pool`),
        made; the caller holds the pool's lock and read ``body`` live under it."""
        plan = plan_pool(
            body,
            run,
            observation,
            memory,
            now,
            history=self.settings.history,
            decision=decision,
            gpu_models=gpu_models,
            window=window_status(decision.state, now, run.autoscaling.scale_down_window_seconds),
            pods=pods,
        )
        await self.write(key, body, plan, now)
        return plan

    async def write(self, key: Key, body: Obj, plan: PoolPlan, now: float) -> None:
        namespace, name = key
        api = PoolApi(self.client, self.settings.scale_via)
        if plan.replicas is not None:
            await api.set_replicas(namespace, name, plan.replicas)
            body.setdefault("spec", {})["replicas"] = plan.replicas  # until the watch catches up
        if plan.status_patch:
            await api.patch_status(namespace, name, plan.status_patch)
            body.setdefault("status", {}).update(plan.status_patch["status"])
        if plan.annotations:
            await api.patch_annotations(namespace, name, plan.annotations)
            body.setdefault("metadata", {}).setdefault("annotations", {}).update(plan.annotations)
        for event in (plan.stuck_event, plan.gpu_event, plan.event):
            if event is None:
                continue
            kind, reason, message = event
            try:
                await api.post_event(body, kind, reason, message, now)
            except ApiError as exc:  # an event is worth a log line, not a failed poll
                log.warning("event for %s/%s not posted: %s", namespace, name, exc)
        if plan.replicas is not None:
            log.info("%s/%s: %s", namespace, name, plan.decision.reason)
