"""Share accuracy of session assignment (pure: RouterState and ShareScheduler, no I/O)."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from mixrl.rl.router.config import PoolConfig
from mixrl.rl.router.shares import (
    MIN_CAPACITY_SAMPLES,
    UNMEASURED_CAPACITY,
    PeakThroughput,
    PoolCapacity,
    ShareScheduler,
    balanced_after_refresh,
    capacity_choices,
    capacity_per_replica,
    drain_step,
    reported_measurements,
    target_shares,
    tokens_per_capacity,
)
from mixrl.rl.router.state import RouterState

ONE_POINT = 0.01


def make_state(pools: dict[str, tuple[float | None, int]]) -> RouterState:
    """{name: (capacity per replica, replicas)}, every replica ready."""
    configs = [
        PoolConfig(name=name, capacity=capacity, replicas=tuple(f"http://{name}-{i}:1" for i in range(n)))
        for name, (capacity, n) in pools.items()
    ]
    state = RouterState(configs)
    for config in configs:
        for url in config.replicas:
            state.set_ready(config.name, url, True)
    return state


def run_sessions(state: RouterState, n: int, rng: random.Random, start: int = 0) -> Counter[str]:
    """n sessions, each one or two turns; about a third end right away (as real episodes do)."""
    counts: Counter[str] = Counter()
    for i in range(start, start + n):
        sid = f"s{i}"
        route = state.route(sid, now=float(i))
        counts[route.pool] += 1
        if rng.random() < 0.5:
            assert state.route(sid, now=float(i) + 0.5).pool == route.pool
        if rng.random() < 0.3:
            state.end_session(sid)
    return counts


def expected_shares(pools: dict[str, tuple[float, int]]) -> dict[str, float]:
    """Reference: capacity × ready replicas over the sum, in plain float arithmetic."""
    total = sum(c * n for c, n in pools.values())
    return {name: c * n / total for name, (c, n) in pools.items()}


def test_10000_sessions_land_within_one_point_of_capacity_shares() -> None:
    # Four pools shaped like the paper's mix: B200 nvfp4, H200 fp8, H100 bf16, A100 bf16.
    pools = {"nvfp4": (3.1, 2), "fp8": (1.7, 3), "bf16-h100": (1.0, 4), "bf16-a100": (0.55, 5)}
    state = make_state(pools)
    counts = run_sessions(state, 10_000, random.Random(0))
    reference = expected_shares(pools)
    for name, share in reference.items():
        assert abs(counts[name] / 10_000 - share) < ONE_POINT, (name, counts[name], share)
    # Low discrepancy is much tighter than the 1-point bar: within a couple of sessions per pool.
    for name, share in reference.items():
        assert abs(counts[name] - share * 10_000) <= 2, (name, counts[name], share * 10_000)


def test_shares_follow_ready_replicas_when_a_pool_scales() -> None:
    pools = {"a": (2.0, 1), "b": (1.0, 2), "c": (1.0, 1)}
    state = make_state(pools)
    rng = random.Random(1)
    run_sessions(state, 3_000, rng)
    # Pool "a" scales 1 -> 4 replicas and "c" loses its only replica (scaled to zero).
    state.set_replicas("a", [f"http://a-{i}:1" for i in range(4)])
    for i in range(1, 4):
        state.set_ready("a", f"http://a-{i}:1", True)
    state.set_ready("c", "http://c-0:1", False)
    counts = run_sessions(state, 10_000, rng, start=3_000)
    reference = expected_shares({"a": (2.0, 4), "b": (1.0, 2)})
    assert counts["c"] == 0
    for name, share in reference.items():
        assert abs(counts[name] / 10_000 - share) < ONE_POINT, (name, counts[name], share)
    # Back up: c returns with one ready replica and its share returns too.
    state.set_ready("c", "http://c-0:1", True)
    counts = run_sessions(state, 10_000, rng, start=13_000)
    reference = expected_shares({"a": (2.0, 4), "b": (1.0, 2), "c": (1.0, 1)})
    for name, share in reference.items():
        assert abs(counts[name] / 10_000 - share) < ONE_POINT, (name, counts[name], share)


def test_measured_pools_use_peak_throughput_and_a_fallback_until_measured() -> None:
    state = make_state({"fast": (None, 1), "slow": (None, 2), "unmeasured": (None, 1)})
    # Nothing measured yet: every pool counts UNMEASURED_CAPACITY per replica.
    assert state.scheduler.shares == {"fast": 0.25, "slow": 0.5, "unmeasured": 0.25}
    for tps in (100.0, 400.0, 250.0):  # peak 400: an idle moment must not lower the estimate
        state.record_throughput("fast", "http://fast-0:1", tps)
    state.record_throughput("slow", "http://slow-0:1", 100.0)
    state.record_throughput("slow", "http://slow-1:1", 100.0)
    # "unmeasured" has no sample yet: it takes the mean of the measured per-replica capacities (250).
    reference = {"fast": 400.0, "slow": 2 * 100.0, "unmeasured": 250.0}
    total = sum(reference.values())
    for name, value in reference.items():
        assert abs(state.scheduler.shares[name] - value / total) < 1e-12
    counts = run_sessions(state, 10_000, random.Random(2))
    for name, value in reference.items():
        assert abs(counts[name] / 10_000 - value / total) < ONE_POINT


def test_capacity_per_replica_rules() -> None:
    trusted = MIN_CAPACITY_SAMPLES
    pools = {
        "configured": PoolCapacity(configured=2.0, measured=1000.0, ready_replicas=1, samples=trusted),
        "measured": PoolCapacity(configured=None, measured=30.0, ready_replicas=1),
        "pending": PoolCapacity(configured=None, measured=None, ready_replicas=1),
    }
    # Declared capacities and tokens/s never meet: 500 tokens/s per declared unit converts the
    # measured pool's 30 tokens/s to 0.06 (it was compared as 30 against 2.0, a 15x share).
    assert capacity_per_replica(pools) == {"configured": 2.0, "measured": 0.06, "pending": 0.06}
    assert capacity_choices(pools) == {
        "configured": (2.0, "configured"),
        "measured": (0.06, "measured"),
        "pending": (0.06, "default"),
    }
    assert reported_measurements(pools) == {"configured": 2.0, "measured": 0.06}
    untrusted = {**pools, "configured": PoolCapacity(2.0, 1000.0, 1, samples=trusted - 1)}
    assert capacity_per_replica(untrusted) == {"configured": 2.0, "measured": 1.0, "pending": 1.0}
    # Nothing converts a measurement yet: the null pools are at the default, not "measured", and
    # the untrusted declared pool's few samples are not shown as its measurement.
    assert {name: source for name, (_, source) in capacity_choices(untrusted).items()} == {
        "configured": "configured",
        "measured": "default",
        "pending": "default",
    }
    assert reported_measurements(untrusted) == {}
    none_measured = {"x": PoolCapacity(None, None, 2), "y": PoolCapacity(None, None, 0)}
    assert capacity_per_replica(none_measured) == {"x": UNMEASURED_CAPACITY, "y": UNMEASURED_CAPACITY}
    assert target_shares(none_measured) == {"x": 1.0, "y": 0.0}
    assert target_shares({"x": PoolCapacity(1.0, None, 0)}) == {"x": 0.0}


def test_peak_throughput_window_forgets_old_peaks() -> None:
    estimate = PeakThroughput(window=3)
    assert estimate.estimate() is None
    estimate.add(0.0)
    assert estimate.estimate() is None  # idle samples are no measurement
    for value in (50.0, 10.0, 10.0, 10.0):
        estimate.add(value)
    assert estimate.estimate() == 10.0


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.floats(min_value=0.01, max_value=100.0), min_size=1, max_size=8),
    changes=st.lists(
        st.tuples(
            st.integers(min_value=1, max_value=300), st.lists(st.floats(0.0, 50.0), min_size=8, max_size=8)
        ),
        max_size=5,
    ),
)
def test_scheduler_discrepancy_stays_below_one_session_per_pool(
    weights: list[float], changes: list[tuple[int, list[float]]]
) -> None:
    """Against the exact integral Σ_t share_t, every pool's count is off by less than #pools sessions."""
    names = [f"p{i}" for i in range(len(weights))]
    scheduler = ShareScheduler(dict(zip(names, weights, strict=True)))
    owed = dict.fromkeys(names, 0.0)
    got = dict.fromkeys(names, 0)
    phases = [(500, weights), *[(n, w[: len(names)]) for n, w in changes]]
    for n, phase_weights in phases:
        if sum(phase_weights) == 0:
            continue
        scheduler.set_shares(dict(zip(names, phase_weights, strict=True)))
        total = sum(phase_weights)
        for _ in range(n):
            pool = scheduler.next_pool()
            assert pool is not None
            assert phase_weights[names.index(pool)] > 0, "a pool with no share got a session"
            got[pool] += 1
            for name, weight in zip(names, phase_weights, strict=True):
                owed[name] += weight / total
            for name in names:
                assert abs(owed[name] - got[name]) < len(names), (name, owed[name], got[name])


def test_scheduler_with_no_share_returns_none() -> None:
    scheduler = ShareScheduler({"a": 0.0, "b": 0.0})
    assert scheduler.next_pool() is None


def test_drain_step_counts_a_loss_from_the_last_balanced_count() -> None:
    # 8 ready when last at its share, 4 now, 60 held against a fair 30 (2×): it lost and drains,
    # and the count it lost from stays while it drains.
    assert drain_step(False, 8, 4, 60, 30.0) == (True, 8)
    # The same excess without a loss (4 of 4): no drain, and over its share the count stays.
    assert drain_step(False, 4, 4, 60, 30.0) == (False, 4)
    # Down to 1.1× its share: it stops, still over its share, so the count stays at 8 ...
    assert drain_step(True, 8, 4, 33, 30.0) == (False, 8)
    # ... and at its share what it has now is the new normal: a later loss counts from 4.
    assert drain_step(False, 8, 4, 30, 30.0) == (False, 4)
    assert drain_step(False, 4, 3, 60, 30.0) == (True, 4)


def test_the_balanced_count_rises_with_the_ready_replicas_and_never_falls_on_a_refresh() -> None:
    assert balanced_after_refresh(4, 6) == 6
    assert balanced_after_refresh(6, 2) == 6


def test_a_misdeclared_capacity_gives_way_to_a_trusted_measurement_far_off_it() -> None:
    """Issue #30: one pool really delivering a third of its declared capacity got most sessions."""
    trusted = MIN_CAPACITY_SAMPLES
    pools = {
        "a": PoolCapacity(1.0, 100.0, 2, trusted),
        "b": PoolCapacity(2.0, 210.0, 2, trusted),  # 1.05x its declaration: noise, it stands
        "slow": PoolCapacity(3.0, 100.0, 2, trusted),  # a third of what it declares
    }
    assert tokens_per_capacity(pools) == 100.0  # the median: the mis-declared pool does not move it
    assert capacity_per_replica(pools) == {"a": 1.0, "b": 2.0, "slow": 1.0}
    assert target_shares(pools)["slow"] == 0.25  # was 0.5 by the declarations


def test_only_samples_of_a_full_replica_may_overrule_a_declaration() -> None:
    """A pool the router gave few sessions (degraded health, a new pool) produces little: that is
    no measurement of what it can do, and must not shrink its share further."""
    state = make_state({"a": (1.0, 1), "b": (1.0, 1)})
    for _ in range(MIN_CAPACITY_SAMPLES):
        state.record_throughput("a", "http://a-0:1", 300.0, queued=True)
        state.record_throughput("b", "http://b-0:1", 30.0)  # few sessions: nothing queued
    assert state.scheduler.shares == {"a": 0.5, "b": 0.5}
    for _ in range(MIN_CAPACITY_SAMPLES):
        state.record_throughput("b", "http://b-0:1", 30.0, queued=True)  # full, and still slow
    # Two pools: the reference is their mean (165 tokens/s per unit); b measures 0.18, a 1.82.
    shares = state.scheduler.shares
    assert shares["b"] < 0.1 < 0.9 < shares["a"]
