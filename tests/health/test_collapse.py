"""The signs of collapse on metric streams: each injected alone, and the false alarms they must not raise."""

from __future__ import annotations

from typing import Any

import pytest

from mixrl.api.models import CollapseSpec
from mixrl.rl.health.collapse import (
    FORMAT_ERRORS,
    KL_GROWING,
    REWARD_FALLING,
    RUN,
    assess,
    smoothed,
)

from .false_alarms import false_alarm_rate
from .streams import healthy, recorded, with_changes

SPEC = CollapseSpec()


def raised(records: list[dict[str, Any]], spec: CollapseSpec = SPEC) -> set[tuple[str, str]]:
    return {(sign.name, sign.scope) for sign in assess(records, spec).raised}


def first_raised_step(
    records: list[dict[str, Any]], sign: tuple[str, str], spec: CollapseSpec = SPEC
) -> int | None:
    """The first step at which ``sign`` is raised, judging the log as it grows (as `mixrl run` does)."""
    for end in range(1, len(records) + 1):
        if sign in raised(records[:end], spec):
            return records[end - 1]["step"]
    return None


def scale_pool_kl(pool: str, factor: float) -> Any:
    def change(record: dict[str, Any]) -> None:
        record["pools"][pool]["kl_k3"] *= factor

    return change


# ------------------------------------------------------------------------------ healthy runs


def test_the_recorded_quickstart_run_raises_nothing_at_any_step() -> None:
    records = recorded()
    assert len(records) == 100
    for end in range(1, len(records) + 1):
        assert raised(records[:end]) == set(), f"false alarm at step {end}"
    judged = {(sign.name, sign.scope) for sign in assess(records).signs}
    assert judged >= {(KL_GROWING, p) for p in ("run", "nvfp4", "mxfp4", "fp8", "bf16")}
    assert {(REWARD_FALLING, RUN), (FORMAT_ERRORS, RUN)} <= judged


def test_a_five_step_baseline_would_have_raised_on_the_recorded_run() -> None:
    """Why baselineSteps defaults to 10: the first steps train on fresher tokens (step 1 on staleness
    0), so a 5-step baseline is low and the bf16 pool's staleness drift at steps 9 to 13 reads as 3.1x."""
    records = recorded()
    short = CollapseSpec(baseline_steps=5)
    assert first_raised_step(records, (KL_GROWING, "bf16"), short) == 13
    assert raised(records, short) == set()  # and it was gone by the end


@pytest.mark.parametrize("seed", range(20))
def test_noisy_healthy_synthetic_runs_raise_nothing(seed: int) -> None:
    records = healthy(seed=seed)
    assert all(raised(records[:end]) == set() for end in range(1, len(records) + 1))


# ------------------------------------------------------------------------------ each sign alone


def test_kl_growing_in_one_pool_raises_only_for_that_pool_within_one_window() -> None:
    records = with_changes(healthy(), 30, scale_pool_kl("b", 5.0))
    sign = (KL_GROWING, "b")
    # the window's median turns once most of its steps are degraded: step 30 + window // 2
    assert first_raised_step(records, sign) == 30 + SPEC.window // 2
    assert (KL_GROWING, "a") not in raised(records)
    (found,) = [s for s in assess(records).raised if s.scope == "b"]
    assert found.value >= 3 * found.reference and found.threshold == pytest.approx(3 * found.reference)
    assert "pool b" in found.describe() and "RAISED" in found.describe()


def test_kl_growing_injected_into_the_recorded_run() -> None:
    records = with_changes(recorded(), 60, scale_pool_kl("mxfp4", 40.0))  # 0.005 -> 0.2 at step 60
    assert first_raised_step(records, (KL_GROWING, "mxfp4")) == 60 + SPEC.window // 2
    assert {scope for name, scope in raised(records) if name == KL_GROWING} == {"mxfp4"}


def test_kl_that_only_doubles_raises_nothing_and_the_threshold_is_the_specs() -> None:
    records = with_changes(healthy(), 30, scale_pool_kl("a", 2.5))
    assert raised(records) == set()
    assert (KL_GROWING, "a") in raised(records, CollapseSpec(kl_growth=2.0))


def test_a_one_step_kl_spike_raises_nothing() -> None:
    def spike(record: dict[str, Any]) -> None:
        if record["step"] in (40, 52):
            record["pools"]["a"]["kl_k3"] *= 100
            record["kl_k3"] *= 50

    records = with_changes(healthy(), 1, spike)
    assert all(raised(records[:end]) == set() for end in range(1, len(records) + 1))


def test_kl_below_the_floor_raises_nothing_even_when_it_grows_tenfold() -> None:
    def tiny(record: dict[str, Any]) -> None:
        record["pools"]["a"]["kl_k3"] = 1e-6 if record["step"] < 30 else 1e-5

    records = with_changes(healthy(), 1, tiny)
    assert (KL_GROWING, "a") not in raised(records)
    assert (KL_GROWING, "a") in raised(records, CollapseSpec(kl_floor=0.0))


def test_kl_is_not_judged_before_baseline_and_window_have_data() -> None:
    records = with_changes(healthy(), 6, scale_pool_kl("a", 10.0))
    spec = CollapseSpec(baseline_steps=5, window=5)
    assert not [s for s in assess(records[:9], spec).signs if s.name == KL_GROWING]
    assert (KL_GROWING, "a") in raised(records[:10], spec)


def test_reward_falling_raises_and_recovers() -> None:
    def collapse(record: dict[str, Any]) -> None:
        record["reward"] *= 0.5 if record["step"] < 50 else 1.0

    records = with_changes(healthy(), 30, collapse)
    sign = (REWARD_FALLING, RUN)
    step = first_raised_step(records, sign)
    # the 15-step mean falls below 70 % of 0.5 once 9 of its steps are halved
    assert step is not None and 30 <= step <= 30 + SPEC.reward_window
    assert sign in raised(records[:49])
    assert sign not in raised(records)  # back at its level from step 50
    (found,) = [s for s in assess(records[:49]).signs if s.name == REWARD_FALLING]
    assert found.value < 0.7 * found.reference and found.reference > 0.5


def test_a_reward_drop_below_the_fraction_raises_nothing() -> None:
    def dip(record: dict[str, Any]) -> None:
        record["reward"] = 0.4  # the best smoothed reward is near 0.55: a drop of about 25 %

    records = with_changes(healthy(), 30, dip)
    assert (REWARD_FALLING, RUN) not in raised(records)
    assert (REWARD_FALLING, RUN) in raised(records, CollapseSpec(reward_drop=0.2))


def test_a_non_positive_best_reward_raises_nothing() -> None:
    records = [{"step": s, "reward": -0.1 - 0.1 * s} for s in range(1, 30)]
    assert raised(records) == set()


def test_format_errors_raise_above_the_share_only() -> None:
    def errors(share: float) -> Any:
        def change(record: dict[str, Any]) -> None:
            record["format_error_endings"] = share

        return change

    sign = (FORMAT_ERRORS, RUN)
    assert first_raised_step(with_changes(healthy(), 30, errors(0.8)), sign) == 30 + SPEC.window // 2
    assert raised(with_changes(healthy(), 30, errors(0.45))) == set()
    assert sign in raised(with_changes(healthy(), 30, errors(0.45)), CollapseSpec(format_error_share=0.4))


def test_damaged_records_are_skipped_not_fatal() -> None:
    records: list[Any] = healthy(20)
    records[5]["kl_k3"] = "nan"
    records[6]["reward"] = float("nan")
    records[7]["pools"] = ["not", "a", "map"]
    records[8]["step"] = True
    assert raised(records) == set()
    assert assess([]).signs == ()


def test_smoothing_is_a_trailing_mean() -> None:
    assert smoothed([1, 8, 3, 1, 11], 3) == [4, 4, 5]


def test_the_assessment_is_complete_once_every_run_wide_sign_is_judged() -> None:
    # The KL needs baselineSteps + window steps (15 here), the reward its rewardWindow (20): only at
    # step 20 can "nothing raised" mean healthy (the live status's CollapseRisk is Unknown before).
    spec = CollapseSpec(baseline_steps=10, window=5, reward_window=20)
    records = healthy(30)
    assert [assess(records[:n], spec).complete for n in (14, 15, 19, 20, 30)] == [
        False,
        False,
        False,
        True,
        True,
    ]
    assert (KL_GROWING, RUN) in {(s.name, s.scope) for s in assess(records[:15], spec).signs}
    without_errors = [{k: v for k, v in r.items() if k != "format_error_endings"} for r in records]
    assert not assess(without_errors, spec).complete  # a series never recorded is never judged
    assert not assess([]).complete


def test_the_run_wide_scope_and_pool_label_are_names_no_pool_may_take() -> None:
    # A pool named "run" would share the run-wide scope here, one named "all" the trainer's
    # whole-batch series (pool="all"): the API refuses both (mixrl.api.rules).
    from mixrl.api.rules import RESERVED_SERIES_POOL_NAMES
    from mixrl.operator.builders.monitoring import RUN_POOL
    from mixrl.operator.controller.live_status import ALL_POOLS
    from mixrl.rl.trainer.telemetry import ALL_POOLS as TRAINER_ALL_POOLS

    assert {RUN, ALL_POOLS, TRAINER_ALL_POOLS, RUN_POOL} == RESERVED_SERIES_POOL_NAMES


def test_the_default_reward_window_keeps_noisy_plateaus_quiet_where_a_short_one_does_not() -> None:
    assert false_alarm_rate(SPEC, seeds=40, steps=200) == 0.0
    assert false_alarm_rate(CollapseSpec(reward_window=5), seeds=40, steps=200) > 0.5
