"""Benchmark: cost per trainer update of the mixed fleet against a homogeneous B200 fleet.

The seed reports its mixed fleet about 15 % cheaper per update than a homogeneous B200 fleet for the
same throughput.  This runs the trainer-coupled fleet model (``mixrl.sim.trainer_coupled``)
on ``examples/rlrun-mixed.yaml``'s pools (their capacities and ``costPerGpuHour``) and on B200 pools
alone, each as a static fleet sized to the same trainer (the AReaL / verl way, so that neither
strategy's autoscaling is what is compared), and reports trainer steps/h, idle share and dollars per
update.  Then it says which inputs drive the ratio: each input moved by ±25 % on its own, the ratio
recomputed (a tornado table).

The homogeneous fleet's B200 replicas serve at the example's B200 NVFP4 capacity (``--b200-capacity``
to change it: a BF16 B200 fleet serves less per GPU, which the seed's fleet may have been).  A model
of the fleet, not a measurement of GPUs: the capacities and prices are the example's assumptions.

    python bench/fleet_cost.py            # 4 simulated hours, about 1 min on 2 cores
    python bench/fleet_cost.py --hours 1  # quicker
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from mixrl.sim.fleet import FleetPool
from mixrl.sim.simulate import fleet_from_spec
from mixrl.sim.trainer_coupled import Strategy, TrainerRun, simulate_run, static_sized_to_trainer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rlrun-mixed.yaml"


def b200_fleet(pools: list[FleetPool], capacity: float | None) -> list[FleetPool]:
    """B200 pools only: the example's B200 pool, with room for the whole demand."""
    b200 = next(p for p in pools if p.gpu_type == "B200")
    return [
        replace(b200, name="b200-only", capacity=capacity or b200.capacity, min_replicas=0, max_replicas=256)
    ]


def cost_per_step(pools: list[FleetPool], run: TrainerRun) -> tuple[float, float, float, dict[str, int]]:
    """(dollars per update, steps/h, trainer idle share, replicas) of a static fleet sized to ``run``."""
    sized = static_sized_to_trainer(pools, run)
    result = simulate_run(pools, run, Strategy("static", "static", static_replicas=sized))
    return result.cost_per_step, result.steps_per_hour, result.idle_share, sized


def ratio(mixed: list[FleetPool], b200_capacity: float | None, run: TrainerRun) -> float:
    return cost_per_step(mixed, run)[0] / cost_per_step(b200_fleet(mixed, b200_capacity), run)[0]


def scaled(pools: list[FleetPool], name: str, field: str, factor: float) -> list[FleetPool]:
    return [replace(p, **{field: getattr(p, field) * factor}) if p.name == name else p for p in pools]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=4.0, help="simulated hours per run")
    parser.add_argument("--b200-capacity", type=float, default=None, help="capacity of a B200 replica")
    args = parser.parse_args()
    pools, _, _, _ = fleet_from_spec(str(EXAMPLE))
    run = TrainerRun(hours=args.hours)
    started = time.monotonic()
    mixed = cost_per_step(pools, run)
    homogeneous = cost_per_step(b200_fleet(pools, args.b200_capacity), run)
    print(f"{'fleet':<12} {'$/update':>9} {'steps/h':>8} {'idle':>6}  replicas")
    for name, (dollars, steps, idle, sized) in (("mixed", mixed), ("B200 only", homogeneous)):
        used = ", ".join(f"{pool} {n}" for pool, n in sized.items() if n)
        print(f"{name:<12} {dollars:>9.2f} {steps:>8.1f} {idle:>6.1%}  {used}")
    base = mixed[0] / homogeneous[0]
    print(f"\nmixed / B200-only cost per update: {base:.3f} ({1 - base:+.1%} cheaper; the seed: about 15 %)")

    # Which inputs drive it: each moved by ±25 % alone.
    # The B200-only fleet copies the example's B200 pool, so a B200 input moves both fleets.
    inputs: list[tuple[str, tuple[str, ...]]] = []
    for pool in pools:
        if mixed[3].get(pool.name):
            both = " (both fleets)" if pool.gpu_type == "B200" and args.b200_capacity is None else ""
            inputs.append((f"{pool.name} price{both}", ("pool", pool.name, "cost_per_gpu_hour")))
            inputs.append((f"{pool.name} capacity{both}", ("pool", pool.name, "capacity")))
    inputs.append(("trainer step time", ("run",)))
    rows = []
    for index, (label, what) in enumerate(inputs, start=1):
        moved = []
        for factor in (0.75, 1.25):
            if what[0] == "pool":
                moved.append(ratio(scaled(pools, what[1], what[2], factor), args.b200_capacity, run))
            else:
                step = tuple((t, s * factor) for t, s in run.step_seconds)
                moved.append(ratio(pools, args.b200_capacity, replace(run, step_seconds=step)))
        rows.append((max(abs(m - base) for m in moved), label, moved))
        elapsed = time.monotonic() - started
        eta = elapsed / (index + 1) * (len(inputs) - index)
        print(f"  [{index}/{len(inputs)}] {label}  ({elapsed:.0f}s, ETA {eta:.0f}s)", file=sys.stderr)
    print(f"\n{'input (x0.75 / x1.25)':<28} {'ratio at x0.75':>14} {'at x1.25':>9}")
    for _, label, (low, high) in sorted(rows, reverse=True):
        print(f"{label:<28} {low:>14.3f} {high:>9.3f}")
    print(f"\n({time.monotonic() - started:.0f} s; {args.hours:g} simulated hours per run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
