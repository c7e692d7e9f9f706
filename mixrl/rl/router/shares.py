"""Which pool gets the next session: target shares and a low-discrepancy scheduler (pure, no I/O).

A pool's weight is its capacity per replica times its ready replicas, so shares follow the pools
as they scale.  Sessions are dealt by *deficit counters* (smooth weighted round
robin with shares that sum to 1): every pool accrues its share per session and the pool owed the
most gets the session.  After n sessions a pool's count differs from the sum of its shares over
those n sessions by less than one session per pool, so the observed split converges as 1/n instead
of the 1/√n of independent random draws — 10 000 sessions land within a few hundredths of a
percentage point of the targets, where random choice would wander by about half a point.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

UNMEASURED_CAPACITY = 1.0
"""Capacity per replica of a measured pool before any pool has been measured."""

MIN_CAPACITY_SAMPLES = 10
"""Samples taken while full (over a pool's ready replicas) before a measurement may replace a
declared capacity: at the router's 2 s health-check period, 20 s of a full replica."""

MISMATCH_FACTOR = 1.5
"""A declared capacity gives way to the measured one when they differ by more than this factor
either way: below it the declaration stands (a measurement's wobble moves no sessions)."""


@dataclass(frozen=True)
class PoolCapacity:
    """What the share of one pool depends on."""

    configured: float | None
    """Relative capacity per replica from the spec; None = measured."""
    measured: float | None
    """Measured generation throughput per replica (tokens/s), None until measured."""
    ready_replicas: int
    samples: int = 0
    """Throughput samples behind ``measured`` (:data:`MIN_CAPACITY_SAMPLES` make it trusted)."""

    @property
    def trusted(self) -> bool:
        return self.measured is not None and self.samples >= MIN_CAPACITY_SAMPLES


def tokens_per_capacity(pools: Mapping[str, PoolCapacity]) -> float | None:
    """Tokens/s per unit of capacity: the median, over the declared pools measured with trust, of
    measured ÷ declared (the median: one mis-declared pool does not move it); for a fleet that
    declares nothing, the mean of the measured pools (their mean capacity is then 1).  None: no
    measurement to convert by yet."""
    ratios = sorted(
        p.measured / p.configured
        for p in pools.values()
        if p.configured is not None and p.measured is not None and p.trusted
    )
    if ratios:
        middle = len(ratios) // 2
        return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
    if all(p.configured is None for p in pools.values()):
        measured = [p.measured for p in pools.values() if p.measured is not None]
        return sum(measured) / len(measured) if measured else None
    return None


def measured_capacities(pools: Mapping[str, PoolCapacity]) -> dict[str, float]:
    """Each measured pool's capacity per replica in the declared units (:func:`tokens_per_capacity`)."""
    reference = tokens_per_capacity(pools)
    if reference is None or reference <= 0:
        return {}
    return {name: p.measured / reference for name, p in pools.items() if p.measured is not None}


def mismatched(declared: float, measured: float) -> bool:
    """Whether a measured capacity is off its declaration by more than :data:`MISMATCH_FACTOR`."""
    return max(declared, measured) > MISMATCH_FACTOR * min(declared, measured)


def capacity_choices(pools: Mapping[str, PoolCapacity]) -> dict[str, tuple[float, str]]:
    """Each pool's capacity per replica, in the declared units, and where it comes from
    (``configured``, ``measured`` or ``default``): the declared one unless a trusted measurement is
    off it by more than :data:`MISMATCH_FACTOR` (then the measurement); for a pool declared null,
    its measurement.

    Measurements are tokens/s, converted by :func:`tokens_per_capacity` (declared capacities and
    tokens/s never meet in one comparison).  A null pool without a converted measurement takes the
    mean of the measured null pools (so one slow-to-report pool does not get a share of nothing),
    or :data:`UNMEASURED_CAPACITY` while there is none: its source is then ``default``.
    """
    measured = measured_capacities(pools)
    nulls = [measured[name] for name, p in pools.items() if p.configured is None and name in measured]
    fallback = sum(nulls) / len(nulls) if nulls else UNMEASURED_CAPACITY
    result: dict[str, tuple[float, str]] = {}
    for name, pool in pools.items():
        if pool.configured is None:
            result[name] = (measured[name], "measured") if name in measured else (fallback, "default")
        elif pool.trusted and name in measured and mismatched(pool.configured, measured[name]):
            result[name] = (measured[name], "measured")
        else:
            result[name] = (pool.configured, "configured")
    return result


def capacity_per_replica(pools: Mapping[str, PoolCapacity]) -> dict[str, float]:
    """Each pool's capacity per replica, in the declared units (:func:`capacity_choices`)."""
    return {name: value for name, (value, _) in capacity_choices(pools).items()}


def reported_measurements(pools: Mapping[str, PoolCapacity]) -> dict[str, float]:
    """The measured capacities shown (``mixrl_router_capacity_measured``, ``GET /pools``): a null
    pool's once converted, a declared pool's once trusted (before, its measurement is a few samples
    of a pool that may not have been full)."""
    return {
        name: value
        for name, value in measured_capacities(pools).items()
        if pools[name].configured is None or pools[name].trusted
    }


def target_shares(pools: Mapping[str, PoolCapacity]) -> dict[str, float]:
    """Share of new sessions per pool: capacity per replica × ready replicas, normalized.

    Pools without a ready replica get 0; if no pool has one, every share is 0.
    """
    per_replica = capacity_per_replica(pools)
    weights = {name: per_replica[name] * max(pool.ready_replicas, 0) for name, pool in pools.items()}
    total = sum(weights.values())
    if total <= 0:
        return dict.fromkeys(pools, 0.0)
    return {name: weight / total for name, weight in weights.items()}


class ShareScheduler:
    """Deals sessions to pools in proportion to target shares with bounded discrepancy.

    ``deficit[p]`` is (sessions pool p was owed so far) − (sessions it got).  Each pick adds every
    pool's current share to its deficit, gives the session to the largest deficit and charges that
    pool one session.  The deficits always sum to zero and stay bounded, so the cumulative count of
    every pool tracks its (possibly time-varying) target within about one session.

    Shares may change at any time (a pool scaled, a throughput was measured): the deficits are
    kept, so the debt owed to each pool carries over instead of restarting the sequence — restarting
    would always favour the largest pool first and bias small pools when shares change often.
    """

    def __init__(self, shares: Mapping[str, float] | None = None) -> None:
        self._shares: dict[str, float] = {}
        self._deficit: dict[str, float] = {}
        self._order: list[str] = []
        if shares is not None:
            self.set_shares(shares)

    @property
    def shares(self) -> dict[str, float]:
        return dict(self._shares)

    def set_shares(self, shares: Mapping[str, float]) -> None:
        for name, share in shares.items():
            if share < 0:
                raise ValueError(f"share of pool {name!r} is negative: {share}")
        total = sum(shares.values())
        normalized = {name: (share / total if total > 0 else 0.0) for name, share in shares.items()}
        self._order = list(normalized)
        self._shares = normalized
        deficit = {name: self._deficit.get(name, 0.0) for name in normalized}
        # A pool that left took its deficit with it; spreading the remainder keeps Σ deficit = 0.
        if deficit:
            mean = sum(deficit.values()) / len(deficit)
            deficit = {name: value - mean for name, value in deficit.items()}
        self._deficit = deficit

    def next_pool(self, among: Collection[str] | None = None) -> str | None:
        """The pool for the next session, or None if no pool has a share.

        ``among``: only these pools may be chosen (those serving a request's minimum weight
        version).  They share this pick in proportion to their own shares and the others' credit
        stays as it was, so a pool left out while its weights were behind gets no burst of new
        sessions once it catches up."""
        eligible = [
            name for name in self._order if self._shares[name] > 0 and (among is None or name in among)
        ]
        if not eligible:
            return None
        total = sum(self._shares[name] for name in eligible)
        for name in eligible:
            self._deficit[name] += self._shares[name] / total
        # Ties go to the pool listed first, so the sequence is deterministic.
        chosen = max(eligible, key=lambda name: self._deficit[name])
        self._deficit[chosen] -= 1.0
        return chosen


class PeakThroughput:
    """Capacity estimate of one replica from its throughput samples: the peak of a recent window.

    Generation throughput depends on load as well as on the hardware: an idle engine reports
    0 tokens/s.  The mean would therefore feed back (a pool given fewer sessions would look slower
    and get fewer still); the recent peak measures what the replica *can* do.
    """

    def __init__(self, window: int = 30) -> None:
        self._samples: deque[float] = deque(maxlen=window)

    def add(self, tokens_per_second: float) -> None:
        if tokens_per_second >= 0:
            self._samples.append(tokens_per_second)

    def __len__(self) -> int:
        """Samples in the window."""
        return len(self._samples)

    def estimate(self) -> float | None:
        """The recent peak, or None before any positive sample."""
        peak = max(self._samples, default=0.0)
        return peak if peak > 0 else None


# ----------------------------------------------------------------------------- rebalancing

REBALANCE_START = 1.5
"""A pool that lost ready replicas sheds sessions once it holds this many times its share of them."""
REBALANCE_STOP = 1.1
"""...and keeps shedding until it holds at most this many times its share (the hysteresis)."""
REBALANCE_MIN_EXCESS = 2
"""Sessions above its share a pool must hold before it starts (a handful of sessions is noise)."""


def keeps_draining(draining: bool, held: int, fair: float, lost_capacity: bool) -> bool:
    """Whether a pool sheds its sessions now (moves them to other pools at their next request).

    ``held``: its live sessions; ``fair``: its target share × all live sessions; ``lost_capacity``:
    its ready replicas fell since it last held no more than its share.  It starts only after a loss
    (another pool's growth alone never moves sessions that have a working replica and its prefix
    cache: new sessions follow the shares) and only at :data:`REBALANCE_START` × its share; it stops
    at :data:`REBALANCE_STOP` ×, so sessions moved out do not make it swing back and forth."""
    if draining:
        return held > REBALANCE_STOP * fair and held - fair >= 1
    return lost_capacity and held >= REBALANCE_START * fair and held - fair >= REBALANCE_MIN_EXCESS


def rebalance_destination(held: Mapping[str, int], shares: Mapping[str, float], source: str) -> str | None:
    """The pool a session shed by ``source`` goes to: the one furthest below its share of the live
    sessions (ties: the first listed); None when no other pool is below its share."""
    total = sum(held.values())
    best, room = None, 0.0
    for name, share in shares.items():
        if name == source or share <= 0:
            continue
        below = share * total - held.get(name, 0)
        if below > room:
            best, room = name, below
    return best


def balanced_after_refresh(balanced: int, ready: int) -> int:
    """A pool's balanced count once a share refresh counted ``ready`` ready replicas.

    The balanced count is its ready replicas when it last held no more than its share of the live
    sessions; it rises with every rise of ``ready`` (a pool that grew and then fell back has lost
    replicas even if it never got down to its share in between) and falls only in
    :func:`drain_step`."""
    return max(balanced, ready)


def drain_step(draining: bool, balanced: int, ready: int, held: int, fair: float) -> tuple[bool, int]:
    """One look at a pool: :func:`keeps_draining` with the capacity-loss bookkeeping around it.

    ``balanced``: its balanced count (:func:`balanced_after_refresh`); it lost capacity when
    ``ready`` is below it.  ``held`` and ``fair`` as for :func:`keeps_draining`.  Returns whether
    it drains now and its balanced count after this look: a pool that does not drain and holds at
    most its share takes what it has now as the new normal (a later loss is counted from there)."""
    draining = keeps_draining(draining, held, fair, ready < balanced)
    if not draining and held <= fair + 1e-9:
        balanced = ready
    return draining, balanced
