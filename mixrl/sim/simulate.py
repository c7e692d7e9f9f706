"""``mixrl simulate``: compare autoscaling strategies on a simulated fleet.

    mixrl simulate examples/rlrun-mixed.yaml --scenario day --out sim-out

reads the run's sampler pools (capacities, bounds, prices) and autoscaling settings, drives the
fleet model of :mod:`mixrl.sim.fleet` with three strategies — mixrl's policy, KEDA's defaults,
and static peak provisioning — and prints queue wait, utilization, cost per million tokens and
scaling actions for each, with plots in the output directory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import numpy as np

from mixrl.api.plain_text import plain_text
from mixrl.operator.autoscaling.policy import PolicyConfig
from mixrl.sim.fleet import FleetPool, SimResult, Strategy, Workload, simulate

# Seconds from "pod scheduled" to "engine ready" for a ~30B MoE checkpoint read from a node-local
# cache: image already pulled, weights loaded, kernels warmed up.  Assumptions, not measurements.
COLD_START_S: dict[str, float] = {
    "A100": 300.0,
    "H100": 210.0,
    "H200": 200.0,
    "B200": 240.0,
    "B300": 240.0,
    "RTX-PRO-6000": 270.0,
    "cpu": 30.0,
}
DEFAULT_SPEC = Path(__file__).resolve().parents[2] / "examples" / "rlrun-mixed.yaml"
"""The checkout's mixed-fleet example, found from this file (not the working directory), so
``mixrl simulate`` runs from anywhere."""
SCENARIOS = ("day", "step", "steady")
STRATEGIES = ("mixrl", "keda", "static")


# ----------------------------------------------------------------------------- workloads


def step_sessions(before: int, factor: float, before_s: int, after_s: int) -> np.ndarray:
    """``before`` sessions, then ``factor`` times as many at once (the load step)."""
    return np.concatenate([np.full(before_s, before), np.full(after_s, round(before * factor))])


def steady_sessions(level: int, seconds: int, noise: float, rng: np.random.Generator) -> np.ndarray:
    """A steady level with noise: each minute the rollout's live sessions move by ``noise`` (σ)."""
    minutes = math.ceil(seconds / 60)
    factors = np.exp(rng.normal(0.0, noise, minutes))
    return np.repeat(np.round(level * factors), 60)[:seconds].astype(np.int64)


def day_sessions(peak: int, rng: np.random.Generator, seconds: int = 86400) -> np.ndarray:
    """A synthetic day of an RL cluster's rollouts.

    A diurnal background (10 % of ``peak`` at 03:00, 25 % at 15:00) from ad-hoc runs; two training
    campaigns that step the load to ``peak`` (10:00–13:00, 4× the background, and 16:00–18:00);
    a burst of +40 % for 3–6 minutes every 15–25 minutes while a campaign runs (a new batch of
    prompts launching all its samples at once); and ±5 % per-minute noise.
    """
    hours = np.arange(seconds) / 3600.0
    level = peak * (0.175 - 0.075 * np.cos(2 * np.pi * (hours - 3.0) / 24.0))
    campaign = ((hours >= 10) & (hours < 13)) | ((hours >= 16) & (hours < 18))
    level = np.where(campaign, peak, level)
    burst = np.zeros(seconds, dtype=bool)
    t = 0
    while t < seconds:
        t += int(rng.uniform(15, 25) * 60)
        length = int(rng.uniform(3, 6) * 60)
        burst[t : t + length] = True
    level = np.where(campaign & burst, level * 1.4, level)
    noise = np.repeat(np.exp(rng.normal(0.0, 0.05, math.ceil(seconds / 60))), 60)[:seconds]
    return np.round(level * noise).astype(np.int64)


# ----------------------------------------------------------------------------- fleet from a spec


def fleet_from_spec(path: str) -> tuple[list[FleetPool], PolicyConfig, dict[str, PolicyConfig], str]:
    """The pools of an RLRun file and their mixrl policies (plus the run's name).

    A pool without ``costPerGpuHour`` is priced as the autoscaling loop prices it
    (:func:`mixrl.api.gpus.price_per_gpu_hour`: the default table of its GPU type)."""
    from mixrl.api.gpus import price_per_gpu_hour
    from mixrl.api.loader import load_rlrun
    from mixrl.api.resolve import resolve

    resolved = resolve(load_rlrun(path))
    pools, configs = [], {}
    for pool in resolved.pools:
        pools.append(
            FleetPool(
                name=pool.name,
                gpu_type=pool.gpu_type,
                capacity=pool.capacity or 1.0,
                gpus_per_replica=max(pool.gpus_per_replica, 1),
                cost_per_gpu_hour=price_per_gpu_hour(pool.gpu_type, pool.cost_per_gpu_hour),
                min_replicas=pool.min_replicas,
                max_replicas=pool.max_replicas,
                cold_start_s=COLD_START_S[pool.gpu_type],
                engine=pool.engine,
                weight_precision=pool.weight_precision,
            )
        )
        configs[pool.name] = PolicyConfig.from_spec(resolved.autoscaling, pool)
    first = next(iter(configs.values()))
    return pools, first, configs, resolved.name


def trainer_from_spec(path: str) -> tuple[int, float]:
    """The run's trainer GPUs (``nodes × gpusPerNode``) and its dollars per GPU-hour.

    The price is :func:`mixrl.api.gpus.default_price` of the trainer's GPU type: the RLRun states
    no trainer price, and that is the table the operator's live status bills the trainer at
    (``controller/observer.py``), as it bills a pool without ``costPerGpuHour``."""
    from mixrl.api.gpus import default_price, requested_gpus
    from mixrl.api.loader import load_rlrun
    from mixrl.api.resolve import resolve

    trainer = resolve(load_rlrun(path)).trainer.spec
    gpus = trainer.nodes * requested_gpus(trainer.gpu_type, trainer.gpus_per_node)
    return gpus, default_price(trainer.gpu_type)


def keda_configs(pools: Sequence[FleetPool], ours: dict[str, PolicyConfig]) -> dict[str, PolicyConfig]:
    return {
        p.name: PolicyConfig.keda_like(
            ours[p.name].min_replicas, ours[p.name].max_replicas, ours[p.name].target_per_replica
        )
        for p in pools
    }


def static_peak(result: SimResult) -> dict[str, int]:
    """Every pool held at the most replicas the autoscaled run ever requested for it."""
    return {name: int(result.desired[:, i].max()) for i, name in enumerate(result.pools)}


# ----------------------------------------------------------------------------- reporting


def summary(result: SimResult) -> dict[str, float | int | str]:
    return {
        "strategy": result.strategy,
        "wait_mean_s": round(result.wait_mean_s, 3),
        "wait_p95_s": result.wait_quantile(0.95),
        "wait_p99_s": result.wait_quantile(0.99),
        "utilization": round(result.utilization, 4),
        "cost_usd": round(result.cost, 2),
        "mtok": round(result.tokens / 1e6, 3),
        "cost_per_mtok_usd": round(result.cost_per_mtok, 4),
        "gpu_hours": round(sum(result.gpu_seconds_by_pool.values()) / 3600, 1),
        "scaling_actions": len(result.actions),
        "reversals_10min": result.flaps(),
        "requests": result.requests,
        "sessions_started": result.sessions_started,
        "wall_s": round(result.wall_seconds, 2),
    }


def format_table(rows: list[dict[str, float | int | str]]) -> str:
    columns = [
        ("strategy", "strategy", "{}"),
        ("wait_mean_s", "wait mean s", "{:.2f}"),
        ("wait_p95_s", "p95 s", "{:.0f}"),
        ("wait_p99_s", "p99 s", "{:.0f}"),
        ("utilization", "util", "{:.1%}"),
        ("cost_per_mtok_usd", "$/Mtok", "{:.3f}"),
        ("gpu_hours", "GPU-h", "{:.0f}"),
        ("scaling_actions", "actions", "{}"),
        ("reversals_10min", "reversals", "{}"),
    ]
    cells = [[title for _, title, _ in columns]]
    cells += [[fmt.format(row[key]) for key, _, fmt in columns] for row in rows]
    widths = [max(len(r[c]) for r in cells) for c in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


class ProgressPrinter:
    """One line per second of wall time: simulated hours, rate and ETA."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.started: dict[str, float] = {}

    def __call__(self, strategy: str, done: float, total: float) -> None:
        start = self.started.setdefault(strategy, time.perf_counter())
        if done == 0:
            return
        elapsed = max(time.perf_counter() - start, 1e-9)
        rate = done / elapsed
        eta = (total - done) / rate if rate > 0 else float("inf")
        print(
            f"simulate {strategy}: {done / 3600:.1f}/{total / 3600:.1f} h simulated "
            f"({done / total:.0%}), {rate / 1000:.0f}k sim-s/s, ETA {eta:.0f} s",
            file=self.stream,
            flush=True,
        )


def run_strategies(
    pools: list[FleetPool],
    configs: dict[str, PolicyConfig],
    workload: Workload,
    strategies: Sequence[str],
    *,
    seed: int,
    gpu_budget: int | None = None,
    progress: ProgressPrinter | None = None,
) -> dict[str, SimResult]:
    """mixrl first (static peak is sized from it), then the others, all on the same seed."""
    results: dict[str, SimResult] = {}
    ours = simulate(pools, workload, Strategy("mixrl", configs=configs), seed=seed, progress=progress)
    if "mixrl" in strategies:
        results["mixrl"] = ours
    if gpu_budget is not None:
        budget = Strategy("mixrl-budget", configs=configs, gpu_budget=gpu_budget)
        results["mixrl-budget"] = simulate(pools, workload, budget, seed=seed, progress=progress)
    if "keda" in strategies:
        keda = Strategy(
            "keda", configs=keda_configs(pools, configs), sustained_window_s=None, reads_pods=False
        )
        results["keda"] = simulate(pools, workload, keda, seed=seed, progress=progress)
    if "static" in strategies:
        static = Strategy("static", static_replicas=static_peak(ours))
        results["static"] = simulate(pools, workload, static, seed=seed, progress=progress)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixrl simulate", description=plain_text(__doc__).split("\n\n")[0])
    parser.add_argument(
        "spec",
        nargs="?",
        default=str(DEFAULT_SPEC),
        help="RLRun YAML (default: the checkout's examples/rlrun-mixed.yaml)",
    )
    parser.add_argument("--scenario", choices=SCENARIOS, default="day", help="workload (default day)")
    parser.add_argument(
        "--sessions", type=int, default=1600, help="peak (day) or base (step, steady) sessions"
    )
    parser.add_argument(
        "--hours", type=float, default=None, help="length (default: 24 day, 1.5 step, 4 steady)"
    )
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated subset of mixrl,keda,static"
    )
    parser.add_argument(
        "--gpu-budget", type=int, default=None, help="also run mixrl with this shared GPU budget"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (runs are deterministic)")
    parser.add_argument("--out", default="sim-out", help="output directory for summary.json and plots")
    parser.add_argument("--no-plots", action="store_true", help="skip the plots")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def make_workload(scenario: str, sessions: int, hours: float | None, seed: int) -> Workload:
    rng = np.random.default_rng(seed + 1_000_003)
    if scenario == "day":
        seconds = round((hours or 24.0) * 3600)
        return Workload(sessions=day_sessions(sessions, rng, seconds))
    if scenario == "step":
        seconds = round((hours or 1.5) * 3600)
        before = min(1800, seconds // 3)
        return Workload(sessions=step_sessions(sessions, 4.0, before, seconds - before))
    seconds = round((hours or 4.0) * 3600)
    return Workload(sessions=steady_sessions(sessions, seconds, 0.05, rng))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown or not strategies:
        print(
            f"mixrl simulate: --strategies: unknown {unknown or 'empty'}; choose from {STRATEGIES}",
            file=sys.stderr,
        )
        return 2
    if args.sessions <= 0:
        print(f"mixrl simulate: --sessions: must be > 0, got {args.sessions}", file=sys.stderr)
        return 2
    if args.hours is not None and not args.hours > 0:
        print(f"mixrl simulate: --hours: must be > 0, got {args.hours}", file=sys.stderr)
        return 2
    try:
        pools, _, configs, run_name = fleet_from_spec(args.spec)
    except (OSError, ValueError) as exc:
        print(f"mixrl simulate: {exc}", file=sys.stderr)
        return 2
    workload = make_workload(args.scenario, args.sessions, args.hours, args.seed)
    progress = None if args.quiet else ProgressPrinter()
    results = run_strategies(
        pools, configs, workload, strategies, seed=args.seed, gpu_budget=args.gpu_budget, progress=progress
    )
    rows = [summary(r) for r in results.values()]
    print(
        f"{run_name}: {len(pools)} pools, scenario {args.scenario}, {len(workload.sessions) / 3600:.1f} h, "
        f"peak {int(workload.sessions.max())} sessions, seed {args.seed}"
    )
    print(format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(
        json.dumps({"scenario": args.scenario, "results": rows}, indent=2) + "\n"
    )
    if not args.no_plots:
        from mixrl.sim.plots import plot_results

        for path in plot_results(results, out, title=f"{run_name} · {args.scenario}"):
            print(f"plot: {path}")
    print(f"summary: {out / 'summary.json'}")
    return 0
