"""A discrete-time fleet model: agent sessions, sampler pools, cold starts, prices, a scaling policy.

This is what ``mixrl simulate`` runs to evaluate the autoscaling policy at cluster scale (thousands
of concurrent sessions, eight pools) that a laptop cannot host.  It is a model, not the system:

- Sessions are closed loops, as RL rollouts are: one LLM request (queued, then served), a tool call,
  the next request…, for a geometric number of turns.  The workload sets how many sessions are
  alive; when it rises, the new sessions arrive at once (a burst, as when a rollout launches the
  samples of new prompts).
- A replica of capacity ``c`` serves up to ``slots_per_capacity · c`` requests at once; a request's
  service time is exponential (mean ``mean_service_s``); waiting requests are served FIFO.
- The router assigns each new session to a pool in proportion to its ready capacity and keeps it
  there.  Prometheus scrapes every ``scrape_interval_s``; the policy sees the last scrape.
- New replicas are ready after the pool's cold start (±10 %); a removed replica stops billing at
  once and its running requests finish (drain).  Every ``weight_update_every_s`` a weight update
  pauses each pool by how its engines take a version (``Workload.pause``,
  :class:`mixrl.sim.weight_pause.WeightPause`): SGLang on the disk path stops serving for the whole
  load (assumed 20 s), a staged engine (mixrl's torch engine; a BF16 pool on the broadcast) for
  two of its decode steps.  A request streams ``tokens_per_request`` tokens over its exponential
  service time (mean ``mean_service_s``), so a decode step lasts ``mean_service_s /
  tokens_per_request`` (20 ms with the defaults).  A pause shorter than the one-second tick slows
  that tick's completions by its share (the service hazard times the unpaused share); only a
  tick paused whole also admits nothing.  ``weight_update_s`` set: every pool pauses that long
  (the model before issue #29).
- Time advances in steps of one second; counts move with binomial draws, so a simulated day takes
  seconds.  Everything is deterministic for a seed.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from mixrl.operator.autoscaling.policy import (
    BudgetRequest,
    PolicyConfig,
    PolicyState,
    PoolLoad,
    budget_step,
    decide,
)
from mixrl.sim.weight_pause import WeightPause, decode_step_s, paused_fraction, update_pauses

MAX_WAIT_BIN_S = 4 * 3600


def count_reversals(actions: Sequence[tuple[float, str, int, int]], window_s: float) -> int:
    """How often a pool's scaling ``actions`` ``(t, pool, before, after)`` turned the other way
    within ``window_s`` of its previous one."""
    count = 0
    last: dict[str, tuple[float, int]] = {}
    for t, pool, before, after in actions:
        direction = 1 if after > before else -1
        previous = last.get(pool)
        if previous is not None and previous[1] != direction and t - previous[0] <= window_s:
            count += 1
        last[pool] = (t, direction)
    return count


@dataclass(frozen=True)
class FleetPool:
    name: str
    gpu_type: str
    capacity: float
    gpus_per_replica: int
    cost_per_gpu_hour: float
    min_replicas: int
    max_replicas: int
    cold_start_s: float
    engine: str = "sglang"
    """``sglang`` or ``torch``: with the precision, how its engines take a weight version
    (:meth:`mixrl.sim.weight_pause.WeightPause.mode`)."""
    weight_precision: str = "bf16"


@dataclass(frozen=True)
class Workload:
    sessions: np.ndarray
    """Sessions alive, one value per simulated second."""
    mean_turns: float = 12.0
    mean_service_s: float = 12.0
    mean_tool_s: float = 6.0
    tokens_per_request: float = 600.0
    slots_per_capacity: int = 24
    weight_update_every_s: float = 900.0
    weight_update_s: float | None = None
    """Set: every pool pauses this long per update (the model before issue #29, 20 s).  None: per
    pool, from ``pause``."""
    pause: WeightPause = field(default_factory=WeightPause)
    warmup_s: int = 1800
    """Leading seconds simulated (at the first value of ``sessions``) but left out of the results."""

    @property
    def decode_step_s(self) -> float:
        """One decode step: a running request gains ``tokens_per_request / mean_service_s`` tokens
        per second, one per step."""
        return decode_step_s(self.tokens_per_request / self.mean_service_s)

    def pause_seconds(self, pools: Sequence[FleetPool]) -> np.ndarray:
        """Seconds each pool serves nothing per weight update (:func:`~mixrl.sim.weight_pause.update_pauses`)."""
        return update_pauses(pools, self.weight_update_s, self.pause, self.decode_step_s)


@dataclass(frozen=True)
class Strategy:
    name: str
    configs: Mapping[str, PolicyConfig] | None = None
    """Per-pool policies; None = static replicas."""
    static_replicas: Mapping[str, int] | None = None
    gpu_budget: int | None = None
    scrape_interval_s: int = 15
    sustained_window_s: int | None = 60
    """The policy also sees the load averaged over this window (PromQL avg_over_time); None: not."""
    reads_pods: bool = True
    """The policy hears from the cluster which replicas are stuck (mixrl's loop reads the pods;
    here every replica gets a node, so none is); False for KEDA and HPA, which read metrics only."""


@dataclass
class SimResult:
    strategy: str
    pools: tuple[str, ...]
    times: np.ndarray
    """Series sample times (s, 0 = end of warm-up)."""
    sessions_target: np.ndarray
    sessions_alive: np.ndarray
    load: np.ndarray
    queued: np.ndarray
    ready_capacity: np.ndarray
    requested_capacity: np.ndarray
    desired: np.ndarray
    """Desired replicas, shape (samples, pools)."""
    ready: np.ndarray
    cost_rate: np.ndarray
    """Dollars per hour at each sample."""
    wait_mean: np.ndarray
    """Mean queue wait of the requests admitted since the previous sample (NaN: none)."""
    wait_histogram: np.ndarray
    """Requests admitted by queue wait in whole seconds (last bin: that or longer)."""
    wait_total_s: float
    requests: int
    tokens: float
    cost: float
    cost_by_pool: dict[str, float]
    gpu_seconds_by_pool: dict[str, float]
    busy_slot_seconds: float
    ready_slot_seconds: float
    sessions_alive_start: int
    sessions_started: int
    sessions_finished: int
    sessions_alive_end: int
    actions: list[tuple[float, str, int, int]] = field(default_factory=list)
    """(time, pool, from, to) for every change of desired replicas."""
    wall_seconds: float = 0.0

    def wait_quantile(self, q: float) -> float:
        counts = self.wait_histogram
        total = counts.sum()
        if total == 0:
            return 0.0
        cumulative = np.cumsum(counts)
        return float(np.searchsorted(cumulative, q * total, side="left"))

    @property
    def wait_mean_s(self) -> float:
        return self.wait_total_s / self.requests if self.requests else 0.0

    @property
    def cost_per_mtok(self) -> float:
        return self.cost / self.tokens * 1e6 if self.tokens else float("inf")

    @property
    def utilization(self) -> float:
        return self.busy_slot_seconds / self.ready_slot_seconds if self.ready_slot_seconds else 0.0

    def flaps(self, window_s: float = 600.0) -> int:
        """Direction reversals of one pool's desired replicas within ``window_s``."""
        return count_reversals(self.actions, window_s)


Progress = Callable[[str, float, float], None]
"""progress(strategy, simulated seconds done, total)."""


class _Fleet:
    """Mutable state of one run; the tick functions below advance it."""

    def __init__(self, pools: Sequence[FleetPool], workload: Workload, strategy: Strategy, seed: int):
        self.pools = pools
        self.workload = workload
        self.strategy = strategy
        self.rng = np.random.default_rng(seed)
        n = len(pools)
        self.capacity = np.array([p.capacity for p in pools])
        self.slots = np.array([max(1, round(workload.slots_per_capacity * p.capacity)) for p in pools])
        self.gpu_price = np.array([p.gpus_per_replica * p.cost_per_gpu_hour / 3600 for p in pools])
        self.gpus = np.array([p.gpus_per_replica for p in pools])
        if strategy.static_replicas is not None:
            initial = [strategy.static_replicas[p.name] for p in pools]
        else:
            initial = [p.min_replicas for p in pools]
        self.ready = np.array(initial, dtype=np.int64)
        self.desired = np.array(initial, dtype=np.int64)
        self.starting: list[list[float]] = [[] for _ in range(n)]
        self.queued = np.zeros(n, dtype=np.int64)
        self.running = np.zeros(n, dtype=np.int64)
        self.tool = np.zeros(n, dtype=np.int64)
        self.alive = np.zeros(n, dtype=np.int64)
        self.fifo: list[deque[list[int]]] = [deque() for _ in range(n)]
        self.seen_load = np.zeros(n)
        keep = 1 + (strategy.sustained_window_s or 0) // strategy.scrape_interval_s
        self.scrapes: deque[np.ndarray] = deque(maxlen=keep)
        self.states = {p.name: PolicyState() for p in pools}
        self.budget_requests: dict[str, BudgetRequest] = {}
        self.actions: list[tuple[float, str, int, int]] = []

    def n_starting(self) -> np.ndarray:
        return np.array([len(s) for s in self.starting], dtype=np.int64)

    def enqueue(self, counts: np.ndarray, now: int) -> None:
        for i in np.flatnonzero(counts):
            fifo = self.fifo[i]
            if fifo and fifo[-1][0] == now:
                fifo[-1][1] += int(counts[i])
            else:
                fifo.append([now, int(counts[i])])
        self.queued += counts

    def admit(self, now: int, histogram: np.ndarray, serving: np.ndarray | None = None) -> tuple[int, float]:
        """Start queued requests where slots are free (on the ``serving`` pools; default all);
        returns (admitted, total wait)."""
        free = self.ready * self.slots - self.running
        admitted, wait_sum = 0, 0.0
        open_ = (free > 0) & (self.queued > 0)
        if serving is not None:
            open_ &= serving
        for i in np.flatnonzero(open_):
            room = int(min(free[i], self.queued[i]))
            fifo, taken = self.fifo[i], 0
            while taken < room:
                head = fifo[0]
                take = min(head[1], room - taken)
                wait = now - head[0]
                histogram[min(wait, MAX_WAIT_BIN_S)] += take
                wait_sum += wait * take
                taken += take
                head[1] -= take
                if head[1] == 0:
                    fifo.popleft()
            self.queued[i] -= room
            self.running[i] += room
            admitted += room
        return admitted, wait_sum

    def route(self, count: int) -> np.ndarray:
        """New sessions by ready capacity (then capacity on its way, then any pool that may scale)."""
        for weights in (
            self.ready * self.capacity,
            (self.ready + self.n_starting()) * self.capacity,
            np.array([p.max_replicas * p.capacity for p in self.pools]),
        ):
            if weights.sum() > 0:
                return self.rng.multinomial(count, weights / weights.sum())
        raise ValueError("pools: every pool has maxReplicas 0; nothing can serve")

    def set_replicas(self, i: int, target: int, now: int) -> None:
        current = int(self.desired[i])
        if target == current:
            return
        pool = self.pools[i]
        if target > current:
            for _ in range(target - current):
                jitter = self.rng.uniform(0.9, 1.1)
                bisect.insort(self.starting[i], now + pool.cold_start_s * jitter)
        else:
            remove = current - target
            # Replicas not serving yet go first (the latest to become ready), then ready ones.
            drop = min(remove, len(self.starting[i]))
            if drop:
                del self.starting[i][-drop:]
            self.ready[i] -= remove - drop
        self.desired[i] = target
        self.actions.append((float(now), pool.name, current, target))

    def poll(self, now: int, updating: np.ndarray) -> None:
        """One poll of the policy; ``updating``: per pool, whether a weight update pauses it."""
        configs = self.strategy.configs
        assert configs is not None
        starting = self.n_starting()
        decided: dict[str, int] = {}
        ceilings: dict[str, int | None] = {}
        sustained = np.mean(self.scrapes, axis=0) if self.strategy.sustained_window_s else None
        for i, pool in enumerate(self.pools):
            load = PoolLoad(
                load=float(self.seen_load[i]),
                sustained=None if sustained is None else float(sustained[i]),
                replicas=int(self.desired[i]),
                ready=int(self.ready[i]),
                starting=int(starting[i]),
                updating_weights=bool(updating[i]),
                stuck=0 if self.strategy.reads_pods else None,
            )
            decision = decide(load, self.states[pool.name], configs[pool.name], float(now))
            self.states[pool.name] = decision.state
            decided[pool.name] = decision.desired
            ceilings[pool.name] = decision.ceiling
        if self.strategy.gpu_budget is not None:
            # The loop's budget step (AutoscalingLoop.apply_budget), pool after pool, each seeing
            # the others' latest requests.
            for i, pool in enumerate(self.pools):
                request = BudgetRequest(
                    pool.name,
                    decided[pool.name],
                    configs[pool.name].min_replicas,
                    configs[pool.name].max_replicas,
                    pool.capacity,
                    pool.gpus_per_replica,
                    pool.cost_per_gpu_hour,
                    ceiling=ceilings[pool.name],
                )
                allocation, self.budget_requests[pool.name], self.states[pool.name] = budget_step(
                    request,
                    list(self.budget_requests.values()),
                    self.states[pool.name],
                    int(self.desired[i]),
                    float(now),
                    configs[pool.name].scale_down_window_s,
                    self.strategy.gpu_budget,
                )
                target = allocation.replicas
                if updating[i] and target < self.desired[i]:
                    target = int(self.desired[i])  # never remove a replica mid-update
                decided[pool.name] = target
        for i, pool in enumerate(self.pools):
            self.set_replicas(i, decided[pool.name], now)


def simulate(
    pools: Sequence[FleetPool],
    workload: Workload,
    strategy: Strategy,
    *,
    seed: int = 0,
    sample_every_s: int = 30,
    progress: Progress | None = None,
) -> SimResult:
    """Run one strategy over the workload; see the module docstring for the model."""
    started_wall = time.perf_counter()
    fleet = _Fleet(pools, workload, strategy, seed)
    warmup = workload.warmup_s
    schedule = np.concatenate([np.full(warmup, workload.sessions[0]), workload.sessions]).astype(np.int64)
    total = len(schedule)
    p_tool = 1.0 - np.exp(-1.0 / workload.mean_tool_s)
    p_done = 1.0 - np.exp(-1.0 / workload.mean_service_s)
    p_end = 1.0 / workload.mean_turns
    poll_s = None
    if strategy.configs is not None:
        polls = {round(c.poll_interval_s) for c in strategy.configs.values()}
        if len(polls) != 1:
            raise ValueError(f"strategy {strategy.name}: pools must share one poll interval, got {polls}")
        poll_s = max(1, polls.pop())

    histogram = np.zeros(MAX_WAIT_BIN_S + 1, dtype=np.int64)
    series: dict[str, list] = {k: [] for k in SERIES_KEYS}
    warmup_histogram = np.zeros_like(histogram)
    requests, wait_total, tokens = 0, 0.0, 0.0
    busy, slot_seconds = 0.0, 0.0
    cost_by_pool = np.zeros(len(pools))
    gpu_seconds = np.zeros(len(pools))
    started = finished = alive_start = 0
    interval_admitted, interval_wait = 0, 0.0
    every = workload.weight_update_every_s
    pause_s = workload.pause_seconds(pools)
    n_pools = len(pools)
    next_report = time.perf_counter() + 1.0
    if progress is not None:
        progress(strategy.name, 0.0, float(total))

    for tick in range(total):
        now = tick - warmup
        recording = now >= 0
        if now == 0:
            alive_start = int(fleet.alive.sum())
        # The share of this second each pool's weight update pauses (updates start at multiples
        # of ``every``; a pause shorter than a second pauses that share of it).
        paused = paused_fraction(pause_s, now % every) if every > 0 and now > 0 else np.zeros(n_pools)
        updating = paused > 0
        whole = bool((paused >= 1).all())
        partial = not whole and bool(updating.any())

        for i, pending in enumerate(fleet.starting):
            while pending and pending[0] <= now:
                pending.pop(0)
                fleet.ready[i] += 1

        back = fleet.rng.binomial(fleet.tool, p_tool)
        fleet.tool -= back
        fleet.enqueue(back, now)

        if not whole:
            if partial:
                # A pool paused for part of the second completes at its unpaused share's hazard.
                p_pool = 1.0 - np.exp(-(1.0 - paused) / workload.mean_service_s)
                done = fleet.rng.binomial(fleet.running, p_pool)
            else:
                done = fleet.rng.binomial(fleet.running, p_done)
            fleet.running -= done
            ended = fleet.rng.binomial(done, p_end)
            fleet.tool += done - ended
            fleet.alive -= ended
            if recording:
                tokens += float(done.sum()) * workload.tokens_per_request
                finished += int(ended.sum())

        deficit = int(schedule[tick] - fleet.alive.sum())
        if deficit > 0:
            new = fleet.route(deficit)
            fleet.alive += new
            fleet.enqueue(new, now)
            if recording:
                started += deficit

        if not whole:
            admitted, waited = fleet.admit(
                now, histogram if recording else warmup_histogram, paused < 1 if partial else None
            )
            if recording:
                requests += admitted
                wait_total += waited
                interval_admitted += admitted
                interval_wait += waited

        if now % strategy.scrape_interval_s == 0:
            fleet.seen_load = (fleet.queued + fleet.running).astype(float)
            fleet.scrapes.append(fleet.seen_load)
        if poll_s is not None and now % poll_s == 0:
            fleet.poll(now, updating)

        if recording:
            billed = fleet.ready + fleet.n_starting()
            cost_by_pool += billed * fleet.gpu_price
            gpu_seconds += billed * fleet.gpus
            busy += float(fleet.running.sum())
            slot_seconds += float((fleet.ready * fleet.slots).sum())
            if now % sample_every_s == 0:
                _sample(series, fleet, now, int(schedule[tick]), interval_admitted, interval_wait)
                interval_admitted, interval_wait = 0, 0.0
        if progress is not None and time.perf_counter() >= next_report:
            progress(strategy.name, float(tick), float(total))
            next_report = time.perf_counter() + 1.0
    if progress is not None:
        progress(strategy.name, 0.0, float(total))

    if progress is not None:
        progress(strategy.name, float(total), float(total))
    return SimResult(
        strategy=strategy.name,
        pools=tuple(p.name for p in pools),
        **{k: np.array(v) for k, v in series.items()},
        wait_histogram=histogram,
        wait_total_s=wait_total,
        requests=requests,
        tokens=tokens,
        cost=float(cost_by_pool.sum()),
        cost_by_pool={p.name: float(c) for p, c in zip(pools, cost_by_pool, strict=True)},
        gpu_seconds_by_pool={p.name: float(g) for p, g in zip(pools, gpu_seconds, strict=True)},
        busy_slot_seconds=busy,
        ready_slot_seconds=slot_seconds,
        sessions_alive_start=alive_start,
        sessions_started=started,
        sessions_finished=finished,
        sessions_alive_end=int(fleet.alive.sum()),
        actions=[a for a in fleet.actions if a[0] >= 0],
        wall_seconds=time.perf_counter() - started_wall,
    )


SERIES_KEYS = (
    "times",
    "sessions_target",
    "sessions_alive",
    "load",
    "queued",
    "ready_capacity",
    "requested_capacity",
    "desired",
    "ready",
    "cost_rate",
    "wait_mean",
)


def _sample(
    series: dict[str, list], fleet: _Fleet, now: int, target: int, admitted: int, waited: float
) -> None:
    series["times"].append(now)
    series["sessions_target"].append(target)
    series["sessions_alive"].append(int(fleet.alive.sum()))
    series["load"].append(int((fleet.queued + fleet.running).sum()))
    series["queued"].append(int(fleet.queued.sum()))
    series["ready_capacity"].append(float((fleet.ready * fleet.capacity).sum()))
    series["requested_capacity"].append(float((fleet.desired * fleet.capacity).sum()))
    series["desired"].append(fleet.desired.copy())
    series["ready"].append(fleet.ready.copy())
    series["cost_rate"].append(float(((fleet.ready + fleet.n_starting()) * fleet.gpu_price).sum() * 3600))
    series["wait_mean"].append(waited / admitted if admitted else float("nan"))
