"""The pure scaling policy: one table row per rule, then invariants with hypothesis."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.operator.autoscaling.policy import (
    BudgetRequest,
    PolicyConfig,
    PolicyState,
    PoolLoad,
    allocate_gpu_budget,
    decide,
)

BASE = PolicyConfig(min_replicas=1, max_replicas=40, target_per_replica=10.0, poll_interval_s=30)


def load(value: float | None, replicas: int, ready: int | None = None, **kw: object) -> PoolLoad:
    ready = replicas if ready is None else ready
    return PoolLoad(load=value, replicas=replicas, ready=ready, starting=replicas - ready, **kw)  # type: ignore[arg-type]


# (name, config overrides, load, expected desired, a word the reason must contain)
SINGLE_POLL = [
    ("ratio scales up to ceil(load/target)", {}, load(53, 4), 6, "ratio 1.32"),
    ("within tolerance: no change", {}, load(43, 4), 4, "within tolerance"),
    ("just outside tolerance scales", {}, load(45, 4), 5, "ratio 1.12"),
    ("starting replicas count as capacity", {}, load(80, 8, ready=4), 8, "within tolerance"),
    (
        "HPA-style baseline multiplies per ready replica",
        {"count_starting": False},
        load(80, 8, ready=4),
        16,
        "per ready",
    ),
    (
        "HPA-style baseline holds with nothing ready",
        {"count_starting": False},
        load(80, 8, ready=0),
        8,
        "no ready",
    ),
    ("maxReplicas bounds", {}, load(1000, 30), 40, "maxReplicas"),
    ("minReplicas bounds", {"min_replicas": 3}, load(5, 3), 3, "bounded by minReplicas 3"),
    ("rate limit: max(+4, 100 %) without burst", {"burst_ratio": None}, load(160, 4), 8, "rate limited to 8"),
    (
        "rate limit: +4 beats 100 % for small pools",
        {"burst_ratio": None},
        load(100, 1),
        5,
        "rate limited to 5",
    ),
    ("burst lifts the rate limit", {}, load(160, 4), 16, "burst"),
    (
        "below the burst ratio the limit holds",
        {"burst_ratio": 3.0, "scale_up_pods": 1},
        load(250, 10),
        20,
        "rate limited to 20",
    ),
    ("activation wakes a pool at zero", {"min_replicas": 0}, load(25, 0), 3, "activation"),
    (
        "load at the threshold does not wake it",
        {"min_replicas": 0, "activation_threshold": 2},
        load(2, 0),
        0,
        "idle",
    ),
    ("a spike the minute average does not confirm", {}, load(60, 4, sustained=42.0), 4, "spike"),
    ("a step the minute average confirms", {}, load(60, 4, sustained=48.0), 6, "ratio 1.50"),
    ("no metrics: hold", {}, load(None, 7), 7, "holding"),
    ("no metrics: fallbackReplicas", {"fallback_replicas": 2}, load(None, 7), 2, "fallbackReplicas 2"),
    (
        "no metrics during a weight update: no removal",
        {"fallback_replicas": 2},
        load(None, 7, updating_weights=True),
        7,
        "weight update",
    ),
    (
        "lowered maxReplicas applies at once",
        {"max_replicas": 5},
        load(80, 9, updating_weights=True),
        5,
        "bounded",
    ),
]


@pytest.mark.parametrize(
    ("name", "overrides", "observed", "expected", "why"), SINGLE_POLL, ids=[r[0] for r in SINGLE_POLL]
)
def test_single_poll_rules(name: str, overrides: dict, observed: PoolLoad, expected: int, why: str) -> None:
    decision = decide(observed, PolicyState(), replace(BASE, **overrides), now=1000.0)
    assert decision.desired == expected, decision.reason
    assert why in decision.reason


def run_polls(config: PolicyConfig, loads: list[float], start: int, ready_after: int = 0) -> list[int]:
    """Feed a series of loads 30 s apart; replicas become ready ``ready_after`` polls after requested."""
    state, replicas, history = PolicyState(), start, []
    requested_at: list[tuple[int, int]] = []  # (poll index, replicas) when a scale-up was requested
    ready = start
    for index, value in enumerate(loads):
        ready = (
            max([start, *(r for i, r in requested_at if index - i >= ready_after)]) if requested_at else ready
        )
        ready = min(ready, replicas)
        observed = PoolLoad(load=value, replicas=replicas, ready=ready, starting=replicas - ready)
        decision = decide(observed, state, config, now=30.0 * index)
        state, replicas = decision.state, decision.desired
        if decision.desired > decision.current:
            requested_at.append((index, decision.desired))
        history.append(replicas)
    return history


def test_scale_down_waits_for_the_window_and_keeps_headroom() -> None:
    config = replace(BASE, scale_down_window_s=300)
    history = run_polls(config, [100.0] + [40.0] * 12, start=10)
    # Nothing goes down while the 300 s window still remembers load 100 (polls at 0..300 s) …
    assert history[:10] == [10] * 10
    # … then the pool goes to ceil(40 · 1.1 / 10) = 5 (the tolerance kept as headroom), not 4.
    assert history[11] == 5 and history[-1] == 5


def test_scale_down_held_during_a_weight_update() -> None:
    config = replace(BASE, scale_down_window_s=0)
    updating = PoolLoad(load=10, replicas=8, ready=8, updating_weights=True)
    assert decide(updating, PolicyState(), config, 0.0).desired == 8
    assert decide(replace(updating, updating_weights=False), PolicyState(), config, 0.0).desired == 2


def test_scale_to_zero_after_the_cooldown_only() -> None:
    config = replace(BASE, min_replicas=0, scale_down_window_s=300)
    history = run_polls(config, [30.0, *[0.5] * 12], start=3)
    assert history[9] == 3  # at 270 s the window still holds load 30
    assert history[-1] == 0


def test_no_runaway_while_replicas_start() -> None:
    """A queue that cannot drain during a 4-poll cold start: mixrl asks once, HPA keeps asking."""
    loads = [160.0] * 6
    ours = run_polls(replace(BASE, burst_ratio=None), loads, start=4, ready_after=4)
    hpa = run_polls(replace(BASE, burst_ratio=None, count_starting=False), loads, start=4, ready_after=4)
    assert max(ours) == 16  # ceil(160 / 10), reached through the rate limit and held
    assert max(hpa) == 40  # keeps multiplying by load per *ready* replica until maxReplicas


def test_rate_limit_counts_replicas_added_within_the_period() -> None:
    config = replace(BASE, burst_ratio=None, scale_up_period_s=60)
    first = decide(load(400, 4), PolicyState(), config, now=0.0)
    assert first.desired == 8
    # 30 s later the period (60 s) still starts from 4 replicas: no further step allowed.
    second = decide(load(400, 8, ready=4), first.state, config, now=30.0)
    assert second.desired == 8 and "rate limited to 8" in second.reason
    third = decide(load(400, 8, ready=4), second.state, config, now=61.0)
    assert third.desired == 16


def test_config_from_spec_scales_the_target_by_capacity() -> None:
    run = resolve(load_rlrun("examples/rlrun-mixed.yaml"))
    b300 = run.pool("b300-nvfp4")
    config = PolicyConfig.from_spec(run.autoscaling, b300)
    assert config.target_per_replica == pytest.approx(16 * 4.0)
    assert (config.min_replicas, config.max_replicas) == (1, 8)
    assert config.poll_interval_s == run.autoscaling.poll_interval_seconds


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_replicas", 0, "max_replicas: 0 is below min_replicas 1"),
        ("target_per_replica", 0.0, "target_per_replica: must be > 0"),
        ("tolerance", 1.0, "tolerance: must be in [0, 1)"),
        ("burst_ratio", 1.0, "burst_ratio: must be > 1 or None"),
    ],
)
def test_bad_config_names_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        replace(BASE, **{field: value})


def test_bad_load_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"PoolLoad\.load: must be a number ≥ 0"):
        PoolLoad(load=float("nan"), replicas=1, ready=1)


# ----------------------------------------------------------------------------- invariants

configs = st.builds(
    PolicyConfig,
    min_replicas=st.integers(0, 5),
    max_replicas=st.integers(5, 60),
    target_per_replica=st.floats(1.0, 64.0),
    tolerance=st.floats(0.0, 0.3),
    scale_down_window_s=st.sampled_from([0.0, 60.0, 300.0]),
    activation_threshold=st.floats(0.0, 3.0),
    burst_ratio=st.one_of(st.none(), st.floats(1.5, 4.0)),
    count_starting=st.booleans(),
    fallback_replicas=st.one_of(st.none(), st.integers(0, 80)),
)
observations = st.tuples(
    st.one_of(st.none(), st.floats(0.0, 5000.0)),
    st.integers(0, 80),
    st.integers(0, 80),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(config=configs, polls=st.lists(observations, min_size=1, max_size=30))
def test_bounds_always_hold(config: PolicyConfig, polls: list[tuple[float | None, int, int, bool]]) -> None:
    state, replicas = PolicyState(), polls[0][1]
    for index, (value, _, ready, updating) in enumerate(polls):
        observed = PoolLoad(
            load=value,
            replicas=replicas,
            ready=min(ready, replicas),
            starting=max(replicas - ready, 0),
            updating_weights=updating,
        )
        decision = decide(observed, state, config, now=30.0 * index)
        assert config.min_replicas <= decision.desired <= config.max_replicas, decision.reason
        state, replicas = decision.state, decision.desired


@settings(max_examples=200, deadline=None)
@given(
    level=st.floats(20.0, 2000.0),
    target=st.floats(4.0, 64.0),
    tolerance=st.floats(0.05, 0.3),
    start=st.integers(1, 60),
    noise=st.lists(st.floats(-1.0, 1.0), min_size=20, max_size=60),
)
def test_no_oscillation_under_steady_noisy_load(
    level: float, target: float, tolerance: float, start: int, noise: list[float]
) -> None:
    """Noise of relative amplitude a with (1+a)/(1-a) ≤ (1+tolerance)², the bound the headroom
    guarantees (docs/autoscaling.md): after any scale-down, never a scale-up again."""
    amplitude = (1 + tolerance) ** 2
    a = (amplitude - 1) / (amplitude + 1) * 0.999
    config = PolicyConfig(
        min_replicas=1, max_replicas=1000, target_per_replica=target, tolerance=tolerance, burst_ratio=None
    )
    state, replicas, directions = PolicyState(), start, []
    for index, n in enumerate(noise):
        value = level * (1 + a * n)
        decision = decide(
            PoolLoad(load=value, replicas=replicas, ready=replicas), state, config, 30.0 * index
        )
        if decision.changed:
            directions.append(1 if decision.desired > decision.current else -1)
        state, replicas = decision.state, decision.desired
    reversals_down_to_up = sum(1 for x, y in itertools.pairwise(directions) if x < 0 < y)
    assert reversals_down_to_up == 0, directions


# ----------------------------------------------------------------------------- GPU budget


def request(
    name: str, desired: int, capacity: float, gpus: int, price: float | None, lo: int = 0, hi: int = 16
) -> BudgetRequest:
    return BudgetRequest(name, desired, lo, hi, capacity, gpus, price)


def test_budget_fills_cheapest_capacity_first() -> None:
    pools = [
        request("h100", 4, 1.0, 1, 2.5),  # 2.50 $/h per capacity unit
        request("b200", 2, 3.2, 1, 6.0),  # 1.875
        request("a100", 2, 0.5, 1, 1.2),  # 2.40
    ]
    demand = 4 * 1.0 + 2 * 3.2 + 2 * 0.5  # 11.4 capacity units
    allocation = allocate_gpu_budget(pools, gpu_budget=100)
    assert allocation["b200"].replicas == math.ceil(demand / 3.2)  # 4 replicas cover it alone
    assert allocation["h100"].replicas == 0 and allocation["a100"].replicas == 0
    served = sum(allocation[p.name].replicas * p.capacity for p in pools)
    assert served >= demand


def test_budget_caps_gpus_and_keeps_minimums() -> None:
    pools = [request("b200", 10, 3.2, 2, 6.0, lo=1, hi=10), request("h100", 10, 1.0, 1, 2.5, lo=2)]
    allocation = allocate_gpu_budget(pools, gpu_budget=12)
    gpus = allocation["b200"].replicas * 2 + allocation["h100"].replicas
    assert gpus <= 12
    assert allocation["h100"].replicas >= 2 and allocation["b200"].replicas >= 1
    # h100 is the cheaper capacity (2.5 vs 6·2/3.2 = 3.75 $/h per unit): the 8 GPUs left after
    # the minimums all go to it; b200 keeps its minimum.
    assert (allocation["h100"].replicas, allocation["b200"].replicas, gpus) == (10, 1, 12)


def test_budget_below_minimums_reports_it() -> None:
    allocation = allocate_gpu_budget([request("x", 3, 1.0, 4, 1.0, lo=3)], gpu_budget=4)
    assert allocation["x"].replicas == 3 and "exceed the GPU budget" in allocation["x"].reason


def test_budget_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="gpu_budget: must be > 0"):
        allocate_gpu_budget([], 0)
    with pytest.raises(ValueError, match="duplicate pool names"):
        allocate_gpu_budget([request("x", 1, 1, 1, 1), request("x", 1, 1, 1, 1)], 4)
