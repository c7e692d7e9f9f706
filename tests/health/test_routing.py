"""Mismatch-aware routing on synthetic per-pool streams: capacity × health, hysteresis and floor."""

from __future__ import annotations

import random

import pytest

from mixrl.rl.health.routing import (
    HEALTHY,
    HealthPolicy,
    Observation,
    PoolHealth,
    health_weighted_shares,
    observe,
    observe_all,
)

POLICY = HealthPolicy(kl_threshold=0.01, extreme_share_threshold=0.02)
CAPACITY = {"fp8": 1.0, "nvfp4": 1.0, "bf16": 2.0}
GOOD = Observation(kl=0.002, extreme_share=0.001)
BAD_KL = Observation(kl=0.05, extreme_share=0.001)
BAD_EXTREME = Observation(kl=0.002, extreme_share=0.1)
IN_BAND = Observation(kl=0.008, extreme_share=0.001)  # below the threshold, above half of it


def run(stream: list[dict[str, Observation]]) -> list[dict[str, float]]:
    """The shares after each step of a stream of per-pool observations."""
    states: dict[str, PoolHealth] = {}
    shares = []
    for observations in stream:
        states = observe_all(states, observations, POLICY)
        shares.append(health_weighted_shares(CAPACITY, states))
    return shares


def noisy(rng: random.Random) -> Observation:
    """Healthy noise: KL 0.002 ± 60 %, extreme share up to 0.004 (well inside the thresholds)."""
    return Observation(kl=0.002 * rng.uniform(0.4, 1.6), extreme_share=rng.uniform(0.0, 0.004))


def test_a_degraded_pool_loses_share_and_gets_it_back_after_recovery() -> None:
    rng = random.Random(0)
    stream = []
    for step in range(60):
        degraded = 10 <= step < 30
        stream.append({"fp8": noisy(rng), "bf16": noisy(rng), "nvfp4": BAD_KL if degraded else noisy(rng)})
    shares = run(stream)
    assert shares[0] == pytest.approx({"fp8": 0.25, "nvfp4": 0.25, "bf16": 0.5})
    assert shares[11]["nvfp4"] == pytest.approx(0.25)  # two bad observations: not yet
    assert shares[12]["nvfp4"] < 0.25  # the third in a row
    assert shares[29]["nvfp4"] == pytest.approx(0.1 / (0.1 + 3.0))  # at the floor: capacity 1 × 0.1
    # the traffic it lost went to the others in proportion to their capacity
    assert shares[29]["bf16"] == pytest.approx(2 * shares[29]["fp8"])
    recovered = next(step for step in range(30, 60) if shares[step]["nvfp4"] == pytest.approx(0.25))
    assert 30 + POLICY.recover_after <= recovered <= 45
    assert all(share == pytest.approx(0.25) for share in (s["nvfp4"] for s in shares[recovered:]))


def test_noise_alone_changes_nothing() -> None:
    rng = random.Random(1)
    shares = run([{pool: noisy(rng) for pool in CAPACITY} for _ in range(500)])
    assert all(s == pytest.approx({"fp8": 0.25, "nvfp4": 0.25, "bf16": 0.5}) for s in shares)


def test_isolated_spikes_and_a_pool_hovering_near_the_threshold_change_nothing() -> None:
    state = HEALTHY
    for observation in [
        BAD_KL,
        BAD_KL,
        GOOD,
        BAD_EXTREME,
        BAD_EXTREME,
        IN_BAND,
        BAD_KL,
        BAD_KL,
        IN_BAND,
    ] * 10:
        state = observe(state, observation, POLICY)
    assert state.health == 1.0


def test_the_floor_holds_and_extreme_ratios_alone_degrade() -> None:
    state = HEALTHY
    for _ in range(100):
        state = observe(state, BAD_EXTREME, POLICY)
    assert state.health == POLICY.floor
    assert health_weighted_shares({"a": 1.0, "b": 1e6}, {"a": state})["a"] > 0


def test_hysteresis_a_pool_in_the_band_neither_falls_nor_recovers() -> None:
    degraded = PoolHealth(0.25)
    state = degraded
    for _ in range(20):
        state = observe(state, IN_BAND, POLICY)
    assert state.health == 0.25  # not good enough to recover
    for _ in range(POLICY.recover_after - 1):
        state = observe(state, GOOD, POLICY)
    assert state.health == 0.25
    state = observe(state, GOOD, POLICY)
    assert state.health == 0.5


def test_a_pool_without_tokens_this_step_holds_its_health_and_streak_resets() -> None:
    state = observe(observe(HEALTHY, BAD_KL, POLICY), BAD_KL, POLICY)
    state = observe(state, None, POLICY)
    state = observe(state, BAD_KL, POLICY)
    assert state.health == 1.0 and state.bad_streak == 1


def test_shares_without_capacity_are_zero_and_unknown_pools_are_healthy() -> None:
    assert health_weighted_shares({"a": 0.0, "b": 0.0}, {}) == {"a": 0.0, "b": 0.0}
    assert health_weighted_shares({"a": 1.0, "b": 3.0}, {}) == {"a": 0.25, "b": 0.75}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kl_threshold": 0.0}, "kl_threshold"),
        ({"floor": 0.0}, "floor"),
        ({"step": 1.0}, "step"),
        ({"recover_fraction": 1.5}, "recover_fraction"),
        ({"degrade_after": 0}, "degrade_after"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field(changes: dict[str, float], field: str) -> None:
    settings = {"kl_threshold": 0.01, "extreme_share_threshold": 0.01, **changes}
    with pytest.raises(ValueError, match=field):
        HealthPolicy(**settings)  # type: ignore[arg-type]
