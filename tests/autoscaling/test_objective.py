"""The trainer objective (``autoscaling.objective: trainer``), pure: demand, supply, fill, holds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mixrl.operator.autoscaling.fleet_objective import (
    FleetPool,
    ObjectiveConfig,
    ObjectiveMemory,
    TrainerSignals,
    busy_trend,
    demand_of,
    plan_fleet,
    stabilized_plan,
    update_memory,
)
from mixrl.operator.autoscaling.policy import PolicyState

CONFIG = ObjectiveConfig(step_size=1000, concurrency=4000, sessions_per_capacity=10, idle_target=0.0)
# 1000 trajectories per 100 s of trainer compute: 10 trajectories/s at full speed.
STEADY = TrainerSignals(step_rate=0.01, idle_share=0.0, buffered=500.0, in_flight=1000.0, busy_step_s=100.0)
# Per replica: cheap delivers 1 trajectory/s for $2/h, dear 2/s for $8/h (twice the cost per unit).
MEMORY = ObjectiveMemory(rates={"cheap": 1.0, "dear": 2.0}, busy_step_s=100.0)


def pool(name: str, replicas: int, **kw: object) -> FleetPool:
    fields: dict = dict(
        ready=replicas,
        capacity=1.0 if name == "cheap" else 2.0,
        gpus_per_replica=1,
        price_per_gpu_hour=2.0 if name == "cheap" else 8.0,
        min_replicas=0,
        max_replicas=6,
    )
    fields.update(kw)
    return FleetPool(name, replicas, **fields)


def test_demand_is_the_trainers_rate_less_its_idle_target() -> None:
    config = replace(CONFIG, idle_target=0.1)
    assert demand_of(STEADY, config, 100.0) == pytest.approx(9.0)


@pytest.mark.parametrize(
    ("buffered", "in_flight", "expected"),
    [
        (500.0, 1000.0, 10.0),  # 1.5 steps: inside [1, 2]
        (0.0, 400.0, 10.0 + 600 / 300),  # 0.4 steps: 600 short, closed over 300 s
        (2500.0, 500.0, 10.0 - 1000 / 300),  # 3 steps: 1000 over the top
        (None, 400.0, 10.0),  # the buffer's series did not answer: no correction, not "empty"
        (0.0, None, 10.0),  # nor the router's
    ],
)
def test_the_backlog_outside_its_band_corrects_the_demand(
    buffered: float | None, in_flight: float | None, expected: float
) -> None:
    signals = replace(STEADY, buffered=buffered, in_flight=in_flight)
    assert demand_of(signals, CONFIG, 100.0) == pytest.approx(expected)


def test_busy_time_comes_from_the_step_rate_when_the_gauge_is_missing() -> None:
    signals = replace(STEADY, busy_step_s=None, step_rate=0.005, idle_share=0.5)
    assert update_memory(ObjectiveMemory(), [], signals, CONFIG).busy_step_s == pytest.approx(100.0)


def test_throughput_is_divided_by_how_busy_the_rollout_kept_the_pool() -> None:
    half_busy = pool("cheap", 4, throughput=2.0, load=20.0)  # 20 sessions on 40 slots
    memory = update_memory(ObjectiveMemory(), [half_busy], STEADY, CONFIG)
    assert memory.rates["cheap"] == pytest.approx(1.0)  # 2 / 4 replicas / 0.5 busy
    idle = pool("cheap", 4, throughput=0.1, load=2.0)  # 5 % busy: says nothing about speed
    assert update_memory(memory, [idle], STEADY, CONFIG).rates["cheap"] == pytest.approx(1.0)


def test_cheapest_throughput_first_and_pools_at_zero_are_woken() -> None:
    plan = plan_fleet([pool("cheap", 0), pool("dear", 1)], STEADY, CONFIG, MEMORY)
    # 10 trajectories/s: six cheap replicas (its maximum) then two dear ones.
    assert plan.targets == {"cheap": 6, "dear": 2}
    assert plan.supply == pytest.approx(10.0)


def test_the_dearest_pool_is_emptied_first() -> None:
    fewer = replace(STEADY, busy_step_s=200.0)  # the trainer slowed to half: 5 trajectories/s
    memory = replace(MEMORY, busy_step_s=200.0)
    plan = plan_fleet([pool("cheap", 6), pool("dear", 2)], fewer, CONFIG, memory)
    assert plan.targets == {"cheap": 5, "dear": 0}


def test_within_tolerance_nothing_moves() -> None:
    plan = plan_fleet([pool("cheap", 6), pool("dear", 2)], replace(STEADY, busy_step_s=104.0), CONFIG, MEMORY)
    assert plan.targets == {"cheap": 6, "dear": 2} and "within tolerance" in plan.reasons["cheap"]


# A trainer speeding up: 130 s of compute per step ten minutes ago, 100 s now (-0.05 s per s).
SPEEDING = tuple((t, 130.0 - 0.05 * t) for t in (0.0, 150.0, 300.0, 450.0))


def test_the_trend_is_the_least_squares_slope_once_it_spans_enough() -> None:
    assert busy_trend([*SPEEDING, (600.0, 100.0)]) == pytest.approx(-0.05)
    assert busy_trend(SPEEDING[:2]) is None  # two points, 150 s: not a trend yet


def test_a_speeding_trainer_is_planned_for_one_learned_cold_start_ahead() -> None:
    memory = replace(MEMORY, busy_history=SPEEDING)
    fleet = [pool("cheap", 6, cold_start_s=600.0), pool("dear", 2, cold_start_s=600.0)]
    plan = plan_fleet(fleet, STEADY, CONFIG, memory, now=600.0)
    # 600 s ahead the trainer computes 100 - 30 = 70 s per step: 1000 / 70 = 14.3 trajectories/s,
    # beyond the band around today's 10, which the fleet delivers.
    assert plan.demand == pytest.approx(1000 / 70)
    assert plan.targets == {"cheap": 6, "dear": 5} and "speeding up" in plan.summary
    # Followed only: without a learned cold start, with the plan ahead off, or slowing down.
    unlearned = [replace(p, cold_start_s=None) for p in fleet]
    slowing = replace(MEMORY, busy_history=tuple((t, 70.0 + 0.05 * t) for t, _ in SPEEDING))
    for args in (
        (unlearned, CONFIG, memory),
        (fleet, replace(CONFIG, plan_ahead=False), memory),
        (fleet, CONFIG, slowing),
    ):
        held = plan_fleet(args[0], STEADY, args[1], args[2], now=600.0)
        assert held.targets == {"cheap": 6, "dear": 2} and held.demand == pytest.approx(10.0)


def test_the_plan_ahead_looks_no_further_than_twice_todays_rate() -> None:
    steep = replace(MEMORY, busy_history=tuple((t, 190.0 - 0.15 * t) for t in (0.0, 150.0, 300.0, 450.0)))
    fleet = [pool("cheap", 6, cold_start_s=600.0), pool("dear", 2, cold_start_s=600.0)]
    plan = plan_fleet(fleet, STEADY, CONFIG, steep, now=600.0)
    assert plan.demand == pytest.approx(20.0)  # 100 - 90 = 10 s per step, held at 100 / 2


def test_budgets_bound_the_fill() -> None:
    gpus = plan_fleet([pool("cheap", 0), pool("dear", 0)], STEADY, replace(CONFIG, gpu_budget=7), MEMORY)
    assert gpus.targets == {"cheap": 6, "dear": 1}
    dollars = plan_fleet(
        [pool("cheap", 0), pool("dear", 0)], STEADY, replace(CONFIG, cost_budget_per_hour=20.0), MEMORY
    )
    assert dollars.targets == {"cheap": 6, "dear": 1}  # $12 + $8


def test_replicas_the_concurrency_cannot_fill_are_not_added_and_the_need_is_reported() -> None:
    small = replace(CONFIG, concurrency=60)  # 60 sessions keep 6 capacity busy
    plan = plan_fleet([pool("cheap", 0), pool("dear", 0)], STEADY, small, MEMORY)
    assert plan.targets == {"cheap": 6, "dear": 0}
    assert plan.recommended_concurrency == 100  # 6 + 4 capacity (two dear replicas) × 10 sessions
    assert "not changed live" in plan.summary


def test_without_a_measured_step_the_fleet_holds_and_a_sleeping_one_wakes_cheapest() -> None:
    nothing = TrainerSignals(None, None, None, None)
    held = plan_fleet([pool("cheap", 2), pool("dear", 1)], nothing, CONFIG, ObjectiveMemory())
    assert held.targets == {"cheap": 2, "dear": 1} and held.demand is None
    asleep = plan_fleet([pool("cheap", 0), pool("dear", 0)], nothing, CONFIG, ObjectiveMemory())
    assert asleep.targets == {"cheap": 1, "dear": 0}


def test_stuck_replicas_are_not_supply_and_the_demand_moves_to_another_pool() -> None:
    pools = [pool("cheap", 6, ready=2, stuck=4, ceiling=2), pool("dear", 1)]
    plan = plan_fleet(pools, STEADY, CONFIG, MEMORY)
    assert plan.targets == {"cheap": 2, "dear": 4}


def test_cuts_wait_for_the_window() -> None:
    states = {"cheap": PolicyState(), "dear": PolicyState()}
    pools = [pool("cheap", 6), pool("dear", 2)]
    plan, states = stabilized_plan(pools, STEADY, CONFIG, MEMORY, states, 0.0, 300.0)
    assert plan.targets == {"cheap": 6, "dear": 2}
    fewer = replace(STEADY, busy_step_s=200.0)
    memory = replace(MEMORY, busy_step_s=200.0)
    held, states = stabilized_plan(pools, fewer, CONFIG, memory, states, 30.0, 300.0)
    assert held.targets == {"cheap": 6, "dear": 2}  # the window still holds them
    later, _ = stabilized_plan(pools, fewer, CONFIG, memory, states, 301.0, 300.0)
    assert later.targets == {"cheap": 5, "dear": 0}


def test_a_weight_update_floor_holds_but_is_not_remembered() -> None:
    states = {"cheap": PolicyState(), "dear": PolicyState()}
    fewer = replace(STEADY, busy_step_s=200.0)
    memory = replace(MEMORY, busy_step_s=200.0)
    updating = [pool("cheap", 6, floor=6), pool("dear", 2, floor=2)]
    held, states = stabilized_plan(updating, fewer, CONFIG, memory, states, 400.0, 300.0)
    assert held.targets == {"cheap": 6, "dear": 2}
    after, _ = stabilized_plan(
        [pool("cheap", 6), pool("dear", 2)], fewer, CONFIG, memory, states, 430.0, 300.0
    )
    assert after.targets == {"cheap": 5, "dear": 0}


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"^ObjectiveConfig\.step_size: must be > 0, got 0$"):
        ObjectiveConfig(step_size=0, concurrency=1, sessions_per_capacity=1)


def test_a_stuck_replica_kept_by_min_replicas_is_not_counted_as_supply() -> None:
    # cheap keeps its minimum of one replica, but that replica is stuck Pending: dear covers it all.
    pools = [pool("cheap", 1, ready=0, stuck=1, ceiling=1, min_replicas=1), pool("dear", 0)]
    nine = replace(STEADY, busy_step_s=1000 / 9)  # 9 trajectories/s
    plan = plan_fleet(pools, nine, CONFIG, replace(MEMORY, busy_step_s=1000 / 9))
    assert plan.targets == {"cheap": 1, "dear": 5}  # 9 / 2 → 5; counting the stuck one gave 4


def test_a_trainer_starving_inside_the_band_gets_one_replica_after_the_stall_time() -> None:
    # Supply 4 + 6 = the demand of 10: inside the band, and no cheaper mix covers it (cheap can
    # reach 5, so 5 + 6 is the cheapest), so the re-mix has nothing to do.
    fleet = [pool("cheap", 4, max_replicas=5), pool("dear", 3)]
    starving = replace(STEADY, idle_share=0.3)  # yet the trainer waits: the estimates are optimistic
    config = replace(CONFIG, stall_after_s=600.0)
    first = plan_fleet(fleet, starving, config, MEMORY, now=1000.0)
    assert first.targets == {"cheap": 4, "dear": 3} and first.memory.starving_since == 1000.0
    early = plan_fleet(fleet, starving, config, first.memory, now=1500.0)
    assert early.targets == {"cheap": 4, "dear": 3} and early.memory.starving_since == 1000.0
    late = plan_fleet(fleet, starving, config, early.memory, now=1600.0)
    assert late.targets == {"cheap": 5, "dear": 3} and late.stalled is None  # the cheapest that can grow
    assert "one more replica of cheap" in late.reasons["cheap"] and "600 s" in late.reasons["cheap"]
    assert late.memory.starving_since == 1600.0  # the clock starts again
    starting = [pool("cheap", 5, ready=4, max_replicas=5), pool("dear", 3)]  # the added one is starting
    cold = plan_fleet(starting, starving, config, replace(late.memory, starving_since=0.0), now=1650.0)
    assert cold.targets == {"cheap": 5, "dear": 3} and cold.memory.starving_since == 1650.0  # not a stall
    fed = plan_fleet(fleet, STEADY, config, late.memory, now=1700.0)
    assert fed.memory.starving_since is None  # no longer starving: no clock
    assert plan_fleet(fleet, starving, config, MEMORY).memory.starving_since is None  # no clock, no guard


def test_a_stall_no_replica_can_help_says_why() -> None:
    fleet = [pool("cheap", 4, max_replicas=4), pool("dear", 3, max_replicas=3)]
    starving = replace(STEADY, idle_share=0.3)
    memory = replace(MEMORY, starving_since=0.0)
    plan = plan_fleet(fleet, starving, replace(CONFIG, stall_after_s=600.0), memory, now=900.0)
    assert plan.targets == {"cheap": 4, "dear": 3}
    assert plan.stalled == "cheap at its maximum (4); dear at its maximum (3)"
    assert "no pool can grow: cheap at its maximum" in plan.summary and "idle 30% (target 0%)" in plan.summary
    budget = plan_fleet(
        [pool("cheap", 4), pool("dear", 3)], starving, replace(CONFIG, gpu_budget=7), memory, now=900.0
    )
    assert budget.stalled is not None and "would exceed the GPU budget" in budget.stalled
    with pytest.raises(ValueError, match="stall_after_s"):
        replace(CONFIG, stall_after_s=0.0)


def test_inside_the_band_a_mix_that_pays_grows_the_cheap_pool_and_a_small_saving_does_not() -> None:
    # 4 cheap + 3 dear cover the demand of 10 at $32/h; 6 cheap + 2 dear would at $28/h (12.5 %).
    fleet = [pool("cheap", 4), pool("dear", 3)]
    plan = plan_fleet(fleet, STEADY, CONFIG, MEMORY)
    assert plan.targets == {"cheap": 6, "dear": 3}  # the growth only: dear goes when its window ends
    assert "re-mix: cheap +2" in plan.reasons["cheap"] and "12%" in plan.reasons["cheap"]
    assert "within tolerance" in plan.reasons["dear"] and not plan.filled
    # Once cheap is up the supply is above the band and the fill cuts dear (dearest emptied first).
    grown = plan_fleet([pool("cheap", 6), pool("dear", 3)], STEADY, CONFIG, MEMORY)
    assert grown.targets == {"cheap": 6, "dear": 2} and grown.filled
    # A saving that does not repay paying for both mixes over the overlap within the payback: none.
    slow = replace(CONFIG, remix_payback_s=60.0)
    assert plan_fleet(fleet, STEADY, slow, MEMORY).targets == {"cheap": 4, "dear": 3}
    # Under REMIX_SAVING (10 %) of the fleet's dollars: none (cheap at $3/h: 6×3 + 2×8 = 34 vs 36).
    near = [pool("cheap", 4, price_per_gpu_hour=3.0), pool("dear", 3)]
    assert plan_fleet(near, STEADY, CONFIG, MEMORY).targets == {"cheap": 4, "dear": 3}


def test_a_probing_pool_keeps_its_probe_and_does_not_count_it_as_supply() -> None:
    # cheap lost its nodes: 2 ready, its probe Pending (stuck, capped in by rule 8: not released).
    fleet = [pool("cheap", 3, ready=2, stuck=1, ceiling=3), pool("dear", 4)]
    assert fleet[0].probing and fleet[0].low == 3
    plan = plan_fleet(fleet, STEADY, CONFIG, MEMORY)
    # Supply 2 + 8 = the demand: held, the probe kept (3), and nothing cut or grown around it.
    assert plan.targets == {"cheap": 3, "dear": 4}
    released = replace(fleet[0], ceiling=2)  # rule 8 releasing it instead: not a probe
    assert not released.probing and released.low == 0
