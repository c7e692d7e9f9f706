"""The weight-update pause per pool in the fleet simulators (mixrl/sim/weight_pause.py, issue #29).

A staged pool (torch engine; BF16 on the broadcast) pauses two of its decode steps, an SGLang pool
on the disk path the whole load (assumed 20 s); the one-second simulators count a pause shorter
than a second as that share of the second's capacity, and ``weight_update_s=20`` is the old model.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mixrl.operator.autoscaling.policy import PolicyConfig
from mixrl.sim.fleet import FleetPool, Workload, simulate
from mixrl.sim.fleet import Strategy as FleetStrategy
from mixrl.sim.simulate import DEFAULT_SPEC, fleet_from_spec, step_sessions
from mixrl.sim.trainer_coupled import (
    Strategy,
    TrainerRun,
    objective_config,
    simulate_run,
    static_sized_to_trainer,
)
from mixrl.sim.weight_pause import (
    OLD_MODEL,
    PAUSE_DECODE_STEPS,
    PAUSED,
    SGLANG_DISK_PAUSE_S,
    STAGED,
    WeightPause,
    paused_fraction,
    weights_gb,
)

POOLS = [
    FleetPool("spot", "B200", 3.2, 1, 6.0, 1, 12, 240.0),
    FleetPool("dear", "H200", 1.8, 1, 3.5 * 1.2, 0, 12, 200.0),
]
TORCH = [replace(p, engine="torch") for p in POOLS]
CONFIGS = {p.name: PolicyConfig(p.min_replicas, p.max_replicas, 16.0 * p.capacity) for p in POOLS}
RUN = TrainerRun(hours=2.0, step_size=512, concurrency=512, step_seconds=((0.0, 120.0),), warmup_s=2400)
RUN = replace(RUN, tokens_per_trajectory=(4000.0, 4000.0))


def static(replicas: dict[str, int]) -> Strategy:
    return Strategy("static", "static", static_replicas=replicas)


# ----------------------------------------------------------------------------- the accounting


def test_a_pause_shorter_than_a_second_pauses_that_share_of_it() -> None:
    assert paused_fraction(0.05, 0.0) == pytest.approx(0.05)
    assert paused_fraction(0.05, 1.0) == 0.0
    assert paused_fraction(0.05, -1.0) == 0.0  # before it began
    assert paused_fraction(2.5, np.arange(4.0)).tolist() == [1.0, 1.0, 0.5, 0.0]
    # 20 s: twenty whole seconds, as the old model paused them.
    assert paused_fraction(20.0, np.arange(22.0)).tolist() == [1.0] * 20 + [0.0, 0.0]
    # Per pool at once.
    assert paused_fraction(np.array([0.032, 20.0]), 0.0).tolist() == pytest.approx([0.032, 1.0])


def test_a_pause_of_p_seconds_removes_p_times_the_billed_capacity_per_step() -> None:
    sized = static({"spot": 7, "dear": 0})
    for pause in (0.05, 0.5, 2.5):
        result = simulate_run(POOLS, replace(RUN, weight_update_s=pause), sized)
        # A fixed fleet: each step pauses p seconds of its whole billed capacity.
        assert result.extra["paused_share"] == pytest.approx(result.steps * pause / result.seconds, rel=0.02)
        assert result.extra["busy_share"] <= 1 + 1e-9
    # And the capacity is really gone: a fleet too small for the trainer, every slot busy,
    # generates its billed capacity's tokens less p seconds of them per step.
    starved = static({"spot": 3, "dear": 0})
    capacity_s = 3 * 3.2 * RUN.hours * 3600
    for pause in (0.05, 5.0):
        result = simulate_run(POOLS, replace(RUN, weight_update_s=pause), starved)
        generated = result.extra["tokens_per_step"] * result.steps
        unpaused = capacity_s - result.steps * pause * 3 * 3.2
        assert generated == pytest.approx(unpaused * RUN.tokens_per_s_per_capacity, rel=2e-3)


def test_a_20_s_pause_reproduces_the_old_models_figures() -> None:
    # The figures of this run before issue #29 (one fixed 20 s pause for the whole fleet, commit
    # 04b7fc1), to the digits the benchmarks print; mixrl's since its band stopped stacking on the
    # idle target (it made 59 steps, idle 2.1 %, at 1.3229 $/step before).
    old = {"static": (60, 1.400, 0.1667, 0.0), "mixrl": (60, 1.400, 0.1667, 0.0)}
    strategies = {
        "static": static(static_sized_to_trainer(POOLS, replace(RUN, weight_update_s=20.0))),
        "mixrl": Strategy("mixrl", "trainer", configs=CONFIGS, objective=objective_config(RUN)),
    }
    for name, strategy in strategies.items():
        for run in (replace(RUN, weight_update_s=20.0), replace(RUN, pause=OLD_MODEL), RUN):
            # RUN itself: per pool, and both pools are SGLang on the disk path, assumed 20 s.
            result = simulate_run(POOLS, run, strategy)
            figures = (
                result.steps,
                round(result.cost_per_step, 4),
                round(result.extra["paused_share"], 4),
                round(result.idle_share, 4),
            )
            assert figures == old[name], (name, run.weight_update_s, run.pause)


def test_weight_update_s_overrides_the_per_pool_pause() -> None:
    old = replace(RUN, weight_update_s=20.0)
    assert old.pause_seconds(TORCH).tolist() == [20.0, 20.0]
    assert RUN.pause_seconds(TORCH).tolist() == pytest.approx([0.032, 0.032])


# ----------------------------------------------------------------------------- the derivation


def test_a_pools_mode_follows_its_engine_precision_and_the_broadcast() -> None:
    sglang_bf16, sglang_fp8 = POOLS[0], replace(POOLS[1], weight_precision="fp8")
    torch = TORCH[0]
    plain, broadcast = WeightPause(), WeightPause(broadcast=True)
    assert [plain.mode(p) for p in (sglang_bf16, sglang_fp8, torch)] == [PAUSED, PAUSED, STAGED]
    # The broadcast reaches the trainer's precision only: the quantized pool still loads from disk.
    assert [broadcast.mode(p) for p in (sglang_bf16, sglang_fp8, torch)] == [STAGED, PAUSED, STAGED]
    assert WeightPause(staged_everywhere=True).mode(sglang_fp8) == STAGED


def test_the_decode_step_is_the_models_own_token_rate_per_session() -> None:
    # 16 sessions per unit of capacity at 1,000 tokens/s: one session gains 62.5 tokens/s, one per
    # step, so a step is 16 ms, on every pool (capacity scales the rate and the sessions alike).
    assert RUN.decode_step_s == pytest.approx(0.016)
    staged = RUN.pause_seconds(TORCH)
    assert staged.tolist() == pytest.approx([PAUSE_DECODE_STEPS * 0.016] * 2)
    # A slower engine (half the tokens per capacity at the same sessions) steps half as often.
    slow = replace(RUN, tokens_per_s_per_capacity=500.0)
    assert slow.pause_seconds(TORCH).tolist() == pytest.approx([0.064, 0.064])
    assert replace(RUN, pause=WeightPause(pause_decode_steps=3.0)).pause_seconds(TORCH)[0] == pytest.approx(
        0.048
    )
    # The web-traffic model: a request streams 600 tokens over a mean 12 s, 20 ms a step.
    workload = Workload(sessions=np.full(10, 5))
    assert workload.decode_step_s == pytest.approx(0.02)
    assert workload.pause_seconds(TORCH).tolist() == pytest.approx([0.04, 0.04])
    assert workload.pause_seconds(POOLS).tolist() == [SGLANG_DISK_PAUSE_S] * 2


def test_mixed_pools_pause_each_by_its_own_engine() -> None:
    pools = [TORCH[0], POOLS[1]]  # a torch pool and an SGLang pool
    assert RUN.pause_seconds(pools).tolist() == pytest.approx([0.032, 20.0])
    result = simulate_run(pools, RUN, static({"spot": 3, "dear": 3}))
    capacity = 3 * 3.2 + 3 * 1.8
    per_step = (3 * 3.2 * 0.032 + 3 * 1.8 * 20.0) / capacity
    assert result.extra["paused_share"] == pytest.approx(result.steps * per_step / result.seconds, rel=0.02)


def test_the_disk_pause_can_be_stated_per_gigabyte() -> None:
    assert weights_gb(30.5, "bf16") == pytest.approx(61.0)
    per_gb = WeightPause(disk_s_per_gb=0.5, parameters_billions=30.5)
    nvfp4 = replace(POOLS[0], weight_precision="nvfp4")
    assert per_gb.seconds(nvfp4, 0.016) == pytest.approx(0.5 * 30.5 * 0.5625)
    assert per_gb.seconds(POOLS[0], 0.016) == pytest.approx(30.5)  # BF16: 61 GB
    with pytest.raises(ValueError, match="parameters_billions"):
        WeightPause(disk_s_per_gb=0.5)


def test_the_example_fleet_is_sglang_on_the_disk_path_so_today_every_pool_pauses_20_s() -> None:
    pools, _, _, _ = fleet_from_spec(str(DEFAULT_SPEC))
    assert {p.engine for p in pools} == {"sglang"}
    assert RUN.pause_seconds(pools).tolist() == [20.0] * len(pools)
    broadcast = replace(RUN, pause=WeightPause(broadcast=True)).pause_seconds(pools)
    assert {p.name for p, s in zip(pools, broadcast, strict=True) if s < 1} == {
        p.name for p in pools if p.weight_precision == "bf16"
    }


def test_a_static_fleet_is_sized_for_the_capacity_its_pauses_leave() -> None:
    # 512 per 120 s × 4,000 tokens / 1,000 per capacity = 17.1 capacity while generating: over
    # 100 of 120 s with a 20 s pause (20.5: 7 × 3.2), over 119.97 s with a staged one (6 × 3.2).
    assert static_sized_to_trainer(POOLS, RUN) == {"spot": 7, "dear": 0}
    assert static_sized_to_trainer(TORCH, RUN) == {"spot": 6, "dear": 0}
    # The cheapest capacity is per unpaused capacity: an SGLang pool that pauses a sixth of every
    # step loses to a torch pool 10 % dearer per raw capacity.
    dear_torch = replace(TORCH[1], cost_per_gpu_hour=6.0 / 3.2 * 1.8 * 1.1)
    assert static_sized_to_trainer([POOLS[0], dear_torch], RUN)["dear"] > 0


# ----------------------------------------------------------------------------- the web-traffic model


def test_the_web_traffic_model_pauses_per_pool_and_reproduces_20_s() -> None:
    sessions = step_sessions(200, 2.0, 900, 1800)
    strategy = FleetStrategy("static", static_replicas={"spot": 4, "dear": 4})
    base = Workload(sessions=sessions, warmup_s=600, weight_update_every_s=300.0)
    today = simulate(POOLS, base, strategy, seed=1)
    old = simulate(POOLS, replace(base, weight_update_s=20.0), strategy, seed=1)
    assert (today.tokens, today.requests, today.wait_total_s) == (old.tokens, old.requests, old.wait_total_s)
    staged = simulate(TORCH, base, strategy, seed=1)
    never = simulate(TORCH, replace(base, weight_update_every_s=0.0), strategy, seed=1)
    # Two decode steps per update cost next to nothing; twenty seconds every five minutes do.
    assert staged.wait_mean_s < old.wait_mean_s
    assert staged.wait_mean_s == pytest.approx(never.wait_mean_s, abs=0.05)
