"""The autoscaling benchmark: strategies on a trainer-coupled fleet (examples/rlrun-mixed.yaml's pools).

    .venv/bin/python bench/autoscaling.py [--plots docs/img] [--quick]

The run: 128 prompts × 8 samples = 1,024 trajectories per step, rollout concurrency 4 × 256,
``maxStepsAhead`` 2, a weight update after every step, 4,000-token trajectories, 1,000 tokens/s
per unit of capacity (mixrl/sim/trainer_coupled.py has the model).  The example's pools are all
SGLang on the disk path, so each update pauses every pool for the whole load: 20 s, an assumption
(``mixrl.sim.weight_pause``).  Sweeps:

1. trainer step time 60 / 120 / 240 s (sampler-bound by the concurrency, balanced, trainer-bound);
2. rollout concurrency 512 / 1,024 / 2,048 at 120 s;
3. changes: the b200 spot pool loses half its nodes at a third of the run (1 h 20 min of 4 h); the
   same plus responses growing to 6,000 tokens; the trainer speeding up from 120 s to 80 s per step
   at half the run;
4. issue #30's out-of-sample kinds: 11-minute cold starts (steady, and with the loss), a trainer
   120 → 60 → 120 s and 240 → 60 s, the lost pool back at two thirds, and spot preemptions every
   hour (half the b200 pool's nodes gone for 15 minutes), at the example's price and at a spot
   price (``SPOT_PRICE``); then noisy signals, shrinking responses, quotas, a pool absent from the
   start, a mis-declared capacity, a 10× fleet, and a trainer speeding up gradually (240 → 120 s
   in eight steps) while new replicas take 11 minutes to start.

24 runs of 4 h (2 h with ``--quick``), six strategies each, all in the same run on the same seed:
``mixrl`` (``objective: trainer``), ``queue`` (mixrl's per-replica policy, ``objective: queue``),
``keda`` (KEDA as HPA computes an External AverageValue, on the engines' queue), ``keda-demand``
(KEDA on a trigger written from mixrl's metrics: each pool's share of the trainer's demand over its
measured rate per replica), ``static`` (a fleet sized to the trainer at the start, cheapest
capacity first: the AReaL / verl way) and ``hindsight`` (the static fleet re-sized with perfect
foresight at every change and every hour, ``trainer_coupled.hindsight_schedule``).  ``moved``:
sessions the router's rebalancing moved off a pool that lost replicas (its own rule,
``mixrl.rl.router.shares.drain_step``).  Two costs per step: the samplers' alone, and the run's
total with the trainer's GPUs (4 nodes × 8 H200 at the default table's price, billed fed or idle).
Targets (:func:`meets_target`): on the steady runs (named ``steady, …``) ``mixrl`` costs at most
1.05× hindsight's sampler dollars per step at ≥ 0.97× its steps/h; on the changing runs it makes
at least the start-sized static fleet's steps/h at no more than its total (trainer + sampler) cost
per step; every run at most one reversal an hour.

For every changing run it also prints how long after each change mixrl takes to make 95 % of
the hindsight fleet's steps over a 900 s window (``regain_after``).

``--pause-compare`` runs only what the weight-update pause moves — runs 2, 7 and 8 for ``mixrl`` and
``static`` — under the model before issue #29 (every pool 20 s), BF16 pools on the trainer's
broadcast, and every pool staged as mixrl's torch engine swaps (two decode steps, measured by
``bench/weight_sync.py``), side by side.

``--plan-ahead-compare`` runs ``mixrl`` with and without planning one learned cold start ahead
for a trainer speeding up (``ObjectiveConfig.plan_ahead``) on the trainer-rate runs, side by side.

``--legacy`` runs the earlier web-traffic benchmark (load step, steady noise, a simulated day).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from mixrl.sim import trainer_coupled as ts
from mixrl.sim.fleet import SimResult, Strategy, Workload, simulate
from mixrl.sim.simulate import (
    ProgressPrinter,
    fleet_from_spec,
    format_table,
    keda_configs,
    make_workload,
    run_strategies,
    step_sessions,
    summary,
    trainer_from_spec,
)
from mixrl.sim.weight_pause import OLD_MODEL, WeightPause

SPEC = "examples/rlrun-mixed.yaml"
SCRAPE_S = 15


def time_to(result: SimResult, step_at: float, series: np.ndarray, needed: float) -> float:
    after = (result.times >= step_at) & (series >= needed)
    return float(result.times[after][0] - step_at) if after.any() else float("inf")


def step_benchmark(pools, configs, seed: int, plots: Path | None) -> bool:
    # 1807 s: the step falls between scrapes and polls, as it would in a cluster.
    step_at = 1807
    workload = Workload(sessions=step_sessions(400, 4.0, step_at, 3600))
    ours = simulate(pools, workload, Strategy("mixrl", configs=configs), seed=seed)
    keda = simulate(
        pools,
        workload,
        Strategy("keda", configs=keda_configs(pools, configs), sustained_window_s=None, reads_pods=False),
        seed=seed,
    )
    config = next(iter(configs.values()))
    target_per_capacity = config.target_per_replica / pools[0].capacity
    settled = ours.load[ours.times >= step_at + 1800]
    needed = (1 - config.tolerance) * float(np.median(settled)) / target_per_capacity
    poll = config.poll_interval_s
    print(f"\n1. load step 400 → 1600 sessions at t={step_at} s; capacity needed ≥ {needed:.1f} units")
    print(
        f"   {'policy':8} {'requested after':>16} {'ready after':>12} {'peak requested':>15} {'overshoot':>10}"
    )
    rows = {}
    for result in (ours, keda):
        requested = time_to(result, step_at, result.requested_capacity, needed)
        ready = time_to(result, step_at, result.ready_capacity, needed)
        peak = float(result.requested_capacity[result.times >= step_at].max())
        rows[result.strategy] = requested
        print(
            f"   {result.strategy:8} {requested:>14.0f} s {ready:>10.0f} s {peak:>15.1f} {peak / (needed / 0.9):>9.2f}×"
        )
    bound = poll + SCRAPE_S
    ok = rows["mixrl"] <= bound
    print(
        f"   mixrl requested the target in {rows['mixrl']:.0f} s ≤ one poll ({poll:.0f} s) + one scrape ({SCRAPE_S} s): "
        f"{'PASS' if ok else 'FAIL'}; KEDA-like took {rows['keda'] / max(rows['mixrl'], 1):.1f}× as long"
    )
    if plots is not None:
        _plot({"mixrl": ours, "keda": keda}, plots, "step")
    return ok


def steady_benchmark(pools, configs, seeds: int) -> bool:
    print(f"\n2. steady noisy load: 1000 sessions ±5 %/min, 4 h × {seeds} seeds")
    totals = {"mixrl": [0, 0], "keda": [0, 0]}
    per_seed = []
    for seed in range(seeds):
        workload = make_workload("steady", 1000, 4.0, seed)
        ours = simulate(pools, workload, Strategy("mixrl", configs=configs), seed=seed)
        keda = simulate(
            pools,
            workload,
            Strategy("keda", configs=keda_configs(pools, configs), sustained_window_s=None, reads_pods=False),
            seed=seed,
        )
        per_seed.append((seed, ours.flaps(), keda.flaps(), len(ours.actions), len(keda.actions)))
        for name, result in (("mixrl", ours), ("keda", keda)):
            totals[name][0] += result.flaps()
            totals[name][1] += len(result.actions)
    for seed, f_ours, f_keda, a_ours, a_keda in per_seed:
        print(
            f"   seed {seed}: reversals mixrl {f_ours} (of {a_ours} actions), KEDA-like {f_keda} (of {a_keda})"
        )
    print(
        f"   total reversals: mixrl {totals['mixrl'][0]}, KEDA-like {totals['keda'][0]}; "
        f"actions: mixrl {totals['mixrl'][1]}, KEDA-like {totals['keda'][1]}"
    )
    ok = per_seed[0][1] == 0
    print(f"   zero flapping on seed 0: {'PASS' if ok else 'FAIL'}")
    return ok


def day_benchmark(pools, configs, seed: int, plots: Path | None, progress: ProgressPrinter | None) -> bool:
    workload = make_workload("day", 1600, 24.0, seed)
    static_gpus = None
    results = run_strategies(
        pools, configs, workload, ("mixrl", "keda", "static"), seed=seed, progress=progress
    )
    static_gpus = sum(results["static"].gpu_seconds_by_pool.values()) / len(workload.sessions)
    budget = int(0.6 * static_gpus)
    budgeted = simulate(
        pools, workload, Strategy("mixrl-budget", configs=configs, gpu_budget=budget), seed=seed
    )
    results = {
        "mixrl": results["mixrl"],
        "mixrl-budget": budgeted,
        "keda": results["keda"],
        "static": results["static"],
    }
    print(
        f"\n3. a simulated day (peak {int(workload.sessions.max())} sessions); mixrl-budget: {budget} GPUs shared"
    )
    print("   " + format_table([summary(r) for r in results.values()]).replace("\n", "\n   "))
    static = results["static"]
    ok = True
    for name in ("mixrl", "mixrl-budget", "keda"):
        result = results[name]
        cost = result.cost_per_mtok / static.cost_per_mtok
        p95, p95_static = result.wait_quantile(0.95), static.wait_quantile(0.95)
        p99, p99_static = result.wait_quantile(0.99), static.wait_quantile(0.99)
        wait_ok = p95 <= 2 * p95_static
        print(
            f"   {name:12} cost/Mtok {cost:.2f}× static; p95 wait {p95:.0f} s vs {p95_static:.0f} s; "
            f"p99 {p99:.0f} s vs {p99_static:.0f} s; mean {result.wait_mean_s:.2f} s vs {static.wait_mean_s:.2f} s"
        )
        if name == "mixrl":
            ok = cost <= 0.8 and wait_ok
            print(f"   mixrl: cost ≤ 0.8× static and p95 within 2×: {'PASS' if ok else 'FAIL'}")
    if plots is not None:
        _plot(results, plots, "day")
    return ok


def _plot(results: dict[str, SimResult], directory: Path, scenario: str) -> None:
    from mixrl.sim.plots import plot_results

    directory.mkdir(parents=True, exist_ok=True)
    for path in plot_results(results, directory, title=f"rlrun-mixed · {scenario}"):
        target = directory / f"autoscaling-{scenario}-{path.name}"
        path.replace(target)
        print(f"   plot: {target} ({target.stat().st_size // 1024} KB)")


# ----------------------------------------------------------------------------- trainer-coupled sweeps

BASE_RUN = ts.TrainerRun(tokens_per_trajectory=(4000.0, 4000.0))
LOSS_AT_S = 5400.0


COLD_NODE_S = 660.0
"""A cold start on a new GPU node (provisioning, image pull, model load): 10–12 minutes, longer
than the default pending timeout (600 s)."""


def scenarios(hours: float) -> list[tuple[str, str, ts.TrainerRun]]:
    """(sweep, name, run): steady runs first, then the changing ones."""
    base = replace(BASE_RUN, hours=hours)
    loss_at = min(LOSS_AT_S, hours * 3600 / 3)
    return [
        ("step time", "steady, 60 s steps", replace(base, step_seconds=((0.0, 60.0),))),
        ("step time", "steady, 120 s steps", base),
        ("step time", "steady, 240 s steps", replace(base, step_seconds=((0.0, 240.0),))),
        ("concurrency", "steady, concurrency 512", replace(base, concurrency=512)),
        ("concurrency", "steady, concurrency 2048", replace(base, concurrency=2048)),
        ("availability", "spot pool loses half", replace(base, spot_pool="b200-nvfp4", loss_at_s=loss_at)),
        (
            "availability",
            "loss + longer responses",
            replace(base, spot_pool="b200-nvfp4", loss_at_s=loss_at, tokens_per_trajectory=(4000.0, 6000.0)),
        ),
        (
            "trainer rate",
            "trainer 120 → 80 s at 1/2",
            replace(base, step_seconds=((0.0, 120.0), (hours * 1800, 80.0))),
        ),
        # Issue #30's out-of-sample kinds: cold starts longer than the pending timeout (a new GPU
        # node), a trainer whose speed moves both ways or fourfold, a lost pool that comes back.
        ("cold start", "steady, 11 min cold starts", replace(base, cold_start_s=COLD_NODE_S)),
        (
            "cold start",
            "loss + 11 min cold starts",
            replace(base, spot_pool="b200-nvfp4", loss_at_s=loss_at, cold_start_s=COLD_NODE_S),
        ),
        (
            "trainer rate",
            "trainer 120 → 60 → 120 s",
            replace(base, step_seconds=((0.0, 120.0), (hours * 1200, 60.0), (hours * 2400, 120.0))),
        ),
        (
            "trainer rate",
            "trainer 240 → 60 s at 1/2",
            replace(base, step_seconds=((0.0, 240.0), (hours * 1800, 60.0))),
        ),
        (
            "availability",
            "spot pool lost, back at 2/3",
            replace(base, spot_pool="b200-nvfp4", loss_at_s=loss_at, back_at_s=hours * 2400),
        ),
        # Spot preemptions every hour: half the cheapest pool's nodes gone for 15 minutes, back for
        # 45 (issue #30: the pool ratcheted down to one replica and never regrew).
        (
            "availability",
            "preempted 15 min every hour",
            replace(base, spot_pool="b200-nvfp4", loss_at_s=900.0, back_at_s=1800.0, repeat_every_s=3600.0),
        ),
        # The same at a spot price (SPOT_PRICE): the preempted pool is then by far the cheapest,
        # so where its replicas go decides the bill.
        (
            "availability",
            "preempted hourly, spot-priced",
            replace(base, spot_pool="b200-nvfp4", loss_at_s=900.0, back_at_s=1800.0, repeat_every_s=3600.0),
        ),
        # Noisy signals (ts.SignalNoise: ±20 % log-normal noise, metrics 30 s late, 10 % of scrapes
        # missed) on a steady run, a loss and a trainer speeding up.
        ("noise", "steady, noisy signals", replace(base, noise=NOISE)),
        (
            "noise",
            "loss, noisy signals",
            replace(base, spot_pool="b200-nvfp4", loss_at_s=loss_at, noise=NOISE),
        ),
        (
            "noise",
            "trainer 120 → 80 s, noisy signals",
            replace(base, step_seconds=((0.0, 120.0), (hours * 1800, 80.0)), noise=NOISE),
        ),
        ("responses", "responses shrink 5000 → 3000", replace(base, tokens_per_trajectory=(5000.0, 3000.0))),
        (
            "quota",
            "quota cut at 1/2, responses grow",
            replace(
                base,
                quota=((hours * 1800, "b200-nvfp4", 8), (hours * 1800, "h100-fp8", 8)),
                tokens_per_trajectory=(4000.0, 6000.0),
            ),
        ),
        (
            "quota",
            "b200 pool absent from the start",
            replace(base, spot_pool="b200-nvfp4", loss_at_s=-float(base.warmup_s), loss_fraction=1.0),
        ),
        (
            "capacity",
            "b200 delivers a third of its capacity",
            replace(base, capacity_error={"b200-nvfp4": 1 / 3}),
        ),
        ("scale", "10× fleet (10,240 per step)", replace(base, step_size=10240, concurrency=10240)),
        # A trainer that speeds up gradually (a curriculum, shorter sequences) while new replicas
        # take a new GPU node's cold start: what the plan ahead is for (--plan-ahead-compare).
        (
            "trainer rate",
            "ramp 240 → 120 s, 11 min cold starts",
            replace(base, step_seconds=ramp(hours), cold_start_s=COLD_NODE_S),
        ),
    ]


RAMP_SEGMENTS = 8


def ramp(hours: float, start: float = 240.0, end: float = 120.0) -> tuple[tuple[float, float], ...]:
    """Step seconds falling from ``start`` to ``end`` in equal steps between a third and two
    thirds of the run (the simulator's step times are piecewise constant)."""
    first, last = hours * 1200, hours * 2400
    steps = [
        (first + (last - first) * k / RAMP_SEGMENTS, start + (end - start) * k / RAMP_SEGMENTS)
        for k in range(1, RAMP_SEGMENTS + 1)
    ]
    return ((0.0, start), *steps)


NOISE = ts.SignalNoise(sigma=0.2, delay_s=30, miss=0.1)
SCALED = {"10× fleet (10,240 per step)": 10}
"""Runs whose pools may hold this many times their maximum replicas (the fleet grown with the run)."""

SPOT_PRICE = {"preempted hourly, spot-priced": 0.4}
"""Runs whose spot pool is billed at this share of its list price (spot capacity's discount)."""


def priced(pools, name: str, run: ts.TrainerRun):
    """The pools of one run, its spot pool at its spot price (``SPOT_PRICE``)."""
    grown = SCALED.get(name)
    if grown is not None:
        pools = [replace(p, max_replicas=p.max_replicas * grown) for p in pools]
    factor = SPOT_PRICE.get(name)
    if factor is None:
        return pools
    return [
        replace(p, cost_per_gpu_hour=p.cost_per_gpu_hour * factor) if p.name == run.spot_pool else p
        for p in pools
    ]


def strategies(pools, configs, run: ts.TrainerRun) -> list[ts.Strategy]:
    """mixrl; its per-pool queue policy; KEDA on the engines' queue (the naive trigger) and on the
    trainer's demand (the strongest a KEDA user could write from mixrl's metrics: each pool's share
    of the demand over its measured rate per replica, the shares the start-sized static fleet's);
    the static fleet sized at the start, and re-sized with hindsight per phase."""
    configs = {p.name: replace(configs[p.name], max_replicas=p.max_replicas) for p in pools}
    start = ts.static_sized_to_trainer(pools, run)
    capacity = {p.name: start[p.name] * p.capacity for p in pools}
    shares = {name: c / sum(capacity.values()) for name, c in capacity.items()}
    hindsight, schedule = ts.hindsight_schedule(pools, run)
    keda = keda_configs(pools, configs)
    return [
        ts.Strategy("mixrl", "trainer", configs=configs, objective=ts.objective_config(run)),
        ts.Strategy("queue", "queue", configs=configs),
        ts.Strategy("keda", "queue", configs=keda, sustained=False, reads_pods=False),
        ts.Strategy(
            "keda-demand",
            "queue",
            configs=keda,
            sustained=False,
            reads_pods=False,
            objective=ts.objective_config(run),
            demand_shares=shares,
        ),
        ts.Strategy("static", "static", static_replicas=start),
        ts.Strategy("hindsight", "static", static_replicas=hindsight, static_schedule=schedule),
    ]


def row(result: ts.RunResult) -> dict[str, float | str]:
    regain = result.time_to_regain()
    return {
        "strategy": result.strategy,
        "steps_per_hour": round(result.steps_per_hour, 2),
        "idle": round(result.idle_share, 4),
        "cost_per_step": round(result.cost_per_step, 3),
        "total_cost_per_step": round(result.total_cost_per_step, 3),
        "staleness_p50": result.staleness_quantile(0.5),
        "staleness_p95": result.staleness_quantile(0.95),
        "reversals_per_hour": round(result.reversals_per_hour, 2),
        "regain_s": "—" if regain is None else ("never" if regain == float("inf") else f"{regain:.0f}"),
        "gpus_max": result.gpus_max,
        "rebalanced": round(result.sessions_rebalanced),
    }


def changes_of(run: ts.TrainerRun) -> list[float]:
    """When a run's disturbances come (seconds): the trainer's step time changing, capacity lost
    and back (every time, when it recurs), a quota cut; responses that change length change
    gradually and are not listed."""
    seconds = run.hours * 3600
    times = [t for t, _ in run.step_seconds if 0 < t < seconds] + [t for t, _, _ in run.quota]
    for first in (run.loss_at_s, run.back_at_s):
        if first is None or first < 0:
            continue
        every = run.repeat_every_s or seconds
        times += [float(t) for t in np.arange(first, seconds, every)]
    return sorted(set(times))


def regain_after(
    ours: ts.RunResult, reference: ts.RunResult, at: float, share: float = 0.95, window_s: float = 900.0
) -> float:
    """Seconds from a change at ``at`` until ``ours`` makes ``share`` of the steps ``reference``
    (the hindsight fleet: what was achievable) makes over the same ``window_s``; 0 when the first
    window after the change already does; inf when it never does before the run ends."""
    mine, theirs = np.array(ours.step_times), np.array(reference.step_times)
    for end in np.arange(at + window_s, ours.seconds + 1, 30.0):
        achievable = ((theirs > end - window_s) & (theirs <= end)).sum()
        if ((mine > end - window_s) & (mine <= end)).sum() >= share * achievable:
            return float(end - window_s - at)
    return math.inf


def meets_target(
    ours: ts.RunResult, static: ts.RunResult, hindsight: ts.RunResult, steady: bool
) -> tuple[bool, str]:
    """The benchmark's target for one run (issue #30 item 6), and how it reads.  Steady runs: the
    samplers' dollars per step within 5 % of the hindsight-sized static fleet's at ≥ 0.97× its
    steps/h.  Changing runs: at least the start-sized static fleet's steps/h at no more than its
    dollars per step with the trainer's GPUs counted (a run pays for them fed or idle, so the steps
    a starved trainer did not make are a cost).  Every run: at most one reversal per hour."""
    calm = ours.reversals_per_hour <= 1.0
    if steady:
        ok = (
            ours.cost_per_step <= 1.05 * hindsight.cost_per_step
            and ours.steps_per_hour >= 0.97 * hindsight.steps_per_hour
            and calm
        )
        return ok, "≤ 1.05× hindsight static's sampler $/step at ≥ 0.97× its steps/h, ≤ 1 reversal/h"
    ok = (
        ours.steps_per_hour >= static.steps_per_hour
        and ours.total_cost_per_step <= static.total_cost_per_step
        and calm
    )
    return ok, "≥ static's steps/h at ≤ its total (trainer + sampler) $/step, ≤ 1 reversal/h"


def cost_breakdown(ours: ts.RunResult, static: ts.RunResult) -> str:
    """mixrl's cost per step over static's as the product of its four factors (RunResult.extra)."""
    a, b = ours.extra, static.extra
    price = a["dollars_per_capacity_hour"] / b["dollars_per_capacity_hour"]
    paused = (1 - b["paused_share"]) / (1 - a["paused_share"])
    busy = b["busy_share"] / a["busy_share"]
    tokens = a["tokens_per_step"] / b["tokens_per_step"]
    return (
        f"$/step {ours.cost_per_step / static.cost_per_step:.3f}× = price per capacity-hour {price:.3f}× "
        f"· weight-update pause {paused:.3f}× ({a['paused_share']:.1%} vs {b['paused_share']:.1%} of billed "
        f"capacity) · idle slots {busy:.3f}× (busy {a['busy_share']:.1%} vs {b['busy_share']:.1%}) "
        f"· tokens per step {tokens:.3f}×"
    )


def sweep_table(rows: list[dict[str, float | str]]) -> str:
    columns = [
        ("strategy", "strategy", "{}"),
        ("steps_per_hour", "steps/h", "{:.1f}"),
        ("idle", "idle", "{:.1%}"),
        ("cost_per_step", "sampler $/step", "{:.2f}"),
        ("total_cost_per_step", "total $/step", "{:.2f}"),
        ("staleness_p50", "stale p50", "{:.0f}"),
        ("staleness_p95", "p95", "{:.0f}"),
        ("reversals_per_hour", "rev/h", "{:.2f}"),
        ("regain_s", "regain s", "{}"),
        ("gpus_max", "GPUs max", "{}"),
        ("rebalanced", "moved", "{}"),
    ]
    cells = [[title for _, title, _ in columns]]
    cells += [[fmt.format(r[key]) for key, _, fmt in columns] for r in rows]
    widths = [max(len(r[c]) for r in cells) for c in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def run_sweeps(seed: int, plots: Path | None, hours: float, quiet: bool = False) -> int:
    started = time.perf_counter()
    pools, _, configs, _ = fleet_from_spec(SPEC)
    trainer_gpus, trainer_price = trainer_from_spec(SPEC)
    runs = [
        (sweep, name, replace(run, trainer_gpus=trainer_gpus, trainer_price_per_gpu_hour=trainer_price))
        for sweep, name, run in scenarios(hours)
    ]
    print(
        f"trainer: {trainer_gpus} GPUs at ${trainer_price:g}/GPU-hour = ${trainer_gpus * trainer_price:g}/h "
        "(in the total $/step)"
    )
    verdicts, table = [], {}
    timelines: dict[str, ts.RunResult] = {}
    for index, (sweep, name, run) in enumerate(runs, 1):
        results = {}
        run_pools = priced(pools, name, run)
        for strategy in strategies(run_pools, configs, run):
            results[strategy.name] = ts.simulate_run(run_pools, run, strategy, seed=seed)
            if not quiet:
                print(
                    f"[{index}/{len(runs)}] {name}: {strategy.name} done "
                    f"({time.perf_counter() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        ours, static, hindsight = results["mixrl"], results["static"], results["hindsight"]
        steady = name.startswith("steady")
        ok, target = meets_target(ours, static, hindsight, steady)
        verdicts.append(ok)
        table[name] = [row(r) for r in results.values()]
        print(f"\n{index}. {sweep}: {name} ({hours:g} h)")
        print("   " + sweep_table(table[name]).replace("\n", "\n   "))
        print(
            f"   mixrl vs static: {ours.cost_per_step / static.cost_per_step:.3f}× sampler $/step, "
            f"{ours.total_cost_per_step / static.total_cost_per_step:.3f}× total $/step, "
            f"{ours.steps_per_hour / static.steps_per_hour:.3f}× steps/h; "
            f"vs queue {ours.cost_per_step / results['queue'].cost_per_step:.2f}× $/step; "
            f"vs hindsight {ours.cost_per_step / hindsight.cost_per_step:.3f}× sampler $/step, "
            f"{ours.steps_per_hour / hindsight.steps_per_hour:.3f}× steps/h; "
            f"target {target}: {'PASS' if ok else 'FAIL'}"
        )
        if not steady:
            print("   " + cost_breakdown(ours, static))
            regains = [(at, regain_after(ours, hindsight, at)) for at in changes_of(run)]
            if regains:
                print(
                    "   mixrl at 95 % of hindsight's steps (900 s window) after each change: "
                    + ", ".join(
                        f"{at / 60:.0f} min: {'never' if t == math.inf else f'{t:.0f} s'}"
                        for at, t in regains
                    )
                )
        if ours.recommended_concurrency is not None:
            print(
                f"   mixrl: the demand needs rollout concurrency {ours.recommended_concurrency} (reported, not applied)"
            )
        if name == "spot pool loses half":
            timelines = results
    if plots is not None:
        _plot_sweeps(table, timelines, plots)
    print(f"\n{sum(verdicts)} of {len(verdicts)} targets met in {time.perf_counter() - started:.0f} s")
    return 0 if all(verdicts) else 1


PAUSE_RUNS = ("steady, 120 s steps", "loss + longer responses", "trainer 120 → 80 s at 1/2")
"""``--pause-compare``'s runs: the steady reference and the two changing runs the docs decompose."""
PAUSES: tuple[tuple[str, WeightPause], ...] = (
    ("old: every pool 20 s", OLD_MODEL),
    ("per pool + BF16 broadcast", WeightPause(broadcast=True)),
    ("every pool staged (what-if)", WeightPause(staged_everywhere=True)),
)
"""The pause models compared.  Today's per-pool model without the broadcast is the first row on
this fleet: every pool is SGLang on the disk path, assumed 20 s."""


def _named_runs(hours: float, names: tuple[str, ...]):
    """The example's pools and their policies, its trainer's (GPUs, price per GPU-hour), and the
    scenarios named, by name: what a side-by-side comparison runs."""
    pools, _, configs, _ = fleet_from_spec(SPEC)
    runs = {name: run for _, name, run in scenarios(hours) if name in names}
    return pools, configs, trainer_from_spec(SPEC), runs


def pause_compare(seed: int, hours: float) -> int:
    """mixrl and static on ``PAUSE_RUNS`` under each of ``PAUSES``, in one run."""
    started = time.perf_counter()
    pools, configs, (trainer_gpus, trainer_price), runs = _named_runs(hours, PAUSE_RUNS)
    print(f"decode step {BASE_RUN.decode_step_s * 1000:g} ms; {hours:g} h per run, seed {seed}")
    header = (
        f"{'run':<27} {'pause model':<29} {'strategy':<8} {'steps/h':>7} {'sampler $/step':>14} "
        f"{'total $/step':>12} {'paused':>7} {'idle':>6}"
    )
    print(header)
    for name, base in runs.items():
        for label, pause in PAUSES:
            run = replace(
                base, pause=pause, trainer_gpus=trainer_gpus, trainer_price_per_gpu_hour=trainer_price
            )
            results = {
                s.name: ts.simulate_run(pools, run, s, seed=seed)
                for s in strategies(pools, configs, run)
                if s.name in ("mixrl", "static")
            }
            for strategy, r in results.items():
                print(
                    f"{name:<27} {label:<29} {strategy:<8} {r.steps_per_hour:>7.2f} {r.cost_per_step:>14.3f} "
                    f"{r.total_cost_per_step:>12.3f} {r.extra['paused_share']:>7.2%} {r.idle_share:>6.1%}"
                )
            ours, static = results["mixrl"], results["static"]
            print(f"{'':<27} {'':<29} mixrl vs static: " + cost_breakdown(ours, static))
            print(
                f"  ({time.perf_counter() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    print(f"\n({time.perf_counter() - started:.0f} s)")
    return 0


PLAN_AHEAD_RUNS = (
    "trainer 120 → 80 s at 1/2",
    "trainer 120 → 60 → 120 s",
    "trainer 240 → 60 s at 1/2",
    "trainer 120 → 80 s, noisy signals",
    "steady, 11 min cold starts",
    "ramp 240 → 120 s, 11 min cold starts",
)
"""``--plan-ahead-compare``'s runs: every trainer-rate change, one noisy, one steady with slow cold starts."""


def plan_ahead_compare(seed: int, hours: float) -> int:
    """mixrl with and without the plan ahead on ``PLAN_AHEAD_RUNS``, in one run."""
    started = time.perf_counter()
    pools, configs, (trainer_gpus, trainer_price), runs = _named_runs(hours, PLAN_AHEAD_RUNS)
    print(f"{hours:g} h per run, seed {seed}")
    print(
        f"{'run':<37} {'plan ahead':<10} {'steps/h':>7} {'sampler $/step':>14} {'total $/step':>12} "
        f"{'idle':>6} {'rev/h':>5}"
    )
    for name, base in runs.items():
        run = replace(base, trainer_gpus=trainer_gpus, trainer_price_per_gpu_hour=trainer_price)
        (mixrl,) = [s for s in strategies(pools, configs, run) if s.name == "mixrl"]
        assert mixrl.objective is not None
        for ahead in (True, False):
            strategy = replace(mixrl, objective=replace(mixrl.objective, plan_ahead=ahead))
            r = ts.simulate_run(pools, run, strategy, seed=seed)
            print(
                f"{name:<37} {'on' if ahead else 'off':<10} {r.steps_per_hour:>7.2f} {r.cost_per_step:>14.3f} "
                f"{r.total_cost_per_step:>12.3f} {r.idle_share:>6.1%} {r.reversals_per_hour:>5.2f}"
            )
        print(f"  ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    return 0


def _plot_sweeps(table: dict[str, list[dict]], timelines: dict[str, ts.RunResult], directory: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    names = list(table)
    strategies_ = [r["strategy"] for r in table[names[0]]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    width = 0.8 / len(strategies_)
    for k, strategy in enumerate(strategies_):
        xs = [i + k * width for i in range(len(names))]
        axes[0].bar(xs, [table[n][k]["cost_per_step"] for n in names], width, label=strategy)
        axes[1].bar(xs, [table[n][k]["total_cost_per_step"] for n in names], width, label=strategy)
        axes[2].bar(xs, [table[n][k]["steps_per_hour"] for n in names], width, label=strategy)
    titles = ("sampler $ per trainer step", "trainer + sampler $ per step", "trainer steps per hour")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(
            [i + 0.4 - width / 2 for i in range(len(names))], names, rotation=35, ha="right", fontsize=7
        )
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = directory / "autoscaling-trainer-sweeps.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"   plot: {path} ({path.stat().st_size // 1024} KB)")
    if timelines:
        fig, axes = plt.subplots(2, 1, figsize=(9, 4.6), sharex=True)
        for name, result in timelines.items():
            hours = result.times / 3600
            axes[0].plot(hours, result.cost_rate, label=name, lw=1)
            axes[1].plot(hours, result.backlog, label=name, lw=1)
        axes[0].set_ylabel("$ / h", fontsize=8)
        axes[1].set_ylabel("buffered + in flight (steps)", fontsize=8)
        axes[1].set_xlabel("hours (spot pool loses half its nodes at the dashed line)", fontsize=8)
        for ax in axes:
            if next(iter(timelines.values())).loss_at_s is not None:
                ax.axvline(next(iter(timelines.values())).loss_at_s / 3600, ls="--", c="grey", lw=0.8)
        axes[0].legend(fontsize=7, ncol=4)
        fig.tight_layout()
        path = directory / "autoscaling-trainer-loss.png"
        fig.savefig(path, dpi=60)
        plt.close(fig)
        print(f"   plot: {path} ({path.stat().st_size // 1024} KB)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="--legacy: seeds for the steady scenario")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--plots", type=Path, default=None, help="write PNG plots to this directory")
    parser.add_argument("--quick", action="store_true", help="2 h runs instead of 4 h (a smoke test)")
    parser.add_argument("--legacy", action="store_true", help="the web-traffic benchmark instead")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument(
        "--pause-compare", action="store_true", help="runs 2, 7, 8: old 20 s pause against per-pool pauses"
    )
    parser.add_argument(
        "--plan-ahead-compare",
        action="store_true",
        help="the trainer-rate runs for mixrl with and without planning one cold start ahead",
    )
    args = parser.parse_args(argv)
    if args.seeds <= 0:
        print(f"--seeds: must be > 0, got {args.seeds}", file=sys.stderr)
        return 2
    if args.pause_compare:
        return pause_compare(args.seed, 2.0 if args.quick else 4.0)
    if args.plan_ahead_compare:
        return plan_ahead_compare(args.seed, 2.0 if args.quick else 4.0)
    if not args.legacy:
        return run_sweeps(args.seed, args.plots, 2.0 if args.quick else 4.0, quiet=args.quiet)
    started = time.perf_counter()
    pools, _, configs, _ = fleet_from_spec(SPEC)
    progress = None if args.quiet else ProgressPrinter()
    results = [
        step_benchmark(pools, configs, args.seed, args.plots),
        steady_benchmark(pools, configs, args.seeds),
        day_benchmark(pools, configs, args.seed, args.plots, progress),
    ]
    print(f"\n{sum(results)} of {len(results)} targets met in {time.perf_counter() - started:.0f} s")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
