"""A trainer-coupled fleet model: rollout sessions, back-pressure, a trainer, sampler pools.

What ``bench/autoscaling.py`` runs to compare autoscaling strategies on an RL run.  A model, not
the system; one-second steps, fluid where counts are large, deterministic for a seed:

- **Rollout**: at most ``concurrency`` sessions at once (one trajectory each); a new one starts
  only while buffered plus in-flight trajectories stay below ``max_steps_ahead × step_size`` (the
  workers' back-pressure).  The router puts new sessions on pools in proportion to ready capacity
  and keeps them there, moving a pool's sessions when it has no ready replica.  The sessions of a
  replica that dies or is removed stay in its pool (the router binds them to another of its ready
  replicas), so a pool that lost replicas holds more than its share; each second the model asks
  the router's own rule (``mixrl.rl.router.shares.drain_step``: ``keeps_draining`` with its
  capacity-loss bookkeeping; the pool furthest below its share from ``rebalance_destination``)
  whether the pool sheds, and moves sessions one at a time while it says so: from 1.5× its share
  after a loss down to 1.1×.  The router moves a session at its next request; the model moves it
  at once.
- **Samplers**: a ready replica of capacity ``c`` generates ``tokens_per_s_per_capacity · c``
  tokens/s while it has at least ``sessions_per_capacity · c`` sessions, proportionally less with
  fewer; a trajectory needs ``tokens_per_trajectory`` tokens, which grows linearly over the run
  (longer responses) with ±``length_noise`` per minute.  New replicas serve after the GPU type's
  cold start (±10 %); a removed replica stops at once (its sessions go back to the router).
- **Trainer**: takes ``step_size`` trajectories (oldest first) once they are buffered, computes for
  ``step_seconds`` (a schedule: the trainer rate may change mid-run), publishes a version; every
  pool then pauses to take it, for as long as its engines stop generating
  (``TrainerRun.pause_seconds``, :class:`mixrl.sim.weight_pause.WeightPause`): an SGLang pool on
  the disk path for the whole load (assumed 20 s: no GPU measurement), a staged pool (mixrl's torch
  engine; a BF16 pool on the trainer's broadcast) for ``pause_decode_steps`` decode steps.  The
  model's decode step is ``sessions_per_capacity / tokens_per_s_per_capacity`` (16 ms with the
  defaults): a replica of capacity ``c`` runs ``sessions_per_capacity · c`` sessions at
  ``tokens_per_s_per_capacity · c`` tokens/s, each session one token per step, and with fewer
  sessions each still gets the same rate, so the step is the same for every pool and load.  A
  pause shorter than the one-second tick removes that share of the tick's generation and is billed
  as paused for that share (``paused_share``).  ``weight_update_s`` set: every pool pauses that
  long (the model before issue #29).  Staleness of a trajectory = the trainer's version when it is
  consumed − the version its session started under.
- **Capacity loss**: at ``loss_at_s`` the spot pool loses ``loss_fraction`` of its nodes: replicas
  beyond the nodes left die, and new ones beyond them stay Pending (no node) until ``back_at_s``;
  with ``repeat_every_s`` both recur (repeated preemptions).
  Pending pods without a node are not billed.
- **Quotas**: ``quota`` events cap a pool's replicas from a time on (a ResourceQuota cut, or a
  pool absent from the start at ``-warmup_s``): running replicas stay, new ones beyond the cap stay
  Pending, unbilled, as for lost nodes.
- **Capacity errors**: ``capacity_error`` makes a pool deliver that factor of its declared capacity's
  tokens (a mis-declared ``capacity``).  The router shares sessions by the capacity its own rule
  gives (``mixrl.rl.router.shares.capacity_per_replica``, called): the declared one until the pool
  has been measured with trust (``MIN_CAPACITY_SAMPLES`` health checks of a ready replica, 2 s
  apart), then what it delivers where that is off the declaration by more than ``MISMATCH_FACTOR``.
- **Signal noise** (``noise``, :class:`SignalNoise`): each scrape is missed with a probability, and
  the policy reads the metrics of ``delay_s`` ago, the rates among them (throughput, trainer steps,
  its idle share) times log-normal noise (``sigma``); the system itself is not perturbed (a
  separate random stream), so every strategy runs the same fleet.
- **Cost**: samplers are billed per ready or starting replica-second (``RunResult.cost``); the
  trainer's ``trainer_gpus`` for the whole measured run at ``trainer_price_per_gpu_hour``, fed or
  idle (``RunResult.trainer_cost``), since a run pays for its trainer either way.
- **Signals**: what Prometheus would hold, scraped every 15 s: per pool its sessions (the engines'
  queued + running requests), its busy share per scrape against the replicas ready then, and the
  trajectories it delivered over five minutes per ready replica-second of the same five minutes
  (the loop's queries); the buffer's backlog, the sessions in flight, trainer steps/s and its idle
  share over five minutes.  The policy is the loop's own pure code: ``decide`` per pool, or
  ``fleet_pending`` (rule 8) and ``stabilized_plan`` for the fleet.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from mixrl.operator.autoscaling.fleet_objective import (
    FleetPool as ObjectivePool,
)
from mixrl.operator.autoscaling.fleet_objective import (
    ObjectiveConfig,
    ObjectiveMemory,
    TrainerSignals,
    demand_of,
    stabilized_plan,
)
from mixrl.operator.autoscaling.policy import (
    PolicyConfig,
    PolicyState,
    PoolLoad,
    decide,
    fleet_pending,
)
from mixrl.rl.router.shares import (
    MIN_CAPACITY_SAMPLES,
    PoolCapacity,
    balanced_after_refresh,
    capacity_per_replica,
    drain_step,
    rebalance_destination,
)
from mixrl.sim.fleet import FleetPool, count_reversals
from mixrl.sim.weight_pause import WeightPause, decode_step_s, paused_fraction, update_pauses

RATE_WINDOW_S = 300
THROUGHPUT_WINDOW_S = 300
SCRAPE_S = 15


@dataclass(frozen=True)
class SignalNoise:
    """What Prometheus gets wrong: log-normal noise on every rate the policy reads, metrics
    ``delay_s`` late, and a share of scrapes missed (the policy keeps the previous values)."""

    sigma: float = 0.2
    delay_s: int = 30
    miss: float = 0.1


Reading = tuple[np.ndarray, np.ndarray, TrainerSignals]
"""One scrape as the policy reads it: per-pool load, per-pool throughput, the trainer's signals."""


@dataclass(frozen=True)
class TrainerRun:
    hours: float = 4.0
    step_size: int = 1024
    concurrency: int = 1024
    max_steps_ahead: float = 2.0
    step_seconds: tuple[tuple[float, float], ...] = ((0.0, 120.0),)
    """(from second, trainer compute seconds per step), in time order."""
    weight_update_s: float | None = None
    """Set: every pool pauses this long per weight update (the model before issue #29: 20 s).
    None: per pool, from ``pause``."""
    pause: WeightPause = field(default_factory=WeightPause)
    tokens_per_trajectory: tuple[float, float] = (4000.0, 5000.0)
    """At the start and at the end of the run (linear growth between)."""
    length_noise: float = 0.05
    tokens_per_s_per_capacity: float = 1000.0
    sessions_per_capacity: float = 16.0
    spot_pool: str | None = None
    loss_at_s: float | None = None
    loss_fraction: float = 0.5
    back_at_s: float | None = None
    repeat_every_s: float | None = None
    """Set (with ``loss_at_s`` and ``back_at_s``): the loss and the return recur this often, as spot
    preemptions do."""
    cold_start_s: float | None = None
    """Set: every pool's cold start in seconds (±10 %), e.g. a new GPU node's 10–12 minutes;
    None: each pool's own (``FleetPool.cold_start_s``)."""
    quota: tuple[tuple[float, str, int], ...] = ()
    """(second, pool, most replicas) events: the pool's replicas capped from then on."""
    capacity_error: Mapping[str, float] = field(default_factory=dict)
    """Pool -> delivered ÷ declared capacity (1: as declared)."""
    noise: SignalNoise | None = None
    warmup_s: int = 3600
    """Simulated before the measurement starts (the fleet settles)."""
    trainer_gpus: int = 0
    """The trainer's GPUs (nodes × gpusPerNode), billed for the whole run, fed or idle."""
    trainer_price_per_gpu_hour: float = 0.0
    """Dollars per trainer GPU-hour (``simulate.trainer_from_spec``: the price table the operator's
    live status bills the trainer at)."""

    @property
    def decode_step_s(self) -> float:
        """The model's decode step: one session's token rate is ``tokens_per_s_per_capacity /
        sessions_per_capacity`` (a replica's rate over its sessions at saturation, and the same per
        session below it), one token per step."""
        return decode_step_s(self.tokens_per_s_per_capacity / self.sessions_per_capacity)

    def pause_seconds(self, pools: Sequence[FleetPool]) -> np.ndarray:
        """Seconds each pool generates nothing per weight update (:func:`~mixrl.sim.weight_pause.update_pauses`)."""
        return update_pauses(pools, self.weight_update_s, self.pause, self.decode_step_s)

    def recurs(self, now: float, first: float) -> bool:
        """Whether an availability event first at ``first`` happens at ``now``."""
        if self.repeat_every_s is None:
            return now == first
        return now >= first and (now - first) % self.repeat_every_s == 0

    def step_seconds_at(self, t: float) -> float:
        current = self.step_seconds[0][1]
        for start, seconds in self.step_seconds:
            if t >= start:
                current = seconds
        return current


@dataclass(frozen=True)
class Strategy:
    name: str
    kind: str
    """``trainer`` (the objective), ``queue`` (per-pool policy), ``static``."""
    configs: Mapping[str, PolicyConfig] | None = None
    objective: ObjectiveConfig | None = None
    static_replicas: Mapping[str, int] | None = None
    static_schedule: tuple[tuple[float, Mapping[str, int]], ...] = ()
    """``static``: (second, replicas) re-sizings after the start (a fleet re-sized with hindsight)."""
    demand_shares: Mapping[str, float] | None = None
    """``queue`` with a trainer-demand trigger (KEDA on mixrl's metrics): each pool's load is the
    replicas its share of the trainer's demand needs at its measured rate per replica, times its
    target; None: the engines' queue (the naive trigger)."""
    poll_s: int = 30
    window_s: float = 300.0
    sustained: bool = True
    """``queue``: the policy also sees the load's one-minute average (mixrl's spike confirmation);
    False for KEDA, which has none."""
    reads_pods: bool = True
    """The policy hears from the cluster which replicas are stuck (mixrl's loop reads the pods:
    a replica Pending for want of a node is stuck, a cold start is not); False for KEDA and HPA,
    which read metrics only."""


@dataclass
class RunResult:
    strategy: str
    pools: tuple[str, ...]
    seconds: float
    steps: int
    idle_s: float
    cost: float
    staleness: dict[int, int]
    actions: list[tuple[float, str, int, int]]
    gpus_max: int
    gpu_seconds_over_budget: float
    step_times: list[float]
    times: np.ndarray
    replicas: np.ndarray
    cost_rate: np.ndarray
    backlog: np.ndarray
    recommended_concurrency: int | None = None
    loss_at_s: float | None = None
    trainer_cost: float = 0.0
    """Dollars the trainer's GPUs cost over the measured run (``cost`` is the samplers' alone)."""
    sessions: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    """Live sessions per pool at each sample (``times``), a row per sample."""
    sessions_rebalanced: float = 0.0
    """Sessions the router's rebalancing moved off pools that lost replicas (measured run)."""
    extra: dict[str, float] = field(default_factory=dict)
    """Where the cost per step goes: ``dollars_per_capacity_hour`` (billed), ``paused_share`` (of
    billed capacity-seconds, weight updates), ``busy_share`` (tokens generated over what the
    unpaused billed capacity could), ``tokens_per_step`` (generated ÷ steps).  Their product,
    ``dollars_per_capacity_hour / 3600 × tokens_per_step / (tokens_per_s_per_capacity × (1 −
    paused_share) × busy_share)``, is the cost per step."""

    @property
    def steps_per_hour(self) -> float:
        return self.steps / self.seconds * 3600

    @property
    def idle_share(self) -> float:
        return self.idle_s / self.seconds

    @property
    def cost_per_step(self) -> float:
        """Sampler dollars per trainer step."""
        return self.cost / self.steps if self.steps else math.inf

    @property
    def total_cost(self) -> float:
        """Samplers plus the trainer."""
        return self.cost + self.trainer_cost

    @property
    def total_cost_per_step(self) -> float:
        """Trainer and sampler dollars per trainer step: an idle trainer's hours count too."""
        return self.total_cost / self.steps if self.steps else math.inf

    def staleness_quantile(self, q: float) -> float:
        total = sum(self.staleness.values())
        if not total:
            return 0.0
        seen = 0
        for value in sorted(self.staleness):
            seen += self.staleness[value]
            if seen >= q * total:
                return float(value)
        return float(max(self.staleness))

    def reversals(self, window_s: float = 600.0) -> int:
        return count_reversals(self.actions, window_s)

    @property
    def reversals_per_hour(self) -> float:
        return self.reversals() / self.seconds * 3600

    def time_to_regain(self, share: float = 0.95, window_s: float = 900.0) -> float | None:
        """Seconds from the capacity loss until the trainer's step rate over ``window_s`` is back to
        ``share`` of what it was before the loss (None: no loss; inf: never)."""
        if self.loss_at_s is None:
            return None
        times = np.array(self.step_times)
        before = ((times > self.loss_at_s - window_s) & (times <= self.loss_at_s)).sum()
        if before == 0:
            return math.inf
        for t in np.arange(self.loss_at_s + 60, self.seconds + 1, 30.0):
            recent = ((times > t - window_s) & (times <= t)).sum()
            if t - window_s >= self.loss_at_s and recent >= share * before:
                return float(t - window_s - self.loss_at_s) if t - window_s > self.loss_at_s else 0.0
        return math.inf


Progress = Callable[[str, float, float], None]


def simulate_run(
    pools: Sequence[FleetPool],
    run: TrainerRun,
    strategy: Strategy,
    *,
    seed: int = 0,
    gpu_budget: int | None = None,
    sample_every_s: int = 60,
) -> RunResult:
    """One strategy over one run; see the module docstring for the model."""
    rng = np.random.default_rng(seed)
    n = len(pools)
    names = tuple(p.name for p in pools)
    cap = np.array([p.capacity for p in pools])
    price = np.array([p.gpus_per_replica * p.cost_per_gpu_hour / 3600 for p in pools])
    gpus = np.array([p.gpus_per_replica for p in pools])
    if strategy.static_replicas is not None:
        desired = np.array([strategy.static_replicas[p.name] for p in pools], dtype=np.int64)
    else:
        desired = np.array([max(p.min_replicas, 0) for p in pools], dtype=np.int64)
        if desired.sum() == 0:
            desired[int(np.argmin(price / cap))] = 1
    ready = desired.copy()
    starting: list[list[float]] = [[] for _ in range(n)]
    cold_starts = [run.cold_start_s if run.cold_start_s is not None else p.cold_start_s for p in pools]
    # (ready at, seconds it took) of each replica started: what the pods' census learns from
    # (mixrl.operator.autoscaling.replicas: the median over the pool's pods that became Ready).
    started: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    nodes = np.full(n, np.iinfo(np.int64).max // 4, dtype=np.int64)
    delivered = cap * np.array([run.capacity_error.get(p.name, 1.0) for p in pools])
    # The router's capacity per replica: declared until measured with trust (module docstring).
    route_cap, trusted = cap.copy(), np.zeros(n, dtype=bool)
    ready_seconds_seen = np.zeros(n)
    noise_rng = np.random.default_rng(seed + 7919)  # the metrics' errors: not the fleet's stream
    history: deque[Reading] = deque(maxlen=max(1, (run.noise.delay_s if run.noise else 0) // SCRAPE_S + 1))
    last_reading: Reading | None = None
    schedule = list(strategy.static_schedule)
    spot = names.index(run.spot_pool) if run.spot_pool is not None else None

    sessions = np.zeros(n)  # fluid sessions per pool
    session_versions: list[deque[list[float]]] = [deque() for _ in range(n)]  # [version, count]
    progress = np.zeros(n)  # fractional trajectories completed, carried over
    buffer: deque[list[float]] = deque()  # [version, count]
    buffered = 0.0
    version = 0
    trainer_busy_until: float | None = None
    pause_s = run.pause_seconds(pools)
    pause_start = -math.inf  # the second the latest weight update's pause began
    total = run.warmup_s + int(run.hours * 3600)
    noise = np.exp(rng.normal(0.0, run.length_noise, total // 60 + 2))

    completions: deque[np.ndarray] = deque(maxlen=THROUGHPUT_WINDOW_S)
    ready_seconds: deque[np.ndarray] = deque(maxlen=THROUGHPUT_WINDOW_S)
    step_log: list[float] = []
    all_steps: list[float] = []  # including the warm-up: what Prometheus would have seen
    busy_log: deque[tuple[float, float]] = deque()  # (time, trainer compute seconds of a step)
    idle_log: deque[float] = deque()
    states = {p.name: PolicyState() for p in pools}
    objective_memory = ObjectiveMemory()
    actions: list[tuple[float, str, int, int]] = []
    staleness: dict[int, int] = {}
    steps = 0
    idle_s = cost = over_budget = 0.0
    # Where the cost per step goes (RunResult.extra): billed capacity-seconds, the part of them
    # paused by weight updates, and the tokens generated.
    billed_capacity_s = paused_capacity_s = generated = 0.0
    gpus_max = 0
    recommended = None
    samples: dict[str, list] = {"times": [], "replicas": [], "cost_rate": [], "backlog": []}
    signals = TrainerSignals(None, None, None, None)
    per_pool_load = np.zeros(n)
    load_scrapes: deque[np.ndarray] = deque(maxlen=RATE_WINDOW_S // SCRAPE_S)
    ready_scrapes: deque[np.ndarray] = deque(maxlen=RATE_WINDOW_S // SCRAPE_S)
    per_pool_throughput = np.zeros(n)
    # The router's rebalancing state per pool (RouterState: Pool.draining, Pool.balanced_count).
    draining = [False] * n
    balanced = ready.copy()
    rebalanced = 0.0
    samples["sessions"] = []

    def set_replicas(i: int, target: int, now: float) -> None:
        current = int(desired[i])
        if target == current:
            return
        if target > current:
            for _ in range(target - current):
                if ready[i] + len(starting[i]) >= nodes[i]:
                    starting[i].append(math.inf)  # Pending: no node
                else:
                    took = cold_starts[i] * rng.uniform(0.9, 1.1)
                    bisect.insort(starting[i], now + took)
                    started[i].append((now + took, took))
        else:
            remove = current - target
            # Pending ones first (latest first), then ready replicas; their sessions go back.
            drop = min(remove, len(starting[i]))
            if drop:
                del starting[i][-drop:]
            kill = remove - drop
            if kill:
                ready[i] -= kill  # its sessions stay in the pool (see the rebalancing below)
        desired[i] = target
        actions.append((now, pools[i].name, current, target))

    for tick in range(total):
        now = float(tick - run.warmup_s)
        recording = now >= 0
        # capacity loss and return
        if spot is not None and run.loss_at_s is not None and run.recurs(now, run.loss_at_s):
            have = int(ready[spot] + sum(1 for s in starting[spot] if s != math.inf))
            nodes[spot] = max(0, math.floor(have * (1 - run.loss_fraction)))
            if ready[spot] > nodes[spot]:
                kill = int(ready[spot] - nodes[spot])
                ready[spot] -= kill  # their sessions stay in the pool, for the router to rebalance
                starting[spot] = [math.inf] * kill + [s for s in starting[spot]]
                starting[spot].sort()
            spot_room = int(nodes[spot] - ready[spot])
            starting[spot] = sorted(s if k < spot_room else math.inf for k, s in enumerate(starting[spot]))
        if spot is not None and run.back_at_s is not None and run.recurs(now, run.back_at_s):
            nodes[spot] = np.iinfo(np.int64).max // 4
            starting[spot] = sorted((now + cold_starts[spot] if s == math.inf else s) for s in starting[spot])
        for at, pool_name, most in run.quota:
            if now == at:
                i = names.index(pool_name)
                nodes[i] = most  # running ones stay; new ones beyond stay Pending
                free = int(nodes[i] - ready[i])
                starting[i] = sorted(s if k < free else math.inf for k, s in enumerate(starting[i]))
        for i in range(n):
            while starting[i] and starting[i][0] <= now:
                starting[i].pop(0)
                ready[i] += 1
        # the router: sessions of a pool with no ready replica move
        ready_seconds_seen += ready > 0
        now_trusted = ready_seconds_seen >= MIN_CAPACITY_SAMPLES * ROUTER_HEALTH_INTERVAL_S
        if (now_trusted != trusted).any():
            trusted = now_trusted
            route_cap = _router_capacity(names, cap, delivered * run.tokens_per_s_per_capacity, trusted)
        ready_cap = ready * route_cap
        if ready_cap.sum() > 0:
            for i in np.flatnonzero((ready == 0) & (sessions > 0)).tolist():
                moved = sessions[i]
                cohort = _take(session_versions[i], moved)
                sessions[i] = 0
                share = ready_cap / ready_cap.sum()
                for j in np.flatnonzero(share > 0):
                    sessions[j] += moved * share[j]
                    for v, c in cohort:
                        _put(session_versions[j], v, c * share[j])
            # ...and a pool that lost ready replicas sheds by the router's own rule
            shed = _rebalance(sessions, session_versions, ready, ready_cap, names, draining, balanced)
            if recording:
                rebalanced += shed
        # the rollout: new sessions under the concurrency and the back-pressure
        in_flight = float(sessions.sum())
        room = min(run.concurrency - in_flight, run.max_steps_ahead * run.step_size - buffered - in_flight)
        if room >= 1 and ready_cap.sum() > 0:
            share = ready_cap / ready_cap.sum()
            for j in np.flatnonzero(share > 0):
                sessions[j] += room * share[j]
                _put(session_versions[j], version, room * share[j])
        # generation
        length = np.interp(max(now, 0), [0, run.hours * 3600], run.tokens_per_trajectory) * noise[tick // 60]
        done = np.zeros(n)
        # The share of this second each pool's weight update pauses: read before the trainer below
        # may start one, so the second that generated is not billed as paused too.
        paused = paused_fraction(pause_s, now - pause_start)
        if (paused < 1).any():
            # An engine's slots are its declared capacity's, whatever it delivers.
            busy = np.minimum(1.0, sessions / np.maximum(ready * cap * run.sessions_per_capacity, 1e-9))
            tokens = ready * delivered * run.tokens_per_s_per_capacity * busy * (1.0 - paused)
            progress += tokens / length
            if recording:
                generated += float(tokens.sum())
            done = np.where(paused < 1, np.minimum(np.floor(progress), np.floor(sessions)), 0.0)
            progress -= done
            for i in np.flatnonzero(done).tolist():
                for v, c in _take(session_versions[i], done[i]):
                    _put(buffer, v, c)
                sessions[i] -= done[i]
                buffered += done[i]
        completions.append(done)
        ready_seconds.append(ready.copy())
        # the trainer
        if trainer_busy_until is not None and now >= trainer_busy_until:
            trainer_busy_until = None
            version += 1
            # This second generated already: the pause starts with the next one.
            pause_start = now + 1
            all_steps.append(now)
            if recording:
                steps += 1
                step_log.append(now)
        if trainer_busy_until is None:
            if buffered >= run.step_size:
                for v, c in _take(buffer, run.step_size):
                    if recording:
                        key = int(version - v)
                        staleness[key] = staleness.get(key, 0) + round(c)
                buffered -= run.step_size
                trainer_busy_until = now + run.step_seconds_at(now)
                busy_log.append((now, run.step_seconds_at(now)))
            elif recording:
                idle_s += 1
                idle_log.append(now)
            else:
                idle_log.append(now)
        while idle_log and idle_log[0] <= now - RATE_WINDOW_S:
            idle_log.popleft()
        # bill
        billed = ready + np.array([sum(1 for s in st if s != math.inf) for st in starting])
        if recording:
            cost += float((billed * price).sum())
            billed_capacity_s += float((billed * cap).sum())
            if paused.any():
                paused_capacity_s += float((billed * cap * paused).sum())
            used = int((desired * gpus).sum())
            gpus_max = max(gpus_max, used)
            if gpu_budget is not None and used > gpu_budget:
                over_budget += 1
        # scrape
        if tick % SCRAPE_S == 0:
            per_pool_load = sessions.copy()
            load_scrapes.append(per_pool_load)
            ready_scrapes.append(ready.copy())
            # As the loop reads it (promql.pool_rate_per_replica_query): delivered over the window
            # per ready replica-second of the same span, times the replicas ready now.
            per_replica = np.sum(completions, axis=0) / np.maximum(np.sum(ready_seconds, axis=0), 1e-9)
            per_pool_throughput = per_replica * ready
            recent_steps = len(_recent(all_steps, now))
            window = min(RATE_WINDOW_S, tick) or 1
            while busy_log and busy_log[0][0] <= now - RATE_WINDOW_S and len(busy_log) > 1:
                busy_log.popleft()
            signals = TrainerSignals(
                step_rate=recent_steps / window if tick >= RATE_WINDOW_S else None,
                idle_share=len(idle_log) / window,
                buffered=buffered,
                in_flight=float(sessions.sum()),
                busy_step_s=float(np.mean([b for _, b in busy_log])) if busy_log else None,
            )
            if run.noise is not None:
                last_reading = _noisy(
                    run.noise, noise_rng, history, last_reading, (per_pool_load, per_pool_throughput, signals)
                )
                per_pool_load, per_pool_throughput, signals = last_reading
                load_scrapes[-1] = per_pool_load
        # poll
        while schedule and schedule[0][0] <= now:
            _, replicas = schedule.pop(0)
            for i, p in enumerate(pools):
                set_replicas(i, replicas[p.name], now)
        if strategy.kind != "static" and tick % strategy.poll_s == 0:
            targets = _poll(
                strategy, pools, desired, ready, starting, per_pool_load, per_pool_throughput, signals,
                states, objective_memory, now, now < pause_start + pause_s, gpu_budget, load_scrapes,
                ready_scrapes, [_learned_cold_start(log, now) for log in started], route_cap,
            )  # fmt: skip
            if strategy.kind == "trainer":
                targets, objective_memory, recommended = targets
            for i, p in enumerate(pools):
                set_replicas(i, targets[p.name], now)
        if recording and tick % sample_every_s == 0:
            samples["times"].append(now)
            samples["replicas"].append(desired.copy())
            samples["cost_rate"].append(float((billed * price).sum() * 3600))
            samples["backlog"].append((buffered + float(sessions.sum())) / run.step_size)
            samples["sessions"].append(sessions.copy())
    return RunResult(
        strategy=strategy.name,
        pools=names,
        seconds=run.hours * 3600,
        steps=steps,
        idle_s=idle_s,
        cost=cost,
        staleness=staleness,
        actions=[a for a in actions if a[0] >= 0],
        gpus_max=gpus_max,
        gpu_seconds_over_budget=over_budget,
        step_times=step_log,
        times=np.array(samples["times"]),
        replicas=np.array(samples["replicas"]),
        cost_rate=np.array(samples["cost_rate"]),
        backlog=np.array(samples["backlog"]),
        recommended_concurrency=recommended,
        loss_at_s=run.loss_at_s if spot is not None else None,
        trainer_cost=run.trainer_gpus * run.trainer_price_per_gpu_hour * run.hours,
        sessions=np.array(samples["sessions"]).reshape(len(samples["sessions"]), n),
        sessions_rebalanced=rebalanced,
        extra={
            "dollars_per_capacity_hour": cost / max(billed_capacity_s, 1e-9) * 3600,
            "paused_share": paused_capacity_s / max(billed_capacity_s, 1e-9),
            "busy_share": generated
            / max((billed_capacity_s - paused_capacity_s) * run.tokens_per_s_per_capacity, 1e-9),
            "tokens_per_step": generated / max(steps, 1),
        },
    )


def _rebalance(
    sessions: np.ndarray,
    versions: list[deque[list[float]]],
    ready: np.ndarray,
    ready_cap: np.ndarray,
    names: tuple[str, ...],
    draining: list[bool],
    balanced: np.ndarray,
) -> float:
    """The router's rebalancing after a capacity loss, one second of it; returns the sessions moved.

    The rule and its bookkeeping are the router's, called, not copied: ``balanced_after_refresh``
    (``balanced`` rises with ``ready``: the router's share refresh, which sees every change of
    ``ready``; this runs every second, after them), ``drain_step`` (``keeps_draining`` with the
    capacity loss counted from ``balanced``, as ``RouterState._shed_to`` calls it) and
    ``rebalance_destination``.  Sessions move one at a time to the pool furthest below its share, as
    the router moves them (at each one's next request), until the rule says stop."""
    for i in range(len(names)):
        balanced[i] = balanced_after_refresh(int(balanced[i]), int(ready[i]))
    total = float(sessions.sum())
    if total <= 0 or ready_cap.sum() <= 0:
        return 0.0
    shares = dict(zip(names, (ready_cap / ready_cap.sum()).tolist(), strict=True))
    moved = 0.0
    for i, name in enumerate(names):
        fair = shares[name] * total
        draining[i], balanced[i] = drain_step(
            draining[i], int(balanced[i]), int(ready[i]), round(sessions[i]), fair
        )
        while draining[i]:
            held = {other: round(sessions[k]) for k, other in enumerate(names)}
            destination = rebalance_destination(held, shares, name)
            if destination is None:
                break
            j = names.index(destination)
            step = min(1.0, float(sessions[i]))
            for v, c in _take(versions[i], step):
                _put(versions[j], v, c)
            sessions[i] -= step
            sessions[j] += step
            moved += step
            # The router looks again at the next session's request (ready and the total unchanged).
            draining[i], balanced[i] = drain_step(
                True, int(balanced[i]), int(ready[i]), round(sessions[i]), fair
            )
    return moved


def _noisy(
    noise: SignalNoise,
    rng: np.random.Generator,
    history: deque[Reading],
    last: Reading | None,
    truth: Reading,
) -> Reading:
    """One scrape as the policy reads it: the metrics of ``delay_s`` ago times log-normal noise, or,
    when the scrape is missed, ``last`` (what it read before)."""
    history.append(truth)  # as long as the delay: history[0] is the reading from delay_s ago
    if last is not None and rng.random() < noise.miss:
        return last
    load, throughput, late = history[0]

    def jitter(value: float | None) -> float | None:
        return None if value is None else value * float(np.exp(rng.normal(0.0, noise.sigma)))

    # Rates (a counter's increase over a window that scrapes land in unevenly) carry the noise;
    # gauges (the engines' requests, the buffer, the trainer's seconds per step) are exact, only late.
    idle = jitter(late.idle_share)
    return (
        load,
        throughput * np.exp(rng.normal(0.0, noise.sigma, len(throughput))),
        replace(late, step_rate=jitter(late.step_rate), idle_share=None if idle is None else min(1.0, idle)),
    )


def _recent(log: list[float], now: float) -> list[float]:
    start = bisect.bisect_right(log, now - RATE_WINDOW_S)
    return log[start:]


def _put(fifo: deque[list[float]], version: float, count: float) -> None:
    if count <= 0:
        return
    if fifo and fifo[-1][0] == version:
        fifo[-1][1] += count
    else:
        fifo.append([version, count])


def _take(fifo: deque[list[float]], count: float) -> list[tuple[float, float]]:
    """Remove ``count`` from the oldest cohorts; returns (version, count) taken."""
    out = []
    while count > 1e-9 and fifo:
        head = fifo[0]
        take = min(head[1], count)
        out.append((head[0], take))
        head[1] -= take
        count -= take
        if head[1] <= 1e-9:
            fifo.popleft()
    return out


ROUTER_HEALTH_INTERVAL_S = 2.0
"""The router's health-check period (``mixrl.rl.router.server``'s default): one throughput sample each."""


def _router_capacity(
    names: Sequence[str], declared: np.ndarray, tokens_per_s: np.ndarray, trusted: np.ndarray
) -> np.ndarray:
    """Capacity per replica as the router shares by it, the pools measured with trust being those in
    ``trusted`` (their measurement: what a full replica delivers, ``tokens_per_s``)."""
    pools = {
        name: PoolCapacity(
            float(declared[i]),
            float(tokens_per_s[i]) if trusted[i] else None,
            1,
            MIN_CAPACITY_SAMPLES if trusted[i] else 0,
        )
        for i, name in enumerate(names)
    }
    per_replica = capacity_per_replica(pools)
    return np.array([per_replica[name] for name in names])


def _learned_cold_start(started: list[tuple[float, float]], now: float, last: int = 20) -> float | None:
    """The median time to Ready of the pool's last ``last`` replicas that are Ready by ``now``."""
    seen = [took for ready_at, took in started if ready_at <= now][-last:]
    return float(np.median(seen)) if seen else None


def _unschedulable(starts: list[float]) -> int:
    """Replicas Pending for want of a node (start time ∞): the scheduler reports them
    Unschedulable; the others are cold starts."""
    return sum(1 for start in starts if start == math.inf)


def _poll(
    strategy: Strategy,
    pools: Sequence[FleetPool],
    desired: np.ndarray,
    ready: np.ndarray,
    starting: list[list[float]],
    load: np.ndarray,
    throughput: np.ndarray,
    signals: TrainerSignals,
    states: dict[str, PolicyState],
    memory: ObjectiveMemory,
    now: float,
    updating: np.ndarray,
    gpu_budget: int | None,
    load_scrapes: deque[np.ndarray],
    ready_scrapes: deque[np.ndarray],
    cold_starts: Sequence[float | None],
    routed: np.ndarray,
):
    mean_load = np.mean(load_scrapes, axis=0) if load_scrapes else load
    if strategy.kind == "queue":
        assert strategy.configs is not None
        minute = list(load_scrapes)[-(60 // SCRAPE_S) :]
        sustained = np.mean(minute, axis=0) if strategy.sustained and minute else None
        out = {}
        demand = None
        if strategy.demand_shares is not None:
            assert strategy.objective is not None
            demand = demand_of(signals, strategy.objective, signals.busy_step_s)
        for i, p in enumerate(pools):
            pool_load: float | None = float(load[i])
            if strategy.demand_shares is not None:
                # The replicas the pool's share of the trainer's demand needs at its measured rate
                # per ready replica (no reading without a ready replica: KEDA holds then).
                rate = throughput[i] / ready[i] if ready[i] else 0.0
                pool_load = (
                    None
                    if demand is None or rate <= 0
                    else demand
                    * strategy.demand_shares[p.name]
                    / rate
                    * strategy.configs[p.name].target_per_replica
                )
            observed = PoolLoad(
                load=pool_load,
                sustained=None if sustained is None or demand is not None else float(sustained[i]),
                replicas=int(desired[i]),
                ready=int(ready[i]),
                starting=len(starting[i]),
                updating_weights=bool(updating[i]),
                stuck=_unschedulable(starting[i]) if strategy.reads_pods else None,
            )
            decision = decide(observed, states[p.name], strategy.configs[p.name], now)
            states[p.name] = decision.state
            out[p.name] = decision.desired
        return out
    assert strategy.objective is not None and strategy.configs is not None
    # What avg_over_time(clamp_max(load / slots, 1)[5m:15s]) says: each scrape against the
    # replicas ready at that scrape (promql.pool_busy_query).
    # The objective sees each pool with the capacity the router shares by, as the operator does
    # (mixrl.operator.autoscaling.plan.as_routed): its slots and its busy share follow it.
    per_slot = routed * strategy.objective.sessions_per_capacity
    busy_share = (
        np.mean(
            [
                np.minimum(1.0, s / np.maximum(r * per_slot, 1e-9))
                for s, r in zip(load_scrapes, ready_scrapes, strict=True)
            ],
            axis=0,
        )
        if load_scrapes
        else np.ones(len(pools))
    )
    views = []
    for i, p in enumerate(pools):
        config = strategy.configs[p.name]
        observed = PoolLoad(
            load=float(load[i]),
            replicas=int(desired[i]),
            ready=int(ready[i]),
            starting=len(starting[i]),
            stuck=_unschedulable(starting[i]) if strategy.reads_pods else None,
        )
        states[p.name], stuck, ceiling = fleet_pending(states[p.name], observed, now, config)
        views.append(
            ObjectivePool(
                p.name,
                int(desired[i]),
                int(ready[i]),
                float(routed[i]),
                p.gpus_per_replica,
                p.cost_per_gpu_hour,
                config.min_replicas,
                config.max_replicas,
                throughput=float(throughput[i]) if ready[i] else None,
                load=float(mean_load[i]),
                busy_share=float(busy_share[i]),
                stuck=stuck,
                floor=int(desired[i]) if updating[i] else 0,
                ceiling=ceiling,
                cold_start_s=cold_starts[i],
            )
        )
    objective = (
        strategy.objective if gpu_budget is None else replace(strategy.objective, gpu_budget=gpu_budget)
    )
    plan, next_states = stabilized_plan(views, signals, objective, memory, states, now, strategy.window_s)
    states.update(next_states)
    return plan.targets, plan.memory, plan.recommended_concurrency


# ----------------------------------------------------------------------------- strategies


def static_sized_to_trainer(
    pools: Sequence[FleetPool], run: TrainerRun, at_s: float = 0.0, limits: Mapping[str, int] | None = None
) -> dict[str, int]:
    """A fixed fleet sized to the trainer at ``at_s`` (the start: the AReaL / verl way): the capacity
    whose saturated throughput equals the trainer's consumption, on the cheapest capacity first,
    each pool at most ``limits`` (the nodes or quota it has then) and its maximum.

    Engines generate nothing while they take a version, so a pool's capacity counts for the share
    of a step it is not paused (``run.pause_seconds``); the cheapest is per such capacity.  Never
    more capacity than the rollout's concurrency keeps busy."""
    step_s = run.step_seconds_at(at_s)
    tokens = float(np.interp(at_s, [0, run.hours * 3600], run.tokens_per_trajectory))
    need_tokens = run.step_size / step_s * tokens
    need = need_tokens / run.tokens_per_s_per_capacity
    limit = run.concurrency / run.sessions_per_capacity
    serving = {
        p.name: max(1e-9, 1 - float(s) / step_s) * run.capacity_error.get(p.name, 1.0)
        for p, s in zip(pools, run.pause_seconds(pools), strict=True)
    }
    most = {p.name: min(p.max_replicas, (limits or {}).get(p.name, p.max_replicas)) for p in pools}
    out = {p.name: min(p.min_replicas, most[p.name]) for p in pools}
    have = sum(out[p.name] * p.capacity for p in pools)
    useful = sum(out[p.name] * p.capacity * serving[p.name] for p in pools)
    order = sorted(
        pools, key=lambda p: p.gpus_per_replica * p.cost_per_gpu_hour / (p.capacity * serving[p.name])
    )
    for pool in order:
        while useful < need - 1e-9 and have < limit - 1e-9 and out[pool.name] < most[pool.name]:
            out[pool.name] += 1
            have += pool.capacity
            useful += pool.capacity * serving[pool.name]
    return out


def hindsight_schedule(
    pools: Sequence[FleetPool], run: TrainerRun, every_s: float = 3600.0
) -> tuple[dict[str, int], tuple[tuple[float, Mapping[str, int]], ...]]:
    """The static fleet re-sized with perfect foresight: at every change of the run (trainer step
    time, a spot loss or return, a quota) and every ``every_s`` (responses grow), sized for the phase
    as it will be — its step time, its mean response length, the nodes and quotas it will have, the
    capacities pools really deliver.  Returns the start's replicas and the re-sizings after it."""
    end = run.hours * 3600
    events = {0.0, *(t for t, _ in run.step_seconds if 0 < t < end)}
    events |= {t for t in np.arange(every_s, end, every_s).tolist()}
    outages: list[tuple[float, float]] = []
    if run.spot_pool is not None and run.loss_at_s is not None:
        back = run.back_at_s if run.back_at_s is not None else math.inf
        outages.append((run.loss_at_s, back))
        while run.repeat_every_s is not None and outages[-1][0] + run.repeat_every_s < end:
            lost, back = outages[-1]
            outages.append((lost + run.repeat_every_s, back + run.repeat_every_s))
        events |= {t for outage in outages for t in outage if 0 < t < end}
    events |= {t for t, _, _ in run.quota if 0 < t < end}
    start = static_sized_to_trainer(pools, run)
    times = sorted(events)
    sized: list[tuple[float, Mapping[str, int]]] = []
    for phase_start, phase_end in zip(times, [*times[1:], end], strict=True):
        middle = (phase_start + phase_end) / 2
        limits: dict[str, int] = {}
        if any(lost <= middle < back for lost, back in outages) and run.spot_pool is not None:
            limits[run.spot_pool] = math.floor(start[run.spot_pool] * (1 - run.loss_fraction))
        for at, pool_name, most in run.quota:
            if at <= middle:
                limits[pool_name] = min(limits.get(pool_name, most), most)
        sized.append(
            (
                phase_start,
                static_sized_to_trainer(
                    pools,
                    replace(run, step_seconds=((0.0, run.step_seconds_at(phase_start)),)),
                    middle,
                    limits,
                ),
            )
        )
    return dict(sized[0][1]), tuple(sized[1:])


def objective_config(run: TrainerRun, **overrides: float) -> ObjectiveConfig:
    values = dict(
        step_size=run.step_size,
        concurrency=run.concurrency,
        sessions_per_capacity=run.sessions_per_capacity,
        max_steps_ahead=run.max_steps_ahead,
    )
    values.update(overrides)
    return ObjectiveConfig(**values)  # type: ignore[arg-type]
