"""The sampler-pool scaling policy: pure functions, no I/O.

One pool, one poll: :func:`decide` turns the pool's observed load (queued plus running requests
summed over its engines) into a desired replica count.  The rules, in the order they apply
(docs/autoscaling.md has the formulas and how they compare with HPA and KEDA):

1. **Ratio with tolerance** (HPA's rule).  With ``B`` replicas of capacity in service or on their
   way, ``ratio = load / (target · B)``; within ``1 ± tolerance`` nothing changes, otherwise the
   recommendation is ``ceil(load / target)``.  A scale-up must be *confirmed* by the load averaged
   over the last minute (``sustained``): a batch of sessions starting at once is a spike, not
   demand, while a real step moves both at once, so it is still met within one poll.
2. **Capacity on its way.**  ``B = ready + starting``: a replica that is still loading its model
   counts as capacity, so a queue that cannot drain during a cold start does not make the
   autoscaler ask again and again (the runaway scale-up people complain about).
   ``count_starting=False`` measures load per *ready* replica and multiplies the current count,
   as HPA does for a per-pod metric; the KEDA-like baseline (:meth:`PolicyConfig.keda_like`)
   keeps ``count_starting=True``, since for KEDA's External ``AverageValue`` metric HPA computes
   ``ceil(load / target)`` from the total whatever the pods' readiness.
3. **Scale to zero and activation** (KEDA's rule).  A pool whose ``minReplicas`` is 0 goes to zero
   when its load is at or below the activation threshold, and wakes when the load exceeds it.
4. **Bounds**: ``minReplicas ≤ desired ≤ maxReplicas``, always.
5. **Scale-up rate limit** (HPA's default policies): at most
   ``max(period-start + scaleUpLimit, 2 · period-start)`` replicas per period (HPA's default: + 4
   pods).  **Burst allowance**: a ratio of ``burstRatio`` or more is a load step, not noise, and
   lifts the limit, so the full target is requested within one poll.
6. **Scale-down stabilization** (HPA's) **with headroom**: scale down only to the highest
   scale-down recommendation of the last ``scaleDownWindow`` seconds, where that recommendation
   keeps the tolerance as headroom, ``ceil(load · (1 + tolerance) / target)``.  Once scaled down,
   the load must exceed the window's peak by (1 + tolerance)² before the pool scales up again, so
   noise smaller than that never makes a pool go down and back up (HPA has no headroom).
7. **Weight updates**: no replica is removed while the pool is loading a new weight version.
8. **Stuck replicas**: replicas the cluster reports as unable to start
   (:mod:`mixrl.operator.autoscaling.replicas`: unschedulable with no node on its way — a spot
   pool that lost its nodes, a quota —, an image that cannot be pulled, a crash loop) stop counting
   as capacity and are released, and the pool may not grow for ``pendingTimeout`` seconds: the
   fleet step (the GPU budget or the RL objective) places that capacity on another pool.  A cold
   start is not stuck however long it takes (a new GPU node: 10–12 minutes).  Only where the
   cluster's word is missing (the pods could not be read) does the old clock decide: replicas not
   ready while none became ready for ``pendingTimeout`` seconds count as stuck.

:func:`allocate_gpu_budget` is the optional global step: all pools share a GPU budget, filled
cheapest capacity first (cost per token ∝ costPerGpuHour · gpusPerReplica / capacity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mixrl.api.models import AutoscalingSpec
    from mixrl.api.resolve import ResolvedPool

# HPA's default scale-up policies: 4 pods or 100 %, whichever is more, per 15 s.
HPA_SCALE_UP_PODS = 4
HPA_SCALE_UP_PERCENT = 100.0
HPA_SCALE_UP_PERIOD_S = 15.0
HPA_SCALE_DOWN_WINDOW_S = 300.0
KEDA_POLLING_INTERVAL_S = 30.0
KEDA_COOLDOWN_PERIOD_S = 300.0
DEFAULT_BURST_RATIO = 2.0
DEFAULT_PENDING_TIMEOUT_S = 600.0

# Float noise in load / target must not turn 16.000000001 into 17 replicas.
_CEIL_EPSILON = 1e-9


def _ceil(value: float) -> int:
    return max(0, math.ceil(value - _CEIL_EPSILON))


@dataclass(frozen=True)
class PoolLoad:
    """What one poll observes about one pool."""

    load: float | None
    """Queued plus running requests summed over the pool's engines; None = metrics unavailable."""
    replicas: int
    """Replicas currently requested (``spec.replicas``)."""
    ready: int
    """Replicas ready to serve."""
    sustained: float | None = None
    """The same load averaged over the last minute, confirming a scale-up; None = use ``load``."""
    starting: int = 0
    """Requested replicas not ready yet (pending, pulling, loading the model): capacity on its way."""
    updating_weights: bool = False
    """The pool is loading a new weight version: no replica may be removed now."""
    stuck: int | None = None
    """Of the ``starting`` replicas, those the cluster reports as unable to start (rule 8); None:
    the cluster's word is missing, and the pending clock decides."""
    why_stuck: str | None = None
    """The cluster's reason for the first stuck replica (one line), for the decision's reason."""

    def __post_init__(self) -> None:
        if self.stuck is not None and not 0 <= self.stuck <= self.starting:
            raise ValueError(f"PoolLoad.stuck: must be in [0, starting {self.starting}], got {self.stuck}")
        for name in ("replicas", "ready", "starting"):
            if getattr(self, name) < 0:
                raise ValueError(f"PoolLoad.{name}: must be ≥ 0, got {getattr(self, name)}")
        for name in ("load", "sustained"):
            value = getattr(self, name)
            if value is not None and (math.isnan(value) or value < 0):
                raise ValueError(f"PoolLoad.{name}: must be a number ≥ 0 or None, got {value}")


@dataclass(frozen=True)
class PolicyConfig:
    """One pool's scaling parameters (times in seconds)."""

    min_replicas: int
    max_replicas: int
    target_per_replica: float
    """Desired load per replica of this pool (the run's target × the pool's capacity)."""
    tolerance: float = 0.1
    scale_down_window_s: float = HPA_SCALE_DOWN_WINDOW_S
    scale_up_pods: int = HPA_SCALE_UP_PODS
    scale_up_percent: float = HPA_SCALE_UP_PERCENT
    scale_up_period_s: float = HPA_SCALE_UP_PERIOD_S
    activation_threshold: float = 1.0
    """A pool at zero wakes when load > this; a pool allowed to reach zero sleeps at load ≤ this."""
    burst_ratio: float | None = DEFAULT_BURST_RATIO
    """A ratio at or above this lifts the scale-up rate limit; None disables the allowance."""
    count_starting: bool = True
    """Count starting replicas as capacity (mixrl, and HPA for KEDA's External AverageValue
    metric); False measures load per ready replica (HPA for a per-pod metric)."""
    scale_down_headroom: float | None = None
    """Headroom kept when scaling down (fraction of the load); None = the tolerance, 0 = HPA."""
    fallback_replicas: int | None = None
    """Replicas to apply when metrics are unavailable; None holds the current count."""
    poll_interval_s: float = KEDA_POLLING_INTERVAL_S
    """How often the loop (or the simulator) calls :func:`decide`."""
    pending_timeout_s: float | None = DEFAULT_PENDING_TIMEOUT_S
    """After stuck replicas are released the pool may not grow for this long; where the cluster's
    word is missing, replicas not ready after this long without progress count as stuck (rule 8).
    None: neither."""

    def __post_init__(self) -> None:
        problems = []
        if self.min_replicas < 0:
            problems.append(f"min_replicas: must be ≥ 0, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            problems.append(f"max_replicas: {self.max_replicas} is below min_replicas {self.min_replicas}")
        if not self.target_per_replica > 0:
            problems.append(f"target_per_replica: must be > 0, got {self.target_per_replica}")
        if not 0 <= self.tolerance < 1:
            problems.append(f"tolerance: must be in [0, 1), got {self.tolerance}")
        if self.scale_down_window_s < 0:
            problems.append(f"scale_down_window_s: must be ≥ 0, got {self.scale_down_window_s}")
        if self.scale_up_pods < 0 or self.scale_up_percent < 0:
            problems.append("scale_up_pods, scale_up_percent: must be ≥ 0")
        if self.scale_up_pods == 0 and self.scale_up_percent == 0:
            problems.append("scale_up_pods, scale_up_percent: at least one must be > 0")
        if not self.scale_up_period_s > 0 or not self.poll_interval_s > 0:
            problems.append("scale_up_period_s, poll_interval_s: must be > 0")
        if self.activation_threshold < 0:
            problems.append(f"activation_threshold: must be ≥ 0, got {self.activation_threshold}")
        if self.burst_ratio is not None and not self.burst_ratio > 1:
            problems.append(f"burst_ratio: must be > 1 or None, got {self.burst_ratio}")
        if self.scale_down_headroom is not None and not 0 <= self.scale_down_headroom < 1:
            problems.append(f"scale_down_headroom: must be in [0, 1) or None, got {self.scale_down_headroom}")
        if self.fallback_replicas is not None and self.fallback_replicas < 0:
            problems.append(f"fallback_replicas: must be ≥ 0, got {self.fallback_replicas}")
        if self.pending_timeout_s is not None and not self.pending_timeout_s > 0:
            problems.append(f"pending_timeout_s: must be > 0 or None, got {self.pending_timeout_s}")
        if problems:
            raise ValueError(f"PolicyConfig.{problems[0]}")

    @classmethod
    def from_spec(
        cls,
        spec: AutoscalingSpec,
        pool: ResolvedPool,
        *,
        min_replicas: int | None = None,
        max_replicas: int | None = None,
        burst_ratio: float | None = DEFAULT_BURST_RATIO,
    ) -> PolicyConfig:
        """The policy of one pool of a resolved run.

        ``targetPerReplica`` is per unit of capacity: the router sends a pool sessions in proportion
        to its capacity, so a replica of capacity 4 carries four times the load of one of capacity
        1 at the same latency.  ``min_replicas``/``max_replicas`` override the pool's bounds (the
        SamplerPool object may have been edited since the run was resolved).
        """
        capacity = pool.capacity if pool.capacity is not None else 1.0
        return cls(
            min_replicas=pool.min_replicas if min_replicas is None else min_replicas,
            max_replicas=pool.max_replicas if max_replicas is None else max_replicas,
            target_per_replica=spec.target_per_replica * capacity,
            tolerance=spec.tolerance,
            scale_down_window_s=spec.scale_down_window_seconds,
            scale_up_pods=spec.scale_up_limit,
            scale_up_percent=HPA_SCALE_UP_PERCENT,
            scale_up_period_s=spec.poll_interval_seconds,
            activation_threshold=spec.activation_threshold,
            burst_ratio=burst_ratio,
            count_starting=True,
            fallback_replicas=spec.fallback_replicas,
            poll_interval_s=spec.poll_interval_seconds,
            pending_timeout_s=spec.pending_timeout_seconds,
        )

    @classmethod
    def keda_like(cls, min_replicas: int, max_replicas: int, target_per_replica: float) -> PolicyConfig:
        """KEDA's and HPA's defaults: 30 s polling, 300 s cooldown and stabilization, max(4, 100 %)
        per 15 s up, no burst allowance, no headroom, no pending timeout.

        KEDA's Prometheus trigger is an External metric with an ``AverageValue`` target, for which
        HPA computes ``desired = ceil(usage / target)`` from the query's total, whatever the pods'
        readiness (``usage / (target · spec.replicas)`` only decides the tolerance): the same
        recommendation as mixrl's rule 1 with every requested replica counted, which
        ``count_starting=True`` with nothing stuck is."""
        return cls(
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            target_per_replica=target_per_replica,
            tolerance=0.1,
            scale_down_window_s=KEDA_COOLDOWN_PERIOD_S,
            scale_up_pods=HPA_SCALE_UP_PODS,
            scale_up_percent=HPA_SCALE_UP_PERCENT,
            scale_up_period_s=HPA_SCALE_UP_PERIOD_S,
            activation_threshold=0.0,
            burst_ratio=None,
            count_starting=True,
            scale_down_headroom=0.0,
            poll_interval_s=KEDA_POLLING_INTERVAL_S,
            pending_timeout_s=None,
        )


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between polls (the loop also persists it in the pool's status)."""

    recommendations: tuple[tuple[float, int], ...] = ()
    """(time, bounded scale-down recommendation) within the scale-down window, oldest first."""
    scale_ups: tuple[tuple[float, int], ...] = ()
    """(time, replicas added) within the scale-up period, oldest first."""
    targets: tuple[tuple[float, int], ...] = ()
    """(time, replicas finally requested after the fleet step) within the scale-down window: a
    fleet-level cut (budget, objective) goes no lower than their highest (:func:`stabilized_floor`)."""
    pending_since: float | None = None
    """Since when replicas have been requested but not ready with no replica becoming ready."""
    ready_seen: int = 0
    """Ready replicas at the last poll (a rise is progress: it restarts the pending clock)."""
    blocked_until: float | None = None
    """After a pending timeout released replicas, the pool may not grow before this time."""
    released_at: int | None = None
    """Fleet-planned pools (:func:`fleet_pending`): the ready count when a pending timeout last
    released replicas; None once the ready count rose above it (:func:`stuck_until_ready`)."""
    probed_at: float | None = None
    """On probation: when a replica beyond the ready ones was last seen Pending (one probe per
    ``pending_timeout_s``)."""

    @classmethod
    def seeded(cls, now: float, replicas: int) -> PolicyState:
        """The state of a pool the policy has no memory of (an operator restart): its current
        replicas count as a recommendation made now, so nothing is removed before a full window."""
        return cls(recommendations=((now, replicas),), targets=((now, replicas),))


def track_pending(
    state: PolicyState, load: PoolLoad, now: float, config: PolicyConfig
) -> tuple[PolicyState, int]:
    """Rule 8: the state to keep and how many requested replicas are stuck (0: none).

    The cluster's word decides (``load.stuck``).  Without it, a clock: it starts when replicas are
    requested but not ready, and restarts whenever the ready count rises (one replica after another
    coming up is progress).  When it has run ``pending_timeout_s``, every replica still not ready
    is stuck."""
    unready = max(load.replicas - load.ready, 0)
    since = state.pending_since
    if unready == 0:
        since = None
    elif since is None or load.ready > state.ready_seen:
        since = now
    stuck = 0
    if load.stuck is not None:
        stuck = min(load.stuck, unready)
    elif (
        config.pending_timeout_s is not None and since is not None and now - since >= config.pending_timeout_s
    ):
        stuck = unready
    return replace(state, pending_since=since, ready_seen=load.ready), stuck


def stuck_summary(load: PoolLoad, stuck: int, config: PolicyConfig) -> str:
    """Why ``stuck`` replicas were released, for a decision's reason."""
    if load.stuck is None:
        return f"pending timeout: {stuck} not ready after {config.pending_timeout_s:g} s, released"
    return f"{stuck} stuck, released ({load.why_stuck or 'the cluster reports them unable to start'})"


def stuck_until_ready(released_at: int | None, load: PoolLoad, stuck: int) -> tuple[int | None, int]:
    """Rule 8 for a fleet planned as one: replicas released as stuck stay not-capacity until the
    pool's ready count rises.  Returns (the ready count at the release to remember, None once
    something came up; the stuck replicas to count).

    After a pending timeout the pending clock restarts (:func:`pending_ceiling`), so for another
    ``pending_timeout_s`` :func:`track_pending` says nothing is stuck: a replica kept Pending by
    ``minReplicas`` on a pool whose nodes are gone would count as supply again, the objective would
    take the replacing pool's replicas back, and give them again at the next timeout (on the test
    bed: 7 → 5 → 7 every 40 s)."""
    if stuck:
        return load.ready, stuck
    if released_at is not None and load.ready <= released_at:
        # The lowest count since the release: a pool cut further (or a replica lost) that then
        # gets one up has shown that its replicas come up again.
        return load.ready, max(load.replicas - load.ready, 0)
    return None, 0


def pending_ceiling(
    state: PolicyState, current: int, stuck: int, now: float, config: PolicyConfig
) -> tuple[PolicyState, int | None]:
    """Rule 8's cap: with ``stuck`` replicas, the pool keeps only the others (and may not grow for
    ``pending_timeout_s``); while blocked, it keeps its count.  None: no cap."""
    if stuck:
        until = None if config.pending_timeout_s is None else now + config.pending_timeout_s
        blocked = replace(state, blocked_until=until, pending_since=None)
        return blocked, max(config.min_replicas, current - stuck)
    if state.blocked_until is not None and now < state.blocked_until:
        return state, max(current, config.min_replicas)
    return state, None


def fleet_pending(
    state: PolicyState, load: PoolLoad, now: float, config: PolicyConfig
) -> tuple[PolicyState, int, int | None]:
    """Rule 8 for a pool the fleet step plans (``objective: trainer``): the state to keep, the
    requested replicas that are not capacity, and the cap on the pool now (None: none).

    :func:`track_pending`, :func:`pending_ceiling`, then :func:`stuck_until_ready`, in that order;
    the built-in loop and the trainer-coupled simulator both call this, so the simulator's figures
    come from the rule the operator applies."""
    state, stuck = track_pending(state, load, now, config)
    if state.released_at is not None and stuck and load.replicas - load.ready <= 1:
        # The probe of a pool on probation waits where it is: a Pending pod with no node costs
        # nothing, starts as soon as the nodes are back, and ends the probation then.  Releasing
        # it and asking again a pending timeout later made a reversal per timeout while the nodes
        # stayed gone (bench/autoscaling.py, the spot runs).
        kept = max(config.min_replicas, load.replicas)
        return replace(state, probed_at=state.probed_at or now), load.replicas - load.ready, kept
    state, ceiling = pending_ceiling(state, load.replicas, stuck, now, config)
    released_at, stuck = stuck_until_ready(state.released_at, load, stuck)
    if released_at is not None:
        # On probation until a replica comes up: the pool does not grow.  Once the block of
        # pending_ceiling is over, growth would put Pending replicas where the nodes are gone and
        # the fill would count them as supply for the poll that orders them, cut the replacing
        # pools after the window and start over at the next timeout (the trainer-coupled model's
        # run 7 went 4 -> 14 -> 4 b200 replicas, h200 8 -> 1 -> 8, in 20 minutes).  One replica is
        # the probe: a pool with none pending may ask for one more (it counts as stuck, not as
        # supply, from the next poll); the ones ``minReplicas`` keeps Pending are probes already.
        # At most one probe per pending timeout: one the plan stops wanting goes before it times
        # out, and must not come straight back.
        probed_at = state.probed_at
        if load.replicas > load.ready:
            probed_at = now if probed_at is None else probed_at
            probe = load.replicas
        elif (
            probed_at is None
            or config.pending_timeout_s is None
            or now - probed_at >= config.pending_timeout_s
        ):
            probed_at, probe = None, load.replicas + 1
        else:
            probe = load.replicas
        cap = max(config.min_replicas, probe)
        ceiling = cap if ceiling is None else min(ceiling, cap)
        return replace(state, released_at=released_at, probed_at=probed_at), stuck, ceiling
    return replace(state, released_at=None, probed_at=None), stuck, ceiling


def stabilized_floor(state: PolicyState, current: int, now: float, window_s: float) -> int:
    """The fewest replicas a fleet-level cut may leave this poll: the highest target requested
    within the window, at most the current count (a cut waits for the window, as rule 6 does)."""
    recent = [r for t, r in state.targets if t > now - window_s]
    return min(current, max(recent, default=0))


def record_target(state: PolicyState, target: int, now: float, window_s: float) -> PolicyState:
    """Remember the replicas finally requested this poll (for :func:`stabilized_floor`)."""
    kept = tuple((t, r) for t, r in state.targets if t > now - window_s)
    return replace(state, targets=(*kept, (now, target)))


@dataclass(frozen=True)
class Decision:
    current: int
    desired: int
    reason: str
    recommendation: int | None
    """The bounded recommendation before rate limits, stabilization and holds (None: no metrics)."""
    ratio: float | None = None
    state: PolicyState = field(default_factory=PolicyState)
    """The state to pass to the next call."""
    ceiling: int | None = None
    """Set when rule 8 capped the pool (stuck replicas released, growth blocked): the fleet step
    (budget, objective) must not give it more than this now."""

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def _recommend(load: PoolLoad, config: PolicyConfig, stuck: int = 0) -> tuple[int, float | None, str]:
    """Rules 1–3: the unbounded recommendation, the ratio it came from, and why (``stuck``
    replicas, rule 8, are not capacity)."""
    assert load.load is not None
    demand, target, current = load.load, config.target_per_replica, load.replicas
    if current == 0:
        if demand > config.activation_threshold:
            return (
                max(1, _ceil(demand / target)),
                None,
                (f"activation: load {demand:g} > threshold {config.activation_threshold:g}"),
            )
        return 0, None, f"idle: load {demand:g} ≤ activation threshold {config.activation_threshold:g}"
    if config.min_replicas == 0 and demand <= config.activation_threshold:
        return 0, None, f"idle: load {demand:g} ≤ activation threshold {config.activation_threshold:g}"

    if config.count_starting:
        base = load.ready + load.starting - stuck
        if base <= 0 and stuck:
            return max(1, _ceil(demand / target)), None, f"none of {current} requested replicas became ready"
        if base == 0:
            base = current  # nothing measured yet: every requested replica is on its way
        ratio = demand / (target * base)
        if abs(ratio - 1) <= config.tolerance:
            return current, ratio, f"ratio {ratio:.2f} within tolerance {config.tolerance:g}"
        if ratio > 1 and load.sustained is not None:
            sustained = load.sustained / (target * base)
            if sustained <= 1 + config.tolerance:
                return current, ratio, f"spike: ratio {ratio:.2f}, but {sustained:.2f} over the last minute"
        on_way = f" (+{load.starting} starting)" if load.starting else ""
        return _ceil(demand / target), ratio, f"ratio {ratio:.2f} over {load.ready} ready{on_way}"

    # HPA over a per-ready-replica average: desired = ceil(current · (load / ready) / target).
    if load.ready == 0:
        return current, None, "no ready replica to measure; holding"
    ratio = demand / (target * load.ready)
    if abs(ratio - 1) <= config.tolerance:
        return current, ratio, f"ratio {ratio:.2f} within tolerance {config.tolerance:g}"
    return _ceil(current * ratio), ratio, f"ratio {ratio:.2f} per ready replica × {current} current"


def _down_recommendation(load: PoolLoad, config: PolicyConfig) -> int:
    """Rule 6: the fewest replicas that keep the headroom at this load (what the window remembers)."""
    assert load.load is not None
    demand, current = load.load, load.replicas
    if config.min_replicas == 0 and demand <= config.activation_threshold:
        return 0
    headroom = config.tolerance if config.scale_down_headroom is None else config.scale_down_headroom
    padded = demand * (1 + headroom)
    if config.count_starting:
        return _ceil(padded / config.target_per_replica)
    if load.ready == 0:
        return current
    return _ceil(current * padded / (config.target_per_replica * load.ready))


def _clamp(value: int, config: PolicyConfig) -> int:
    return min(config.max_replicas, max(config.min_replicas, value))


def _scale_up_limit(state: PolicyState, current: int, now: float, config: PolicyConfig) -> int:
    """HPA's rate limit: from the replicas at the start of the period, + pods or + percent."""
    added = sum(n for t, n in state.scale_ups if t > now - config.scale_up_period_s)
    start = max(0, current - added)
    return max(start + config.scale_up_pods, _ceil(start * (1 + config.scale_up_percent / 100)))


def decide(load: PoolLoad, state: PolicyState, config: PolicyConfig, now: float) -> Decision:
    """One poll of one pool: the desired replica count, the reason, and the next state."""
    current = load.replicas
    if load.load is None:
        held = current if config.fallback_replicas is None else config.fallback_replicas
        why = "metrics unavailable: " + (
            "holding" if config.fallback_replicas is None else f"fallbackReplicas {held}"
        )
        desired = _clamp(held, config)
        if desired < current and load.updating_weights and current <= config.max_replicas:
            desired, why = current, why + "; held during weight update"
        # Rule 8 needs no Prometheus: a pool whose nodes are gone has no engine left to export a
        # load, so its query has no series, and holding kept its stuck replicas (and pinned them
        # in the GPU budget) for as long as the nodes stayed away.
        state, stuck = track_pending(state, load, now, config)
        state, ceiling = pending_ceiling(state, current, stuck, now, config)
        if ceiling is not None and desired > ceiling:
            desired = ceiling
            why += "; " + (
                stuck_summary(load, stuck, config) if stuck else "growth blocked after a pending timeout"
            )
        return Decision(current, desired, why, None, None, state, ceiling)

    state, stuck = track_pending(state, load, now, config)
    raw, ratio, why = _recommend(load, config, stuck)
    recommendation = _clamp(raw, config)
    if recommendation != raw:
        bound = "maxReplicas" if raw > recommendation else "minReplicas"
        why += f"; bounded by {bound} {recommendation}"

    window_start = now - config.scale_down_window_s
    down = max(_down_recommendation(load, config), recommendation)
    if load.sustained is not None:
        down = max(down, _down_recommendation(replace(load, load=load.sustained), config))
    down = _clamp(down, config)
    history = (*((t, r) for t, r in state.recommendations if t > window_start), (now, down))
    desired = recommendation
    if recommendation > current:
        limit = _scale_up_limit(state, current, now, config)
        bursting = config.burst_ratio is not None and (ratio is None or ratio >= config.burst_ratio)
        if recommendation > limit:
            if bursting:
                why += f"; burst: ratio ≥ {config.burst_ratio:g} lifts the rate limit {limit}"
            else:
                desired = limit
                why += (
                    f"; rate limited to {limit} (max(+{config.scale_up_pods}, {config.scale_up_percent:g} %))"
                )
    elif recommendation < current:
        stabilized = max(r for _, r in history)
        if stabilized > recommendation:
            desired = min(current, stabilized)
            why += f"; stabilized at {desired} (highest with headroom in {config.scale_down_window_s:g} s)"
        if desired < current and load.updating_weights:
            desired = current
            why += "; held during weight update"

    # Bounds win over every hold: a lowered maxReplicas applies at once.
    bounded = _clamp(desired, config)
    if bounded != desired:
        why += f"; bounded to {bounded}"
        desired = bounded

    # Rule 8: stuck replicas are released (they serve nothing); the pool waits before growing.
    state, ceiling = pending_ceiling(state, current, stuck, now, config)
    if ceiling is not None and desired > ceiling:
        desired = ceiling
        if stuck:
            why += "; " + stuck_summary(load, stuck, config)
        else:
            why += "; growth blocked after a pending timeout"

    period_start = now - config.scale_up_period_s
    scale_ups = tuple((t, n) for t, n in state.scale_ups if t > period_start)
    if desired > current:
        scale_ups += ((now, desired - current),)
    next_state = replace(state, recommendations=history, scale_ups=scale_ups)
    return Decision(
        current, desired, f"{current} → {desired}: {why}", recommendation, ratio, next_state, ceiling
    )


# ----------------------------------------------------------------------------- global GPU budget


@dataclass(frozen=True)
class BudgetRequest:
    """One pool's per-pool decision and what a replica costs and serves."""

    name: str
    desired: int
    min_replicas: int
    max_replicas: int
    capacity: float
    gpus_per_replica: int
    cost_per_gpu_hour: float | None
    floor: int = 0
    """The fewest replicas a cut may leave now (:func:`stabilized_floor`: cuts wait for the window)."""
    ceiling: int | None = None
    """The most replicas the pool may have now (None: ``max_replicas``); a pool whose metrics are
    missing is pinned (floor = ceiling = its replicas), one after a pending timeout is capped."""

    @property
    def pinned(self) -> bool:
        return self.ceiling is not None and self.floor >= self.ceiling

    @property
    def low(self) -> int:
        return min(max(self.min_replicas, self.floor), self.high)

    @property
    def high(self) -> int:
        return (
            self.max_replicas
            if self.ceiling is None
            else max(self.min_replicas, min(self.max_replicas, self.ceiling))
        )

    @property
    def cost_per_capacity_hour(self) -> float:
        """Dollars per hour per unit of capacity: proportional to the cost per token.
        Unknown prices sort last (used only when priced pools cannot cover the demand)."""
        if self.cost_per_gpu_hour is None:
            return math.inf
        return self.cost_per_gpu_hour * self.gpus_per_replica / self.capacity


@dataclass(frozen=True)
class Allocation:
    replicas: int
    reason: str


def allocate_gpu_budget(requests: Sequence[BudgetRequest], gpu_budget: int) -> dict[str, Allocation]:
    """Share ``gpu_budget`` GPUs among pools, cheapest capacity first.

    The demand is the capacity the pools asked for together, ``Σ desired · capacity``; every pool
    first gets its ``minReplicas`` (a hard bound, even over budget) and its ``floor`` (what the
    scale-down window still holds; floors are given up dearest first when they do not fit), then
    the cheapest pools are filled up to their ceiling until the demand is covered or the budget is
    spent.  The router sends sessions in proportion to ready capacity, so load follows the replicas
    to the cheap pools.
    """
    if gpu_budget <= 0:
        raise ValueError(f"gpu_budget: must be > 0, got {gpu_budget}")
    names = [r.name for r in requests]
    if len(set(names)) != len(names):
        raise ValueError(f"requests: duplicate pool names in {names}")
    demand = sum(r.desired * r.capacity for r in requests)
    replicas = {r.name: r.low for r in requests}
    over_budget = sum(r.min_replicas * r.gpus_per_replica for r in requests) > gpu_budget
    for request in sorted(requests, key=lambda r: (-r.cost_per_capacity_hour, r.name)):
        excess = sum(replicas[r.name] * r.gpus_per_replica for r in requests) - gpu_budget
        if excess <= 0 or request.gpus_per_replica == 0:
            continue
        give_up = min(replicas[request.name] - request.min_replicas, _ceil(excess / request.gpus_per_replica))
        replicas[request.name] -= max(0, give_up)
    used = sum(replicas[r.name] * r.gpus_per_replica for r in requests)
    have = sum(replicas[r.name] * r.capacity for r in requests)
    for request in sorted(requests, key=lambda r: (r.cost_per_capacity_hour, r.name)):
        if have >= demand - _CEIL_EPSILON:
            break
        room = request.high - replicas[request.name]
        needed = _ceil((demand - have) / request.capacity)
        affordable = (
            room if request.gpus_per_replica == 0 else (gpu_budget - used) // request.gpus_per_replica
        )
        add = max(0, min(room, needed, affordable))
        replicas[request.name] += add
        used += add * request.gpus_per_replica
        have += add * request.capacity
    out: dict[str, Allocation] = {}
    for request in requests:
        n = replicas[request.name]
        if over_budget:
            why = f"minReplicas alone exceed the GPU budget {gpu_budget}"
        elif n < request.desired:
            why = f"budget: {n} of {request.desired} (cheaper pools cover the demand or GPUs ran out)"
        elif n > request.desired:
            why = f"budget: {n} for {request.desired} (cheap capacity takes load from dearer pools)"
        else:
            why = "budget: as desired"
        out[request.name] = Allocation(n, why)
    return out


def budget_step(
    own: BudgetRequest,
    others: Sequence[BudgetRequest],
    state: PolicyState,
    current: int,
    now: float,
    window_s: float,
    gpu_budget: int,
) -> tuple[Allocation, BudgetRequest, PolicyState]:
    """One pool's share of the budget, its cuts stabilized: the allocation made without floors is
    remembered (:func:`record_target`) and the pool keeps at least the highest of the window
    (:func:`stabilized_floor`) — unless the budget itself is exceeded, which wins.  Returns the
    allocation, the request to remember (with its floor) and the state."""
    unfloored = [r if r.pinned else replace(r, floor=0) for r in others if r.name != own.name]
    raw = allocate_gpu_budget([*unfloored, own], gpu_budget)[own.name].replicas
    state = record_target(state, raw, now, window_s)
    if not own.pinned:
        own = replace(own, floor=stabilized_floor(state, current, now, window_s))
    rest = [r for r in others if r.name != own.name]
    return allocate_gpu_budget([*rest, own], gpu_budget)[own.name], own, state
