"""The autoscaling benchmark, on the fleet simulator (examples/rlrun-mixed.yaml's pools).

    .venv/bin/python bench/autoscaling.py [--seeds 5] [--plots docs/img]

1. Load step: 400 → 1600 live sessions at once.  Time until the requested capacity covers the new
   load (≥ (1 − tolerance) × load / target), against one poll interval plus one scrape of metric
   age; and time until that capacity is ready (cold start included).  mixrl vs KEDA-like.
2. Steady noisy load: 1000 sessions, ±5 % per-minute noise, 4 h per seed: scaling reversals
   (a pool scaled one way and then the other within 10 minutes).
3. A simulated day: cost per million tokens and queue wait against static peak provisioning
   (target: cost ≤ 0.8× static with p95 wait within 2× of static's).

Every ratio is against a baseline simulated in the same run with the same seed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from mixrl.operator.autoscaling.fleet import SimResult, Strategy, Workload, simulate
from mixrl.operator.autoscaling.simulate import (
    ProgressPrinter,
    fleet_from_spec,
    format_table,
    keda_configs,
    make_workload,
    run_strategies,
    step_sessions,
    summary,
)

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
        Strategy("keda", configs=keda_configs(pools, configs), sustained_window_s=None),
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
            Strategy("keda", configs=keda_configs(pools, configs), sustained_window_s=None),
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
    from mixrl.operator.autoscaling.simulate_plots import plot_results

    directory.mkdir(parents=True, exist_ok=True)
    for path in plot_results(results, directory, title=f"rlrun-mixed · {scenario}"):
        target = directory / f"autoscaling-{scenario}-{path.name}"
        path.replace(target)
        print(f"   plot: {target} ({target.stat().st_size // 1024} KB)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds for the steady scenario")
    parser.add_argument("--seed", type=int, default=0, help="seed for the step and day scenarios")
    parser.add_argument("--plots", type=Path, default=None, help="write PNG plots to this directory")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.seeds <= 0:
        print(f"--seeds: must be > 0, got {args.seeds}", file=sys.stderr)
        return 2
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
