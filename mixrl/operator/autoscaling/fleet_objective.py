"""The RL-aware fleet objective (``autoscaling.objective: trainer``): pure functions, no I/O.

In an RL run the rollout workers *create* the samplers' load (``rollout.concurrency`` sessions
each), so a per-replica load target settles wherever the concurrency puts it, whatever the trainer
needs.  This objective sizes the whole fleet to the trainer instead:

    minimise  Σ pools  replicas · gpusPerReplica · price          (sampler dollars per hour)
    such that trainer idle share ≤ trainerIdleTarget
              minStepsAhead ≤ (buffered + in flight) / step size ≤ rollout.maxStepsAhead
              Σ replicas · gpusPerReplica ≤ gpuBudget,  Σ dollars per hour ≤ costBudgetPerHour

- **Demand** (trajectories/s): the trainer's consumption at full speed, ``step size / busy seconds
  per step``, times (1 − idle target), corrected by the backlog's distance from the band over
  ``horizon_s`` (inside the band: none).  The busy seconds per step are what the buffer measures
  (``TrainerSignals.busy_step_s``: from handing out a batch to the trainer's next request, so a
  starved trainer's waits do not read as a slow trainer); without that series,
  (1 − idle share) / measured steps per second; either is smoothed over polls (:data:`EMA_WEIGHT`).
- **Supply**: each pool's measured trajectories/s per ready replica, divided by the share of its
  slots the rollout kept busy over the same window (back-pressure and a small concurrency leave
  replicas partly idle; a weight update's pause is real and stays in).  Pools without a
  measurement (at zero) are estimated from the others per unit of capacity.
- **Fill**: from each pool's floor (its minimum, or what the scale-down window still holds), pools
  are filled by dollars per hour per unit of routed capacity (``FleetPool.capacity``: the capacity
  the router shares sessions by, :func:`mixrl.operator.autoscaling.plan.as_routed`) until supply
  covers demand, within their ceilings and
  the budgets; what the raw fill leaves out is emptied most-expensive first once the window lets
  it go (:func:`mixrl.operator.autoscaling.policy.stabilized_floor`).  Pools at zero are woken here.
- **Plan ahead**: a trainer speeding up (its busy seconds per step falling over the last
  :data:`TREND_WINDOW_S`) would outrun a fleet that only follows it, since a new replica serves
  only after its cold start.  So the demand planned for is the one the trend projects one cold
  start ahead (the longest a pool has learned, ``FleetPool.cold_start_s``; at most
  :data:`TREND_WINDOW_S` ahead and :data:`AHEAD_MOST` times today's), when that is beyond the
  band.  A trainer slowing down is followed, not anticipated: shedding early would be undone by
  the next wobble.
- **Dead band**: while the current supply is within ``tolerance`` of the demand nothing moves, so
  a steady run — sampler-bound or trainer-bound — makes no reversals.  While the trainer idles
  more than its target, the band's lower half shrinks to :data:`STARVING_BAND` of the tolerance:
  the idle allowance and the band do not stack (the demand already leaves the trainer its idle
  target, so a supply up to a full tolerance short of it idled the trainer that much longer).
- **Re-mix**: inside the band, the cheapest mix that covers the demand (the fill from the pools'
  minimums) replaces a dearer one when it saves at least :data:`REMIX_SAVING` of the fleet's
  dollars per hour and the saving repays, within ``remix_payback_s``, paying for both mixes for
  ``move_overlap_s`` (the new replicas' cold start, the old ones held by the scale-down window).
  Only the growth is planned here; the dearer pools are cut later by the fill, when the supply is
  above the band and their window lets them go.  This is how a pool that lost replicas to a
  preemption regrows once its nodes are back (its probe came up).
- **Stall guard**: a trainer that has idled beyond its target for ``stall_after_s`` while the plan
  held (the estimates say the supply covers the demand: they are optimistic) gets one more replica
  of the cheapest pool that can grow, and the clock starts again; when no pool can grow the plan
  says why (:attr:`FleetPlan.stalled`: every pool at its maximum, a budget, the rollout's
  concurrency, replicas the cluster cannot start).
- **Concurrency**: replicas beyond what ``concurrency / sessionsPerCapacity`` can keep busy are
  waste, so the fill stops there, and :attr:`FleetPlan.recommended_concurrency` says what the
  rollout would need.  The rollout's concurrency is fixed when its workers start (an asyncio
  semaphore), so it is reported, not applied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from mixrl.operator.autoscaling.policy import PolicyState, record_target, stabilized_floor

_EPS = 1e-9
EMA_WEIGHT = 0.2
"""Weight of a new measurement in the per-replica throughput estimate."""
STARVING_BAND = 0.2
"""The share of the band's lower half kept while the trainer idles above its target.  Half let the
trainer idle 5.8 % against a 5 % target at 10x the fleet (bench/autoscaling.py run 23), and
missed run 19 even from the target on; none made a pool that loses its nodes every hour reverse twice an hour
(run 14) and a noisy trainer 1.25 times (run 18)."""
MIN_BUSY_SHARE = 0.2
"""A pool busy less than this share of its slots over the window teaches nothing about its speed."""
REMIX_SAVING = 0.1
"""The least share of the fleet's dollars per hour a re-mix inside the band must save."""
TREND_WINDOW_S = 900.0
"""How far back the trainer's speed is fitted for the plan ahead, and the furthest it looks ahead."""
TREND_MIN_SPAN_S = 300.0
"""The least span of measurements the trend is fitted to (one slow poll is not a trend)."""
AHEAD_MOST = 2.0
"""The plan ahead's demand is at most this multiple of today's trainer consumption."""
REMIX_COLD_START_S = 600.0
"""The cold start a re-mix's overlap assumes for its new replicas (a model load on a warm node;
a new GPU node takes 10–12 minutes)."""


@dataclass(frozen=True)
class FleetPool:
    """One pool as the objective sees it at one poll."""

    name: str
    replicas: int
    """Requested now (``spec.replicas``)."""
    ready: int
    capacity: float
    gpus_per_replica: int
    price_per_gpu_hour: float
    min_replicas: int
    max_replicas: int
    throughput: float | None = None
    """Trajectories per second the pool delivered over the rate window; None: not measured."""
    load: float | None = None
    """Queued plus running requests on its engines averaged over the same window (the queue
    policy's signal): how busy the rollout kept its ready replicas while ``throughput`` was measured."""
    busy_share: float | None = None
    """The share of its slots kept busy, averaged per scrape over the same window (better than
    ``load``: a burst that overfills the slots and then leaves them idle averages to a full load
    but a half-busy pool); None: from ``load``."""
    stuck: int = 0
    """Requested replicas past the pending timeout: not capacity."""
    floor: int = 0
    """The fewest replicas it may keep now (window, weight update); at most ``replicas``."""
    ceiling: int | None = None
    """The most it may have now (pending timeout); None: ``max_replicas``."""
    cold_start_s: float | None = None
    """Seconds its replicas took to become Ready, as learned (``status.coldStartSeconds``); None:
    none seen yet."""

    @property
    def high(self) -> int:
        top = self.max_replicas if self.ceiling is None else min(self.max_replicas, self.ceiling)
        return max(self.min_replicas, top)

    @property
    def probing(self) -> bool:
        """Rule 8's standing probe (:func:`mixrl.operator.autoscaling.policy.fleet_pending`): its
        stuck replica is capped in, not released — kept Pending until the nodes are back, and not
        counted as supply meanwhile."""
        return self.stuck > 0 and self.ceiling is not None and self.ceiling >= self.replicas

    @property
    def low(self) -> int:
        kept = self.replicas if self.probing else 0
        return min(max(self.min_replicas, self.floor, kept), self.high)


@dataclass(frozen=True)
class TrainerSignals:
    """The run-wide series (one Prometheus query each; None: no answer)."""

    step_rate: float | None
    """Trainer steps per second (``rate(mixrl_buffer_batches_total[w])``)."""
    idle_share: float | None
    """Share of time the trainer waited for a batch (``rate(mixrl_buffer_trainer_wait_seconds_total[w])``)."""
    buffered: float | None
    """Trajectories waiting in the buffer (``sum(mixrl_buffer_trajectories)``)."""
    in_flight: float | None
    """Trajectories being generated (``sum(mixrl_router_sessions)``: one session per episode)."""
    busy_step_s: float | None = None
    """Seconds the trainer computed per step, its wait left out (``avg_over_time`` of
    ``mixrl_buffer_trainer_busy_seconds``); None: derived from ``step_rate`` and ``idle_share``."""


@dataclass(frozen=True)
class ObjectiveConfig:
    step_size: int
    """Trajectories per trainer step (promptsPerUpdate × samplesPerPrompt)."""
    concurrency: int
    """Rollout sessions at once, all workers together."""
    sessions_per_capacity: float
    """Sessions one replica of capacity 1 keeps busy (the run's targetPerReplica)."""
    idle_target: float = 0.05
    min_steps_ahead: float = 1.0
    max_steps_ahead: float | None = 2.0
    """The rollout's back-pressure; None: none (no upper end of the band)."""
    tolerance: float = 0.1
    horizon_s: float = 300.0
    """The backlog's distance from the band is closed over this long."""
    gpu_budget: int | None = None
    cost_budget_per_hour: float | None = None
    stall_after_s: float = 600.0
    """A trainer idle beyond its target this long with nothing changing gets an action or a reason."""
    move_overlap_s: float = REMIX_COLD_START_S + 300.0
    """How long a re-mix pays for both mixes: a cold start of the new replicas plus the scale-down
    window that holds the old ones (HPA's 300 s by default)."""
    remix_payback_s: float = 3600.0
    """A re-mix is made only when its saving repays the overlap within this long."""
    plan_ahead: bool = True
    """Plan for the demand a speeding-up trainer will have one cold start ahead (module docstring);
    False follows the trainer only (the benchmark's comparison)."""

    def __post_init__(self) -> None:
        checks = [
            ("step_size", self.step_size > 0, "must be > 0"),
            ("concurrency", self.concurrency > 0, "must be > 0"),
            ("sessions_per_capacity", self.sessions_per_capacity > 0, "must be > 0"),
            ("idle_target", 0 <= self.idle_target < 1, "must be in [0, 1)"),
            ("min_steps_ahead", self.min_steps_ahead >= 0, "must be ≥ 0"),
            ("tolerance", 0 <= self.tolerance < 1, "must be in [0, 1)"),
            ("horizon_s", self.horizon_s > 0, "must be > 0"),
            ("stall_after_s", self.stall_after_s > 0, "must be > 0"),
            ("move_overlap_s", self.move_overlap_s >= 0, "must be ≥ 0"),
            ("remix_payback_s", self.remix_payback_s > 0, "must be > 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"ObjectiveConfig.{name}: {why}, got {getattr(self, name)}")

    @property
    def useful_capacity(self) -> float:
        """The most capacity the rollout's sessions keep busy."""
        return self.concurrency / self.sessions_per_capacity


@dataclass(frozen=True)
class ObjectiveMemory:
    """What the objective remembers between polls."""

    rates: Mapping[str, float] = field(default_factory=dict)
    """Pool -> trajectories/s one ready replica delivers when kept busy."""
    busy_step_s: float | None = None
    """Seconds the trainer computes per step (its idle time left out)."""
    starving_since: float | None = None
    """When the trainer began idling beyond its target with no action since."""
    busy_history: tuple[tuple[float, float], ...] = ()
    """(time, ``busy_step_s``) of the polls of the last :data:`TREND_WINDOW_S`: the trend."""


@dataclass(frozen=True)
class FleetPlan:
    targets: dict[str, int]
    reasons: dict[str, str]
    demand: float | None
    """Trajectories/s the fleet should deliver; None: not known yet (held)."""
    supply: float
    """Trajectories/s the targets deliver (estimated)."""
    recommended_concurrency: int | None
    """Rollout sessions the demand needs, when above the configured concurrency."""
    memory: ObjectiveMemory
    summary: str
    filled: bool = False
    """The fill ran (the supply was outside the dead band): ``recommended_concurrency`` None then
    means the concurrency suffices; after a hold or inside the band it means nothing was learnt."""
    stalled: str | None = None
    """The trainer has starved for ``stall_after_s`` and no pool can grow: why not, per pool (None
    otherwise; the full sentence is in ``summary``)."""


def update_memory(
    memory: ObjectiveMemory,
    pools: Sequence[FleetPool],
    signals: TrainerSignals,
    config: ObjectiveConfig,
    now: float | None = None,
) -> ObjectiveMemory:
    """Fold this poll's measurements into the estimates (``now``: the poll's clock, for the trend)."""
    rates = dict(memory.rates)
    for pool in pools:
        if pool.ready <= 0 or pool.throughput is None or pool.throughput <= 0:
            continue
        # What one replica delivers when kept busy: the rollout may have kept it only partly busy
        # (back-pressure, a concurrency that does not fill the fleet), so divide by that share.
        slots = pool.ready * pool.capacity * config.sessions_per_capacity
        busy = 1.0 if pool.load is None else min(1.0, pool.load / slots)
        if pool.busy_share is not None:
            busy = min(1.0, pool.busy_share)
        if busy < MIN_BUSY_SHARE:
            continue  # too idle to tell
        measured = pool.throughput / pool.ready / busy
        old = rates.get(pool.name)
        rates[pool.name] = measured if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * measured
    busy_step = memory.busy_step_s
    measured_busy = signals.busy_step_s
    if (
        measured_busy is None
        and signals.step_rate
        and signals.step_rate > _EPS
        and signals.idle_share is not None
    ):
        measured_busy = (1 - min(max(signals.idle_share, 0.0), 1.0)) / signals.step_rate
    if measured_busy is not None and measured_busy > _EPS:
        busy_step = (
            measured_busy if busy_step is None else (1 - EMA_WEIGHT) * busy_step + EMA_WEIGHT * measured_busy
        )
    history = memory.busy_history
    if now is not None and busy_step is not None:
        # A poll planned twice (stabilized_plan) counts once.
        kept = tuple((t, b) for t, b in history if now - TREND_WINDOW_S <= t < now)
        history = (*kept, (now, busy_step))
    return replace(memory, rates=rates, busy_step_s=busy_step, busy_history=history)


def busy_trend(history: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of the trainer's busy seconds per step over time (s per s); None when
    the measurements span less than :data:`TREND_MIN_SPAN_S`."""
    if len(history) < 3 or history[-1][0] - history[0][0] < TREND_MIN_SPAN_S:
        return None
    mean_t = sum(t for t, _ in history) / len(history)
    mean_b = sum(b for _, b in history) / len(history)
    spread = sum((t - mean_t) ** 2 for t, _ in history)
    return sum((t - mean_t) * (b - mean_b) for t, b in history) / spread


def demand_ahead(
    demand: float, pools: Sequence[FleetPool], config: ObjectiveConfig, memory: ObjectiveMemory
) -> tuple[float, float] | None:
    """(the demand one cold start ahead, that cold start) for a trainer speeding up beyond the
    band; None otherwise (module docstring, *Plan ahead*)."""
    learned = [p.cold_start_s for p in pools if p.cold_start_s]
    busy = memory.busy_step_s
    slope = busy_trend(memory.busy_history)
    if not config.plan_ahead or not learned or busy is None or slope is None or slope >= 0:
        return None
    ahead_s = min(max(learned), TREND_WINDOW_S)
    busy_ahead = max(busy + slope * ahead_s, busy / AHEAD_MOST)
    # Only the trainer's consumption speeds up; the backlog's correction stays as it is.
    consumption = config.step_size * (1 - config.idle_target)
    projected = demand + consumption / busy_ahead - consumption / busy
    if projected <= (1 + config.tolerance) * demand:
        return None  # within the band: the trend is no more than its noise
    return projected, ahead_s


def replica_rates(pools: Sequence[FleetPool], memory: ObjectiveMemory) -> dict[str, float | None]:
    """Trajectories/s per replica, measured or estimated per unit of capacity from the others."""
    known = [(p, memory.rates[p.name]) for p in pools if p.name in memory.rates]
    per_capacity = sum(r for _, r in known) / sum(p.capacity for p, _ in known) if known else None
    out: dict[str, float | None] = {}
    for pool in pools:
        if pool.name in memory.rates:
            out[pool.name] = memory.rates[pool.name]
        else:
            out[pool.name] = None if per_capacity is None else per_capacity * pool.capacity
    return out


def backlog_of(signals: TrainerSignals) -> float | None:
    """Trajectories buffered and in flight; None when either series did not answer.  An unknown
    backlog corrects nothing: read as empty, a Prometheus outage would raise the demand."""
    if signals.buffered is None or signals.in_flight is None:
        return None
    return signals.buffered + signals.in_flight


def demand_of(signals: TrainerSignals, config: ObjectiveConfig, busy_step_s: float | None) -> float | None:
    """Trajectories/s: the trainer's full-speed consumption less the idle it may have, corrected by
    the backlog's distance from the band."""
    if busy_step_s is None:
        return None
    base = config.step_size / busy_step_s * (1 - config.idle_target)
    backlog = backlog_of(signals)
    low = config.min_steps_ahead * config.step_size
    high = math.inf if config.max_steps_ahead is None else config.max_steps_ahead * config.step_size
    correction = 0.0
    if backlog is None:
        pass
    elif backlog < low:
        correction = (low - backlog) / config.horizon_s
    elif backlog > high:
        correction = -(backlog - high) / config.horizon_s
    return max(0.0, base + correction)


def _fits(pools: Sequence[FleetPool], targets: Mapping[str, int], config: ObjectiveConfig) -> bool:
    gpus = sum(targets[p.name] * p.gpus_per_replica for p in pools)
    dollars = sum(targets[p.name] * p.gpus_per_replica * p.price_per_gpu_hour for p in pools)
    if config.gpu_budget is not None and gpus > config.gpu_budget:
        return False
    return config.cost_budget_per_hour is None or dollars <= config.cost_budget_per_hour + _EPS


def fill(
    pools: Sequence[FleetPool], rates: Mapping[str, float | None], demand: float, config: ObjectiveConfig
) -> tuple[dict[str, int], float, float]:
    """Targets covering ``demand`` cheapest throughput first, from the floors; returns the targets,
    their supply and the capacity the demand would need beyond what the concurrency keeps busy."""
    targets = {p.name: p.low for p in pools}
    # Floors over a budget: give them up dearest throughput first, down to the minimums.
    by_cost = sorted(pools, key=lambda p: (_unit_cost(p, rates), p.name))
    for pool in reversed(by_cost):
        while not _fits(pools, targets, config) and targets[pool.name] > pool.min_replicas:
            targets[pool.name] -= 1
    supply = sum(max(0, targets[p.name] - p.stuck) * (rates[p.name] or 0.0) for p in pools)  # stuck: none
    capacity = sum(targets[p.name] * p.capacity for p in pools)
    short = 0.0
    for pool in by_cost:
        rate = rates[pool.name]
        if rate is None or rate <= 0:
            continue
        while supply < demand - _EPS and targets[pool.name] < pool.high:
            if capacity + pool.capacity > config.useful_capacity + _EPS:
                short = (demand - supply) / rate * pool.capacity
                break
            targets[pool.name] += 1
            if not _fits(pools, targets, config):
                targets[pool.name] -= 1
                break
            supply += rate
            capacity += pool.capacity
    return targets, supply, short


def _unit_cost(pool: FleetPool, rates: Mapping[str, float | None]) -> float:
    """The fill's order: dollars per hour per unit of routed capacity (the capacity per replica the
    router shares sessions by: the declared one, or its trusted measurement where that is far off;
    :func:`mixrl.operator.autoscaling.plan.as_routed`), as the GPU budget's.

    The measured rates decide how many replicas cover the demand, not the order: two pools a few
    percent apart would swap places with every wobble of a throughput measurement (a 300 s rate
    of trajectories that each take minutes), and each swap would start one pool's replicas and
    drop another's.  A pool without a measurement or an estimate sorts last."""
    rate = rates[pool.name]
    if rate is None or rate <= 0:
        return math.inf
    return pool.gpus_per_replica * pool.price_per_gpu_hour / pool.capacity


def plan_fleet(
    pools: Sequence[FleetPool],
    signals: TrainerSignals,
    config: ObjectiveConfig,
    memory: ObjectiveMemory,
    now: float | None = None,
) -> FleetPlan:
    """One poll of the whole fleet: every pool's target replicas and why (``now``: the poll's
    clock, for the stall guard and the plan ahead's trend; None: neither)."""
    plan = _plan(pools, signals, config, memory, now)
    return _guard_stall(plan, pools, signals, config, now)


def _plan(
    pools: Sequence[FleetPool],
    signals: TrainerSignals,
    config: ObjectiveConfig,
    memory: ObjectiveMemory,
    now: float | None,
) -> FleetPlan:
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"pools: duplicate names in {names}")
    memory = update_memory(memory, pools, signals, config, now)
    rates = replica_rates(pools, memory)
    demand = demand_of(signals, config, memory.busy_step_s)
    held = {p.name: min(max(p.replicas - p.stuck, p.low), p.high) for p in pools}
    if demand is None or all(r is None for r in rates.values()):
        if all(p.replicas == 0 for p in pools):  # nothing runs: wake the cheapest capacity
            cheapest = min(
                (p for p in pools if p.high > 0),
                key=lambda p: (p.gpus_per_replica * p.price_per_gpu_hour / p.capacity, p.name),
                default=None,
            )
            if cheapest is not None:
                held[cheapest.name] = max(held[cheapest.name], 1)
        why = (
            "no trainer step measured yet: holding"
            if demand is None
            else "no throughput measured yet: holding"
        )
        return FleetPlan(held, dict.fromkeys(names, why), demand, 0.0, None, memory, why)

    supply_now = sum((p.replicas - p.stuck) * (rates[p.name] or 0.0) for p in pools)
    forced = any(held[p.name] != p.replicas for p in pools)
    backlog = backlog_of(signals)
    backlog_text = "unknown: no correction" if backlog is None else f"{backlog / config.step_size:.2f} steps"
    summary = (
        f"demand {demand:.3g} traj/s (trainer {config.step_size} per {memory.busy_step_s:.3g} s busy, "
        f"backlog {backlog_text}), supply {supply_now:.3g}"
    )
    ahead = demand_ahead(demand, pools, config, memory)
    if ahead is not None:
        demand, ahead_s = ahead
        summary += (
            f"; trainer speeding up: planned for {demand:.3g} traj/s, one cold start ({ahead_s:.0f} s) ahead"
        )
    # The trainer itself says whether supply is short: idling above its target means the
    # estimates are optimistic, so the band's lower half shrinks (not to nothing: STARVING_BAND;
    # a starvation that lasts is the stall guard's).
    starving = _starving(signals, config)
    low = (1 - config.tolerance * (STARVING_BAND if starving else 1.0)) * demand
    if not forced and low - _EPS <= supply_now <= (1 + config.tolerance) * demand:
        remix = _remix(pools, rates, demand, config, held)
        if remix is not None:
            targets, why = remix
            reasons = {
                p.name: f"{summary}: {why}"
                if targets[p.name] > held[p.name]
                else f"{summary}: within tolerance"
                for p in pools
            }
            return FleetPlan(targets, reasons, demand, supply_now, None, memory, f"{summary}: {why}")
        return FleetPlan(
            held,
            dict.fromkeys(names, f"{summary}: within tolerance {config.tolerance:g}"),
            demand,
            supply_now,
            None,
            memory,
            summary,
        )
    targets, supply, short = fill(pools, rates, demand, config)
    recommended = None
    if short > 0:
        needed_capacity = sum(targets[p.name] * p.capacity for p in pools) + short
        recommended = math.ceil(needed_capacity * config.sessions_per_capacity)
        summary += (
            f"; rollout concurrency {config.concurrency} keeps only {config.useful_capacity:.3g} capacity "
            f"busy: {recommended} sessions would serve the demand (set rollout.concurrency; it is not"
            " changed live)"
        )
    reasons = {}
    for pool in pools:
        what = "cheapest throughput first" if targets[pool.name] > pool.low else "dearest emptied first"
        if targets[pool.name] == pool.low and pool.low > pool.min_replicas:
            what = "held by the scale-down window"
        reasons[pool.name] = f"{summary}: {what}"
    return FleetPlan(targets, reasons, demand, supply, recommended, memory, summary, filled=True)


def _dollars_per_hour(pools: Sequence[FleetPool], targets: Mapping[str, int]) -> float:
    return sum(targets[p.name] * p.gpus_per_replica * p.price_per_gpu_hour for p in pools)


def _remix(
    pools: Sequence[FleetPool],
    rates: Mapping[str, float | None],
    demand: float,
    config: ObjectiveConfig,
    held: Mapping[str, int],
) -> tuple[dict[str, int], str] | None:
    """The re-mix (module docstring): the held targets with the cheapest mix's growth added, and
    why; None when the cheapest mix does not cover the demand or does not pay."""
    cheapest, supply, _ = fill([replace(p, floor=0) for p in pools], rates, demand, config)
    if supply < demand - _EPS:
        return None
    grown = {p.name: max(held[p.name], cheapest[p.name]) for p in pools}
    if grown == dict(held):
        return None
    now_cost = _dollars_per_hour(pools, held)
    saving = now_cost - _dollars_per_hour(pools, cheapest)
    overlap = _dollars_per_hour(pools, grown) - now_cost
    if saving < REMIX_SAVING * now_cost or not _fits(pools, grown, config):
        return None
    if saving * config.remix_payback_s < overlap * config.move_overlap_s:
        return None
    added = ", ".join(
        f"{p.name} +{grown[p.name] - held[p.name]}" for p in pools if grown[p.name] > held[p.name]
    )
    why = (
        f"re-mix: {added} toward the cheapest mix covering the demand, ${saving:.3g}/h "
        f"({saving / now_cost:.0%}) cheaper once the dearer pools' window lets them go"
    )
    return grown, why


def _starving(signals: TrainerSignals, config: ObjectiveConfig) -> bool:
    idle = signals.idle_share
    return idle is not None and idle > config.idle_target


def _why_not_grown(pool: FleetPool, targets: Mapping[str, int], pools: Sequence[FleetPool],
                   rates: Mapping[str, float | None], config: ObjectiveConfig) -> str | None:  # fmt: skip
    """Why one more replica of ``pool`` cannot help (None: it can)."""
    if targets[pool.name] >= pool.high:
        if pool.ceiling is not None and pool.ceiling < pool.max_replicas:
            return f"{pool.name} held at {pool.ceiling} (replicas the cluster could not start)"
        return f"{pool.name} at its maximum ({pool.max_replicas})"
    if not rates.get(pool.name):
        return f"{pool.name} has no measured or estimated throughput"
    capacity = sum(targets[p.name] * p.capacity for p in pools)
    if capacity + pool.capacity > config.useful_capacity + _EPS:
        return f"{pool.name} would be more than rollout.concurrency keeps busy"
    grown = {**targets, pool.name: targets[pool.name] + 1}
    if not _fits(pools, grown, config):
        return f"{pool.name} would exceed the {'GPU' if config.gpu_budget is not None else 'cost'} budget"
    return None


def _guard_stall(
    plan: FleetPlan,
    pools: Sequence[FleetPool],
    signals: TrainerSignals,
    config: ObjectiveConfig,
    now: float | None,
) -> FleetPlan:
    """The stall guard (see the module's docstring) on top of a poll's plan."""
    if now is None or plan.demand is None:
        return plan
    if not _starving(signals, config):
        return replace(plan, memory=replace(plan.memory, starving_since=None))
    since = plan.memory.starving_since
    # An action under way: the plan grows a pool, or replicas it asked for are still starting (a
    # cold start is not a stall; the clock starts when the last one is ready).
    under_way = any(
        plan.targets[p.name] > p.replicas - p.stuck or p.ready < p.replicas - p.stuck for p in pools
    )
    if since is None or under_way:
        return replace(plan, memory=replace(plan.memory, starving_since=now))
    if now - since < config.stall_after_s:
        return plan
    rates = replica_rates(pools, plan.memory)
    starved = (
        f"trainer idle {signals.idle_share:.0%} (target {config.idle_target:.0%}) for {now - since:.0f} s "
        "with the supply estimated at the demand"
    )
    reasons = {p.name: _why_not_grown(p, plan.targets, pools, rates, config) for p in pools}
    growable = [p for p in pools if reasons[p.name] is None]
    if not growable:
        blocked = "; ".join(r for r in reasons.values() if r)
        why = f"{starved}, and no pool can grow: {blocked}"
        return replace(plan, reasons=dict.fromkeys(plan.reasons, why), summary=why, stalled=blocked)
    cheapest = min(growable, key=lambda p: (_unit_cost(p, rates), p.name))
    targets = {**plan.targets, cheapest.name: plan.targets[cheapest.name] + 1}
    why = f"{starved}: one more replica of {cheapest.name}, the cheapest that can grow (the estimates are optimistic)"
    return replace(
        plan,
        targets=targets,
        reasons={**plan.reasons, cheapest.name: why},
        summary=why,
        memory=replace(plan.memory, starving_since=now),
    )


def with_floors(pools: Sequence[FleetPool], floors: Mapping[str, int]) -> list[FleetPool]:
    return [replace(p, floor=floors.get(p.name, 0)) for p in pools]


def stabilized_plan(
    pools: Sequence[FleetPool],
    signals: TrainerSignals,
    config: ObjectiveConfig,
    memory: ObjectiveMemory,
    states: Mapping[str, PolicyState],
    now: float,
    window_s: float,
) -> tuple[FleetPlan, dict[str, PolicyState]]:
    """:func:`plan_fleet` with cuts that wait for the scale-down window, as the GPU budget's do:
    the plan made from the pools' own floors is remembered per pool (:func:`record_target`) and
    the final plan keeps each pool at least at the highest of the window."""
    # The raw plan ignores every floor, the weight-update hold included: what the window remembers
    # is what the fleet needs, not what a hold kept (or the window would never end).
    raw = plan_fleet(with_floors(pools, {}), signals, config, memory, now)
    next_states = {}
    floors = {}
    for pool in pools:
        state = record_target(states.get(pool.name, PolicyState()), raw.targets[pool.name], now, window_s)
        next_states[pool.name] = state
        floors[pool.name] = max(
            pool.floor, stabilized_floor(state, pool.replicas - pool.stuck, now, window_s)
        )
    return plan_fleet(with_floors(pools, floors), signals, config, memory, now), next_states
