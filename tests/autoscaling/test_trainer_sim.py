"""The trainer-coupled fleet model and the strategies it compares (mixrl/sim/trainer_coupled.py)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mixrl.operator.autoscaling.policy import PolicyConfig
from mixrl.rl.router.shares import REBALANCE_START, REBALANCE_STOP
from mixrl.sim.fleet import FleetPool
from mixrl.sim.trainer_coupled import (
    RunResult,
    Strategy,
    TrainerRun,
    objective_config,
    simulate_run,
    static_sized_to_trainer,
)

from ..fakes import script_module

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
    grown = [a for a in ours.actions if a[1] == "dear" and a[3] > a[2] and a[0] >= 3600]
    # The replacements of the lost replicas are Unschedulable at once (no node): the cluster says
    # they are stuck, so the dear pool takes over within a poll, not after the pending timeout.
    assert grown and grown[0][0] <= 3600 + 30
    without_pods = simulate_run(POOLS, lossy, replace(mixrl(lossy), reads_pods=False))
    regrown = [a for a in without_pods.actions if a[1] == "dear" and a[3] > a[2] and a[0] >= 3600]
    assert regrown and 3600 + 600 <= regrown[0][0] <= 3600 + 600 + 2 * 30  # the clock: the timeout
    assert ours.idle_s < without_pods.idle_s
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
    spot = [(t, before, after) for t, pool, before, after in ours.actions if pool == "spot" and t >= 3600]
    release = next((t, after) for t, before, after in spot if after < before)
    assert release[0] <= 3600 + 30  # the cluster reports the replacements Unschedulable at once
    assert max((after for t, _, after in spot if t > release[0]), default=0) <= release[1] + 1
    dear = [after for t, pool, _, after in ours.actions if pool == "dear" and t >= release[0]]
    assert dear and min(dear) >= 3, dear  # it settles (its rate measured), it is not given back


# ----------------------------------------------------------------------------- the trainer's cost


def static(replicas: dict[str, int]) -> Strategy:
    return Strategy("static", "static", static_replicas=replicas)


def test_the_trainer_is_billed_for_the_whole_run_fed_or_idle() -> None:
    billed = replace(RUN, trainer_gpus=8, trainer_price_per_gpu_hour=3.5)
    fed = simulate_run(POOLS, billed, static(static_sized_to_trainer(POOLS, billed)))
    starved = simulate_run(POOLS, billed, static({"spot": 2, "dear": 0}))
    for result in (fed, starved):
        assert result.trainer_cost == pytest.approx(8 * 3.5 * 2.0)  # GPUs × price × hours
        assert result.total_cost == pytest.approx(result.cost + result.trainer_cost)
        assert result.total_cost_per_step == pytest.approx(result.total_cost / result.steps)
    assert starved.steps < 0.5 * fed.steps
    # Fewer samplers cost less per step on their own, but the idle trainer's hours make the
    # starved run's steps dearer in all.
    assert starved.cost_per_step < fed.cost_per_step
    assert starved.total_cost_per_step > 1.5 * fed.total_cost_per_step
    # Without a trainer price the total is the samplers' (the default: 0 GPUs).
    plain = simulate_run(POOLS, RUN, static({"spot": 2, "dear": 0}))
    assert plain.trainer_cost == 0 and plain.total_cost_per_step == plain.cost_per_step


def test_every_step_pauses_generation_for_the_weight_update_and_is_billed_as_paused_that_long() -> None:
    sized = static(static_sized_to_trainer(POOLS, RUN))
    result = simulate_run(POOLS, RUN, sized)
    # A fixed fleet: the paused share of its billed capacity is the steps' pauses over the run.
    expected = result.steps * RUN.pause_seconds(POOLS)[0] / result.seconds  # SGLang: 20 s assumed
    assert result.extra["paused_share"] == pytest.approx(expected, rel=0.02)
    assert result.extra["busy_share"] <= 1.0 + 1e-9  # never more tokens than unpaused slots allow


def test_the_trainer_is_priced_from_the_runs_spec_and_the_default_table() -> None:
    from mixrl.api.gpus import default_price
    from mixrl.sim.simulate import DEFAULT_SPEC, trainer_from_spec

    # examples/rlrun-mixed.yaml: 4 nodes × 8 H200 GPUs; the RLRun states no trainer price, so the
    # table the operator's live status bills the trainer at (mixrl.api.gpus) prices it.
    assert trainer_from_spec(str(DEFAULT_SPEC)) == (32, default_price("H200"))


def _bench() -> Any:
    return script_module(
        "bench_autoscaling", Path(__file__).resolve().parents[2] / "bench" / "autoscaling.py"
    )


def test_changing_runs_are_judged_by_the_total_cost_per_step_steady_ones_by_the_samplers() -> None:
    meets_target = _bench().meets_target

    def result(steps: int, sampler: float, trainer: float) -> RunResult:
        out = simulate_run(POOLS, replace(RUN, hours=0.05, warmup_s=0), static({"spot": 1, "dear": 0}))
        return replace(out, steps=steps, cost=sampler, trainer_cost=trainer, seconds=3600.0, actions=[])

    # Run 7's shape: 1.26× the steps at 1.10× the sampler $/step, the same trainer bill.
    ours, base = result(28, 28 * 3.15, 112.0), result(22, 22 * 2.85, 112.0)
    assert ours.cost_per_step > 1.05 * base.cost_per_step
    assert ours.total_cost_per_step < base.total_cost_per_step
    assert meets_target(ours, base, base, steady=False)[0]
    # Steady runs keep the sampler-only bound, against the fleet re-sized with hindsight.
    assert not meets_target(ours, base, base, steady=True)[0]
    assert meets_target(result(29, 29 * 2.9, 112.0), ours, base, steady=True)[0]  # ≤ 1.05×, ≥ 0.97×
    assert not meets_target(result(21, 21 * 2.8, 112.0), ours, base, steady=True)[0]  # 0.95× its steps
    # More steps but a dearer total: not met.
    assert not meets_target(result(23, 23 * 6.0, 112.0), base, base, steady=False)[0]
    # Fewer steps at a cheaper total: not met either.
    assert not meets_target(result(21, 21 * 1.0, 112.0), base, base, steady=False)[0]
    # More than one reversal an hour: not met, steady or not.
    busy = replace(ours, actions=[(60.0 * k, "spot", k % 2, 1 - k % 2) for k in range(4)])
    assert not meets_target(busy, base, base, steady=False)[0]


def test_the_time_to_regain_is_against_hindsight_after_every_change() -> None:
    bench = _bench()
    run = replace(
        RUN,
        step_seconds=((0.0, 120.0), (1800.0, 80.0)),
        spot_pool="spot",
        loss_at_s=900.0,
        back_at_s=1500.0,
        repeat_every_s=3600.0,
        quota=((2000.0, "dear", 2),),
    )
    assert bench.changes_of(run) == [900.0, 1500.0, 1800.0, 2000.0, 4500.0, 5100.0]
    base = simulate_run(POOLS, replace(RUN, hours=0.05, warmup_s=0), static({"spot": 1, "dear": 0}))

    def steps(gap: tuple[float, float] = (0.0, 0.0)) -> RunResult:
        """A step every minute for an hour, none inside ``gap``."""
        times = [float(t) for t in range(60, 3600, 60) if not gap[0] < t < gap[1]]
        return replace(base, step_times=times, seconds=3600.0)

    hindsight = steps()
    assert bench.regain_after(steps(), hindsight, 600.0) == 0.0
    # No step from 1200 s to 1800 s: the first 900 s window holding 95 % of hindsight's 15 steps
    # starts at 1740 s (1800 ... 2640 s).
    assert bench.regain_after(steps((1200.0, 1800.0)), hindsight, 1200.0) == 540.0
    assert bench.regain_after(steps((1200.0, 3600.0)), hindsight, 1200.0) == math.inf


# ----------------------------------------------------------------------------- the router's rebalancing

FLEET = {"spot": 4, "dear": 4}  # spot's share of ready capacity: 12.8 / 20 = 0.64


def _share_after_loss(result: RunResult, run: TrainerRun) -> tuple[float, float]:
    """(the spot pool's share of the live sessions, its share of ready capacity) right after the loss."""
    index = int(np.searchsorted(result.times, run.loss_at_s + 1))
    held = result.sessions[index]
    spot_replicas = result.replicas[index][0]
    nodes = math.floor(FLEET["spot"] * (1 - run.loss_fraction))
    ready_capacity = min(spot_replicas, nodes) * 3.2
    return float(held[0] / held.sum()), ready_capacity / (ready_capacity + FLEET["dear"] * 1.8)


def test_a_pool_that_lost_most_of_its_replicas_sheds_sessions_by_the_routers_rule() -> None:
    lossy = replace(RUN, hours=1.0, warmup_s=1200, spot_pool="spot", loss_at_s=1800.0, loss_fraction=0.75)
    result = simulate_run(POOLS, lossy, static(FLEET), sample_every_s=10)
    held, share = _share_after_loss(result, lossy)
    # 4 → 1 spot replica: its share of capacity falls to 0.31 while it holds 0.64 of the sessions
    # (2.1×, above the router's 1.5× start): it sheds down to 1.1× its share, within a session.
    assert share == pytest.approx(3.2 / 10.4)
    assert held <= REBALANCE_STOP * share + 2 / result.sessions.sum(axis=1).max()
    assert held >= share  # ...and not below: the rule stops there
    assert result.sessions_rebalanced > 0


def test_without_the_routers_rule_the_lost_pools_sessions_stay_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model calls the router's rule (mixrl.rl.router.shares.keeps_draining, through the
    router's drain_step), not a copy: with it switched off where the router defines it, the dead
    replicas' sessions stay in their pool (they are not dropped)."""
    from mixrl.rl.router import shares

    monkeypatch.setattr(shares, "keeps_draining", lambda *_: False)
    lossy = replace(RUN, hours=1.0, warmup_s=1200, spot_pool="spot", loss_at_s=1800.0, loss_fraction=0.75)
    result = simulate_run(POOLS, lossy, static(FLEET), sample_every_s=10)
    held, share = _share_after_loss(result, lossy)
    assert held > REBALANCE_START * share
    assert result.sessions_rebalanced == 0


def test_a_pool_that_grew_while_over_its_share_and_fell_back_has_lost_capacity() -> None:
    """The balanced count rises with the ready replicas, as the router's share refresh raises it
    (mixrl.rl.router.shares.balanced_after_refresh): a pool that grew 2 → 4 while holding more than
    its share and then fell back to 2 lost capacity, although it is back at its old count."""
    from mixrl.sim.trainer_coupled import _rebalance

    names = ("a", "b")
    sessions = np.array([60.0, 40.0])
    versions = [deque([[0.0, 60.0]]), deque([[0.0, 40.0]])]
    draining, balanced = [False, False], np.array([2, 4])  # a had 2 when last at its share
    ready = np.array([4, 4])  # a grew to 4 while holding 60 of 100 (over its half)
    assert _rebalance(sessions, versions, ready, ready * 1.0, names, draining, balanced) == 0
    assert balanced.tolist() == [4, 4]
    ready = np.array([2, 4])  # ...and lost 2: 60 held against a share of 33.3 (1.8×)
    moved = _rebalance(sessions, versions, ready, ready * 1.0, names, draining, balanced)
    assert moved > 0
    assert sessions[0] <= REBALANCE_STOP * 100 / 3 + 1
    assert sessions.sum() == pytest.approx(100.0)


def test_a_small_loss_below_the_routers_start_moves_no_session() -> None:
    # 4 → 3 spot replicas: share 9.6 / 16.8 = 0.57 against 0.64 held (1.12×, under 1.5×).
    lossy = replace(RUN, hours=1.0, warmup_s=1200, spot_pool="spot", loss_at_s=1800.0, loss_fraction=0.25)
    result = simulate_run(POOLS, lossy, static(FLEET), sample_every_s=10)
    held, share = _share_after_loss(result, lossy)
    assert share == pytest.approx(9.6 / 16.8)
    assert held > share  # over its share, yet under the start: the router leaves it
    assert result.sessions_rebalanced == 0


def test_a_cold_start_longer_than_the_pending_timeout_is_not_released() -> None:
    """A new GPU node takes 10–12 minutes: longer than the default pending timeout (600 s).  With
    the cluster's word (a scheduled replica is a cold start) nothing is released; with the clock
    alone every pool went +1/−1 at each timeout (issue #30's finding)."""
    slow = [replace(p, cold_start_s=700.0) for p in POOLS]
    assert all(c.pending_timeout_s is not None and c.pending_timeout_s < 700.0 for c in CONFIGS.values())
    ours = simulate_run(slow, RUN, mixrl())
    clock = simulate_run(slow, RUN, replace(mixrl(), reads_pods=False))
    assert ours.reversals() == 0
    assert clock.reversals() > 0
    assert ours.steps >= clock.steps


def test_a_speeding_trainer_is_followed_a_cold_start_ahead() -> None:
    """A trainer speeding up 240 → 120 s per step over the second half hour while new replicas
    take 11 minutes: planning one learned cold start ahead idles it less than following it."""
    slow = [replace(p, cold_start_s=660.0) for p in POOLS]
    ramp = tuple((1800.0 + 225.0 * k, 240.0 - 15.0 * k) for k in range(1, 9))
    run = replace(RUN, step_seconds=((0.0, 240.0), *ramp))
    ahead = simulate_run(slow, run, mixrl(run))
    follows = simulate_run(
        slow, run, replace(mixrl(run), objective=replace(objective_config(run), plan_ahead=False))
    )
    assert ahead.actions != follows.actions
    assert ahead.idle_share < follows.idle_share
    assert ahead.steps >= follows.steps
    assert ahead.reversals() <= 1


# ----------------------------------------------------------------------------- issue #30's harder runs


def test_noisy_signals_change_what_the_policy_reads_not_the_fleet() -> None:
    from mixrl.sim.trainer_coupled import SignalNoise

    noisy = replace(RUN, noise=SignalNoise(sigma=0.3, delay_s=60, miss=0.2))
    fixed = Strategy("s", "static", static_replicas={"spot": 7, "dear": 0})
    # A static fleet reads nothing: the same fleet with or without the noise, to the trajectory.
    assert simulate_run(POOLS, noisy, fixed).steps == simulate_run(POOLS, RUN, fixed).steps
    calm, shaken = simulate_run(POOLS, RUN, mixrl()), simulate_run(POOLS, noisy, mixrl(noisy))
    assert calm.actions != shaken.actions  # the policy saw other figures


def test_a_quota_caps_new_replicas_and_keeps_the_running_ones() -> None:
    capped = replace(RUN, quota=((600.0, "spot", 2),))
    grow = Strategy(
        "s",
        "static",
        static_replicas={"spot": 4, "dear": 0},
        static_schedule=((900.0, {"spot": 6, "dear": 0}),),
    )
    result = simulate_run(POOLS, capped, grow)
    # 4 ran before the cut and keep running; the 2 asked for after it stay Pending, unbilled.
    assert result.cost == pytest.approx(4 * 6.0 * 2.0, rel=1e-6)


def test_a_pool_that_delivers_less_than_declared_makes_fewer_steps() -> None:
    fleet = Strategy("s", "static", static_replicas={"spot": 7, "dear": 0})
    slow = simulate_run(POOLS, replace(RUN, capacity_error={"spot": 0.5}), fleet)
    assert slow.steps_per_hour < 0.6 * simulate_run(POOLS, RUN, fleet).steps_per_hour


def test_the_models_router_shares_by_a_measured_capacity_once_trusted() -> None:
    """The router's own rule, called: a pool delivering a third of its declared capacity is shared
    by what it delivers once measured with trust, declared until then; a small error changes nothing."""
    from mixrl.sim.trainer_coupled import _router_capacity

    names = ["spot", "dear", "other"]
    declared = np.array([3.2, 1.8, 1.0])
    delivered = np.array([3.2 / 3, 1.8, 1.0]) * 1000.0
    trusted = np.array([True, True, True])
    assert _router_capacity(names, declared, delivered, trusted) == pytest.approx([3.2 / 3, 1.8, 1.0])
    untrusted = np.array([False, True, True])
    assert _router_capacity(names, declared, delivered, untrusted).tolist() == [3.2, 1.8, 1.0]
    close = np.array([3.2 * 0.8, 1.8, 1.0]) * 1000.0  # 1.25x off: within the router's 1.5x
    assert _router_capacity(names, declared, close, trusted).tolist() == [3.2, 1.8, 1.0]


def test_the_hindsight_fleet_is_resized_for_each_phase() -> None:
    from mixrl.sim.trainer_coupled import hindsight_schedule

    faster = replace(RUN, step_seconds=((0.0, 120.0), (3600.0, 60.0)))
    start, schedule = hindsight_schedule(POOLS, faster)
    assert start == static_sized_to_trainer(POOLS, faster)
    assert [t for t, _ in schedule] == [3600.0]
    assert schedule[0][1]["spot"] + schedule[0][1]["dear"] > start["spot"] + start["dear"]  # twice the demand
    lossy = replace(RUN, spot_pool="spot", loss_at_s=1200.0, back_at_s=2400.0, repeat_every_s=3600.0)
    _, outages = hindsight_schedule(POOLS, lossy)
    assert [t for t, _ in outages] == [1200.0, 2400.0, 3600.0, 4800.0, 6000.0]
    assert outages[0][1]["spot"] == math.floor(start["spot"] / 2) and outages[1][1] == start


def test_keda_on_the_trainers_demand_sizes_pools_by_their_share() -> None:
    from mixrl.sim.simulate import keda_configs

    demand = Strategy(
        "keda-demand", "queue", configs=keda_configs(POOLS, CONFIGS), sustained=False, reads_pods=False,
        objective=objective_config(RUN), demand_shares={"spot": 1.0, "dear": 0.0},
    )  # fmt: skip
    result = simulate_run(POOLS, RUN, demand)
    static = static_sized_to_trainer(POOLS, RUN)
    assert abs(result.replicas[-1][0] - static["spot"]) <= 2  # the spot pool carries the demand
    assert result.steps_per_hour >= 0.9 * 30.0
