"""The built-in autoscaler's plan, pure: from what the loop observed to what it should write.

No I/O, no clock, no clients.  The loop (:mod:`mixrl.operator.autoscaling.loop`) reads the run and
the pool from its watch cache and the live API, asks Prometheus (:mod:`.pool_api`), calls these and
makes the writes they return:

- the inputs: :class:`Observation` (what Prometheus said of one pool, or why it said nothing),
  :class:`PoolMemory` (what the loop remembers of a pool between polls, :func:`restored_state`
  after a restart), :func:`run_to_scale` (the run a pool follows), :func:`load_of` and
  :func:`config_of` (the policy's view of the pool and its bounds);
- the per-pool decision's adjustments: :func:`budget_decision` (the run's GPU budget) and, for
  ``objective: trainer``, :func:`objective_config`, :func:`fleet_view` and :func:`fleet_decision`
  around :func:`mixrl.operator.autoscaling.fleet_objective.stabilized_plan`;
- the result: :func:`plan_pool` → a :class:`PoolPlan` (the replica count to write or none, the
  status patch with ``lastScaleDecisions``, ``autoscalerWindow``, ``coldStartSeconds`` and the
  MetricsAvailable, ReplicasStuck and WrongGpuType conditions, and the events), and
  :func:`concurrency_status` / :func:`stale_recommendation` for the run's
  ``status.recommendedConcurrency``;
- :data:`LOOP_CONDITIONS` / :func:`loop_conditions_to_drop`: the conditions the pool's controller
  removes once another engine scales the pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from mixrl.api.gpus import price_per_gpu_hour
from mixrl.api.kube_types import Condition, ConditionValue, Obj
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedPool, ResolvedRun, resolve
from mixrl.operator.autoscaling.fleet_objective import (
    REMIX_COLD_START_S,
    FleetPlan,
    FleetPool,
    ObjectiveConfig,
)
from mixrl.operator.autoscaling.gpu_check import WRONG_GPU_TYPE, wrong_gpu_condition
from mixrl.operator.autoscaling.policy import (
    BudgetRequest,
    Decision,
    PolicyConfig,
    PolicyState,
    PoolLoad,
    budget_step,
    decide,
)
from mixrl.operator.autoscaling.replicas import Census
from mixrl.operator.kube.conditions import make_condition, update_conditions
from mixrl.operator.kube.events import rfc3339

METRICS_AVAILABLE = "MetricsAvailable"
"""A SamplerPool condition the built-in autoscaler owns (Prometheus answered, or why not)."""
UPDATING_WEIGHTS = "UpdatingWeights"
"""A SamplerPool condition whoever syncs weights sets True while engines load a new version."""
BACKLOG_HORIZON_S = 300.0
"""The shortest time ``objective: trainer`` closes the backlog's distance from its band over."""
SCALED_REASON = "Scaled"
METRICS_REASON = "MetricsUnavailable"
TRAINER_STARVED = "TrainerStarved"
"""The Warning event on an RLRun whose starving trainer no pool can feed (``objective: trainer``)."""
RECOMMENDED_CONCURRENCY = "recommendedConcurrency"
"""The RLRun status field ``objective: trainer`` reports the concurrency in (mixrl.api.status.ConcurrencyRecommendation)."""
ENDED_PHASES = ("Succeeded", "Failed")
BLOCKED_UNTIL = "mixrl.dev/growth-blocked-until"
"""SamplerPool annotation: rule 8's growth block (``PolicyState.blocked_until``, Unix time), read
back by a restarted operator.  An annotation, not a status field: the status schema (the CRD's and
:mod:`mixrl.api.status`'s) has no place for it, and the API server would prune one."""


class MetricsUnavailable(Exception):
    """Prometheus gave no usable answer; ``reason`` is CamelCase (``PrometheusUnreachable``,
    ``QueryFailed``, ``NoSeries``) and becomes the MetricsAvailable condition's reason."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


@dataclass(frozen=True)
class Observation:
    load: float | None
    sustained: float | None
    problem: MetricsUnavailable | None = None

    def asleep(self, replicas: int) -> Observation:
        """A pool at zero replicas has no engines, so the engine query has no series: that is load
        0, not missing metrics (KEDA's ``ignoreNullValues``).  Without it a sleeping pool fell out
        of the GPU budget while its stale request still counted, and ``fallbackReplicas`` woke it
        into a wake/sleep loop."""
        if replicas == 0 and self.problem is not None and self.problem.reason == "NoSeries":
            return Observation(0.0, 0.0)
        return self


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


def blocked_until_of(pool_body: Obj) -> float | None:
    """Rule 8's growth block as the pool's :data:`BLOCKED_UNTIL` annotation has it (None: none, or
    not a finite number: an edited annotation never blocks a pool for good)."""
    raw = ((pool_body.get("metadata") or {}).get("annotations") or {}).get(BLOCKED_UNTIL)
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def restored_state(pool_body: Obj, now: float, window_s: float) -> PolicyState:
    """The policy state of a pool this operator has no memory of: the window from the pool's
    status, or — a pool that never had one — its current replicas as a recommendation made now,
    so a restart never drops a pool below its replicas before a full window has passed; and rule
    8's growth block, so a restart does not let a pool grow back into the capacity that left its
    replicas stuck before ``pendingTimeoutSeconds`` have passed."""
    status = pool_body.get("status") or {}
    entries = [e for e in status.get("autoscalerWindow") or [] if float(e.get("time", 0)) > now - window_s]
    pool = tuple((float(e["time"]), int(e["replicas"])) for e in entries if e.get("kind", "pool") == "pool")
    fleet = tuple((float(e["time"]), int(e["replicas"])) for e in entries if e.get("kind") == "fleet")
    if pool or fleet:
        state = PolicyState(recommendations=pool, targets=fleet)
    else:
        state = PolicyState.seeded(now, int((pool_body.get("spec") or {}).get("replicas") or 0))
    return replace(state, blocked_until=blocked_until_of(pool_body))


def run_ended(run_body: Obj) -> bool:
    return (run_body.get("status") or {}).get("phase") in ENDED_PHASES


HELD_PHASE = "Queued"
"""The phase of a run Kueue has not admitted (or evicted): its pools are held at zero."""


def run_to_scale(run_body: Obj | None) -> ResolvedRun | None:
    """The run whose pools the loop scales; None for a run that is gone, has ended (its pools stay
    at zero: mixrl.operator.builders.resources.released), is held by Kueue (its controller keeps
    the pools at zero until admission: scaling one to its minimum only made the two write against
    each other every tick) or is invalid (the run's own controller reports the spec)."""
    if run_body is None or run_ended(run_body):
        return None
    if (run_body.get("status") or {}).get("phase") == HELD_PHASE:
        return None
    try:
        return resolve(
            RLRun.model_validate({k: run_body[k] for k in ("apiVersion", "kind", "metadata", "spec")})
        )
    except (ValueError, KeyError):
        return None


def pool_of(run: ResolvedRun, pool_body: Obj) -> ResolvedPool:
    return run.pool(pool_body["spec"]["pool"])


def load_of(
    pool_body: Obj, observation: Observation, paused: float | None = None, pods: Census | None = None
) -> PoolLoad:
    """The policy's view of one pool.  ``paused``: requests its engines hold paused (the weight
    update, :func:`mixrl.operator.autoscaling.promql.paused_query`); an ``UpdatingWeights``
    condition set by hand counts too.  ``pods``: the cluster's word on the replicas not ready
    (:func:`mixrl.operator.autoscaling.replicas.census`; None: not read, rule 8's clock decides)."""
    spec, status = pool_body.get("spec") or {}, pool_body.get("status") or {}
    replicas = int(spec.get("replicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    conditions = status.get("conditions") or []
    updating = any(c.get("type") == UPDATING_WEIGHTS and c.get("status") == "True" for c in conditions)
    updating = updating or (paused or 0) > 0
    starting = max(replicas - ready, 0)
    # Replicas of a queued run that Kueue has not admitted have no pods at all: the cluster's word
    # that they will not come up (until quota frees), so rule 8 releases them like stuck ones.
    waiting = min(int(status.get("awaitingAdmission") or 0), starting)
    stuck = None if pods is None and not waiting else min((pods.stuck if pods else 0) + waiting, starting)
    why = pods.why_stuck if pods is not None else None
    if waiting and why is None:
        admitted: Obj = next((c for c in conditions if c.get("type") == "Admitted"), {})
        why = f"{waiting} awaiting Kueue's admission: {admitted.get('message') or 'no quota left'}"
    return PoolLoad(
        load=observation.load,
        sustained=observation.sustained,
        replicas=replicas,
        ready=min(ready, replicas) if replicas else ready,
        # Every requested replica that is not ready is on its way (pending, pulling, loading)...
        starting=starting,
        updating_weights=updating,
        # ...unless the cluster says it will not come up.
        stuck=stuck,
        why_stuck=why,
    )


class BoundsRefused(ValueError):
    """The SamplerPool's own bounds contradict each other: the loop does not scale it."""


def as_routed(pool: ResolvedPool, capacity: float | None) -> ResolvedPool:
    """The pool with the capacity per replica the router shares sessions by (its trusted
    measurement where the declaration is far off it or null:
    :func:`~mixrl.operator.autoscaling.promql.pool_capacity_query`), so the policy sizes the pool
    by what the router sends it; None (the router does not say): as declared (null: 1.0)."""
    if capacity is None or not capacity > 0:
        return pool
    return pool.model_copy(update={"capacity": capacity})


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


def budget_decision(
    decision: Decision,
    requests: Sequence[BudgetRequest],
    state: PolicyState,
    pool_body: Obj,
    run: ResolvedRun,
    pool: ResolvedPool,
    observation: Observation,
    now: float,
    paused: float | None = None,
) -> tuple[Decision, BudgetRequest, PolicyState]:
    """The pool's decision within the run's GPU budget, shared from every pool's latest own request
    (``requests``, cheapest first); returns the decision, this pool's request to remember and the
    pool's next policy state.  ``paused``: the requests its engines hold paused (rule 7, as
    :func:`load_of` takes it): no replica is removed while they do.

    Every poll updates this pool's request, metrics or not: a pool whose metrics are missing is
    pinned at the replicas it keeps (it will not apply a grant), so no stale request counts.  A cut
    waits for the window as rule 6 does: the allocation made without floors is remembered
    (:func:`record_target`) and the pool goes no lower than the highest of the window
    (:func:`stabilized_floor`)."""
    budget = run.autoscaling.gpu_budget
    assert budget is not None
    config = config_of(run, pool, pool_body)
    pinned = observation.problem is not None
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
        # Pinned at what it will hold after this poll: its replicas, or fewer where rule 8 released
        # stuck ones (or fallbackReplicas applied); pinned at the old count, the released replicas
        # still counted as capacity against the budget until its next poll.
        floor=decision.desired if pinned else 0,
        ceiling=decision.desired if pinned else decision.ceiling,
    )
    allocation, request, state = budget_step(
        request,
        requests,
        state,
        decision.current,
        now,
        run.autoscaling.scale_down_window_seconds,
        budget,
    )
    if pinned:
        return decision, request, state
    desired, held = allocation.replicas, ""
    # Rule 7: no replica is removed mid-update; rule 4: bounds apply last, over this hold too (a
    # lowered maxReplicas takes effect at once, as decide() does).
    keep = min(decision.current, config.max_replicas)
    if desired < keep and load_of(pool_body, Observation(None, None), paused).updating_weights:
        desired, held = keep, "; held during weight update"
    if desired == decision.desired:
        return decision, request, state
    reason = f"{decision.current} → {desired}: {allocation.reason} (policy said {decision.desired}){held}"
    budgeted = Decision(
        decision.current, desired, reason, decision.recommendation, decision.ratio, decision.state
    )
    return budgeted, request, state


def objective_config(run: ResolvedRun) -> ObjectiveConfig:
    """``objective: trainer``'s settings, from the run's trainer, rollout and autoscaling."""
    a = run.autoscaling
    return ObjectiveConfig(
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
        stall_after_s=a.stall_after_seconds,
        move_overlap_s=REMIX_COLD_START_S + a.scale_down_window_seconds,
    )


def fleet_view(
    pool: ResolvedPool,
    config: PolicyConfig,
    load: PoolLoad,
    observation: Observation,
    *,
    per_replica: float | None,
    busy_share: float | None,
    stuck: int,
    ceiling: int | None,
    cold_start_s: float | None = None,
) -> FleetPool:
    """One pool as ``objective: trainer`` sees it: ``per_replica`` is its trajectories/s per ready
    replica over the window, ``busy_share`` the share of its slots kept busy, ``stuck`` and
    ``ceiling`` rule 8's (:func:`mixrl.operator.autoscaling.policy.fleet_pending`),
    ``cold_start_s`` what its pods' census learned (the plan ahead's horizon)."""
    return FleetPool(
        pool.name,
        load.replicas,
        load.ready,
        pool.capacity or 1.0,
        pool.gpus_per_replica,
        price_per_gpu_hour(pool.gpu_type, pool.cost_per_gpu_hour),
        config.min_replicas,
        config.max_replicas,
        # Per replica over the window, times the replicas ready now: the objective
        # divides by those again (promql.pool_rate_per_replica_query says why).
        throughput=None if per_replica is None else per_replica * load.ready,
        load=observation.sustained,
        busy_share=busy_share,
        stuck=stuck,
        floor=load.replicas if load.updating_weights else 0,
        ceiling=ceiling,
        cold_start_s=cold_start_s,
    )


def fleet_decision(plan: FleetPlan, view: FleetPool, state: PolicyState) -> Decision:
    """The fleet plan's target for one pool, as the decision :func:`plan_pool` writes."""
    target = plan.targets[view.name]
    reason = f"{view.replicas} → {target}: {plan.reasons[view.name]}"
    return Decision(view.replicas, target, reason, None, None, state)


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
    value: Obj = {
        "sessions": wanted,
        "configured": configured,
        "time": rfc3339(now),
        "message": plan.summary[:500],
    }
    return True, value


def stale_recommendation(run_body: Obj) -> bool:
    """Whether the run holds a ``status.recommendedConcurrency`` nobody updates any more: it left
    ``objective: trainer`` (or the built-in engine) and has not ended (an ended run keeps what it
    was told last).  A run still planned by the fleet step is not stale, even on a tick that did
    not reach it (its pools not seen yet, or not due)."""
    status = run_body.get("status") or {}
    if RECOMMENDED_CONCURRENCY not in status or run_ended(run_body):
        return False
    autoscaling = (run_body.get("spec") or {}).get("autoscaling") or {}
    return not (
        autoscaling.get("objective") == "trainer" and autoscaling.get("engine", "builtin") == "builtin"
    )


@dataclass(frozen=True)
class PoolPlan:
    decision: Decision
    replicas: int | None
    """The replica count to write through the scale subresource; None = leave it."""
    status_patch: Obj
    """A merge patch for the status subresource (empty: nothing changed)."""
    event: tuple[str, str, str] | None
    """(type, reason, message) of the event to post, if any (Scaled, MetricsUnavailable)."""
    stuck_event: tuple[str, str, str] | None = None
    """The ReplicasStuck Warning, posted beside ``event`` (the release it causes is a Scaled one)."""
    gpu_event: tuple[str, str, str] | None = None
    """The WrongGpuType Warning, posted beside ``event`` when the condition turns True (a Scaled
    event of the same poll must not replace it)."""
    annotations: Obj = field(default_factory=dict)
    """A merge patch for the pool's ``metadata.annotations`` (empty: nothing changed): the
    :data:`BLOCKED_UNTIL` growth block."""


def metrics_condition(
    previous: list[Obj], observation: Observation, generation: int | None, now: float
) -> Condition:
    value: ConditionValue
    if observation.problem is None:
        value = ("True", "QueryReturned", f"load {observation.load:g}")
    else:
        value = ("False", observation.problem.reason, observation.problem.message[:300])
    return make_condition(METRICS_AVAILABLE, value, generation, rfc3339(now), previous)


REPLICAS_STUCK = "ReplicasStuck"
"""Condition (and Warning event) of a pool with replicas the cluster reports as unable to start."""
LOOP_CONDITIONS = (METRICS_AVAILABLE, REPLICAS_STUCK, WRONG_GPU_TYPE)
"""The SamplerPool conditions the built-in loop writes (:func:`plan_pool`)."""


def loop_conditions_to_drop(engine: str) -> tuple[str, ...]:
    """The conditions the pool's controller removes from a pool of a run with this
    ``autoscaling.engine``: the loop's own once another engine scales the pool (nobody would
    update them any more), none while the loop does."""
    return () if engine == "builtin" else LOOP_CONDITIONS


def cold_start_of(pool_body: Obj, pods: Census | None) -> float | None:
    """The pool's cold start for the plan ahead: what this poll's census learned, else what an
    earlier poll learned and wrote (``status.coldStartSeconds``; a pool at zero has no ready pod
    to learn from, and a pod list that failed says nothing)."""
    if pods is not None and pods.cold_start_s is not None:
        return pods.cold_start_s
    learned = (pool_body.get("status") or {}).get("coldStartSeconds")
    return float(learned) if isinstance(learned, int | float) and learned > 0 else None


def stuck_condition(previous: list[Obj], pods: Census, generation: int | None, now: float) -> Condition:
    """``ReplicasStuck``: True with the cluster's reason while replicas cannot start (rule 8
    releases them), False while every replica not ready is a cold start."""
    value: ConditionValue
    if pods.stuck:
        value = (
            "True",
            "ClusterReports",
            f"{pods.stuck} of the pool's replicas cannot start: {pods.why_stuck}"[:1000],
        )
    elif pods.starting:
        value = (
            "False",
            "ColdStart",
            "replicas are starting; none is stuck",
        )  # no count: a write per replica
    else:
        value = ("False", "NoneStuck", "every replica is ready")
    return make_condition(REPLICAS_STUCK, value, generation, rfc3339(now), previous)


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
    pods: Census | None = None,
) -> PoolPlan:
    """One poll of one pool.  ``decision`` overrides the policy (the GPU budget, the fleet plan);
    ``gpu_models`` are the GPU models the pool's pods report (None: unknown); ``window`` is the
    scale-down window to persist (:func:`window_status`; written when it changed); ``pods``: the
    pool's pods counted (the ReplicasStuck condition and the learned cold start; None: not read).
    The decision's rule 8 growth block is persisted too (:data:`BLOCKED_UNTIL`, when it changed)."""
    pool = pool_of(run, pool_body)
    load = load_of(pool_body, observation, pods=pods)
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
    event: tuple[str, str, str] | None = None
    gpu_event: tuple[str, str, str] | None = None
    wrong_gpu = wrong_gpu_condition(gpu_models or (), pool.gpu_products, conditions, generation, rfc3339(now))
    if wrong_gpu is not None:
        before = next((c for c in conditions if c.get("type") == WRONG_GPU_TYPE), None)
        if before is None or any(before.get(k) != wrong_gpu[k] for k in ("status", "reason", "message")):
            current = patch.get("conditions", conditions)
            patch["conditions"] = [*(c for c in current if c.get("type") != WRONG_GPU_TYPE), wrong_gpu]
            # Once when it turns True: a message that changes while True (another product seen)
            # rewrites the condition, not another Warning.
            if wrong_gpu["status"] == "True" and (before is None or before.get("status") != "True"):
                gpu_event = ("Warning", WRONG_GPU_TYPE, wrong_gpu["message"])
    stuck_event: tuple[str, str, str] | None = None
    if pods is not None:
        stuck = stuck_condition(patch.get("conditions", conditions), pods, generation, now)
        before = next((c for c in conditions if c.get("type") == REPLICAS_STUCK), None)
        if before is None or any(before.get(k) != stuck[k] for k in ("status", "reason", "message")):
            # In its place (the pool's controller and this loop both write conditions).
            patch["conditions"] = update_conditions(patch.get("conditions", conditions), [stuck])
            if stuck["status"] == "True" and (before is None or before.get("status") != "True"):
                stuck_event = ("Warning", REPLICAS_STUCK, stuck["message"])
        learned = None if pods.cold_start_s is None else round(pods.cold_start_s, 1)
        if learned is not None and learned != status.get("coldStartSeconds"):
            patch["coldStartSeconds"] = learned
    if window is not None and window != status.get("autoscalerWindow"):
        patch["autoscalerWindow"] = window
    replicas = None
    if decision.changed:
        replicas = decision.desired
        record: Obj = {
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
    annotations: Obj = {}
    blocked = decision.state.blocked_until
    # Kept once it has passed (restoring a past block blocks nothing): no write to remove it.
    if blocked is not None and blocked != blocked_until_of(pool_body):
        annotations[BLOCKED_UNTIL] = repr(float(blocked))
    return PoolPlan(
        decision, replicas, {"status": patch} if patch else {}, event, stuck_event, gpu_event, annotations
    )
