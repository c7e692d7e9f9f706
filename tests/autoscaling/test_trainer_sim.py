"""The trainer-coupled fleet model and the strategies it compares (mixrl/operator/autoscaling/trainer_sim.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mixrl.operator.autoscaling.fleet import FleetPool
from mixrl.operator.autoscaling.policy import PolicyConfig
from mixrl.operator.autoscaling.trainer_sim import (
    Strategy,
    TrainerRun,
    objective_config,
    simulate_run,
    static_sized_to_trainer,
)

POOLS = [
    FleetPool("spot", "B200", 3.2, 1, 6.0, 1, 12, 240.0),  # $1.88 per capacity-hour
    FleetPool("dear", "H200", 1.8, 1, 3.5 * 1.2, 0, 12, 200.0),  # $2.33
]
CONFIGS = {p.name: PolicyConfig(p.min_replicas, p.max_replicas, 16.0 * p.capacity) for p in POOLS}
RUN = TrainerRun(hours=2.0, step_size=512, concurrency=512, step_seconds=((0.0, 120.0),), warmup_s=2400)
RUN = replace(RUN, tokens_per_trajectory=(4000.0, 4000.0))


def mixrl(run: TrainerRun = RUN) -> Strategy:
    return Strategy("mixrl", "trainer", configs=CONFIGS, objective=objective_config(run))


def test_static_sizing_covers_the_trainer_and_its_weight_updates() -> None:
    sized = static_sized_to_trainer(POOLS, RUN)
    # 512 per 120 s × 4000 tokens / 1000 per capacity, over 100 of every 120 s: 20.5 capacity.
    assert sized == {"spot": 7, "dear": 0}
    result = simulate_run(POOLS, RUN, Strategy("static", "static", static_replicas=sized))
    assert result.steps_per_hour == pytest.approx(30.0, abs=0.6)  # the trainer's own rate
    assert result.cost == pytest.approx(7 * 6.0 * 2.0, rel=1e-6)  # replicas × price × hours


def test_runs_are_deterministic_and_count_what_they_report() -> None:
    one, two = simulate_run(POOLS, RUN, mixrl(), seed=3), simulate_run(POOLS, RUN, mixrl(), seed=3)
    assert (one.steps, one.cost, one.actions) == (two.steps, two.cost, two.actions)
    assert sum(one.staleness.values()) == one.steps * RUN.step_size
    assert 0 <= one.idle_share <= 1


def test_mixrl_matches_the_sized_static_fleet_on_a_steady_run_without_reversals() -> None:
    ours = simulate_run(POOLS, RUN, mixrl())
    static = simulate_run(
        POOLS, RUN, Strategy("s", "static", static_replicas=static_sized_to_trainer(POOLS, RUN))
    )
    assert ours.reversals() == 0
    assert ours.steps_per_hour >= 0.95 * static.steps_per_hour
    assert ours.cost_per_step <= 1.05 * static.cost_per_step


def test_the_queue_policy_pays_for_what_the_rollout_concurrency_creates() -> None:
    trainer_bound = replace(RUN, step_seconds=((0.0, 240.0),))
    queue = simulate_run(POOLS, trainer_bound, Strategy("queue", "queue", configs=CONFIGS))
    ours = simulate_run(POOLS, trainer_bound, mixrl(trainer_bound))
    assert queue.steps_per_hour == pytest.approx(ours.steps_per_hour, rel=0.05)
    assert queue.cost_per_step > 1.5 * ours.cost_per_step


def test_capacity_loss_is_replaced_from_another_pool() -> None:
    lossy = replace(RUN, hours=3.0, spot_pool="spot", loss_at_s=3600.0)
    ours = simulate_run(POOLS, lossy, mixrl(lossy))
    static = simulate_run(
        POOLS, lossy, Strategy("s", "static", static_replicas=static_sized_to_trainer(POOLS, RUN))
    )
    grown = [a for a in ours.actions if a[1] == "dear" and a[3] > a[2] and a[0] > 3600]
    assert grown and grown[0][0] <= 3600 + 600 + 2 * 30  # after the pending timeout, within a poll or two
    assert static.time_to_regain() == float("inf")
    assert ours.time_to_regain() < 1800
    assert ours.steps_per_hour > 1.05 * static.steps_per_hour


def test_a_gpu_budget_is_kept() -> None:
    result = simulate_run(POOLS, RUN, mixrl(), gpu_budget=5)
    assert result.gpus_max <= 5 and result.gpu_seconds_over_budget == 0


def test_the_model_keeps_the_lost_pool_on_probation_as_the_loop_does() -> None:
    """The simulator calls the loop's rule-8 step (policy.fleet_pending): after the pending timeout
    released the spot pool's replicas that have no node, the pool asks for at most one more (the
    probe) while its nodes stay gone, and the replacing pool is not given back."""
    lossy = replace(RUN, hours=3.0, spot_pool="spot", loss_at_s=3600.0)
    ours = simulate_run(POOLS, lossy, mixrl(lossy))
    spot = [(t, before, after) for t, pool, before, after in ours.actions if pool == "spot" and t > 3600]
    release = next((t, after) for t, before, after in spot if after < before)
    assert release[0] <= 3600 + 600 + 2 * 30
    assert max((after for t, _, after in spot if t > release[0]), default=0) <= release[1] + 1
    dear = [after for t, pool, _, after in ours.actions if pool == "dear" and t >= release[0]]
    assert dear and min(dear) >= 3, dear  # it settles (its rate measured), it is not given back
