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

Weight updates pause each pool by how its engines take a version (``mixrl.sim.weight_pause``): the
example's pools are all SGLang on the disk path, paused for the whole load (assumed 20 s per update,
no GPU measurement).  ``--pause-compare`` runs only the part the pause affects — both fleets' $/update,
steps/h and ``paused_share`` — under the model before issue #29 (every pool 20 s), today's per-pool
pause, BF16 pools on the trainer's broadcast, and every pool staged as mixrl's torch engine swaps
(``PAUSE_DECODE_STEPS`` of a decode step, measured by ``bench/weight_sync.py``), side by side; the
B200-only fleet at the example's NVFP4 capacity and as a BF16 fleet (``BF16_B200_CAPACITY``).

    python bench/fleet_cost.py                  # 4 simulated hours, about 1 min on 2 cores
    python bench/fleet_cost.py --hours 1        # quicker
    python bench/fleet_cost.py --pause-compare  # the weight-update pause, before and after
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from mixrl.sim.fleet import FleetPool
from mixrl.sim.simulate import fleet_from_spec
from mixrl.sim.trainer_coupled import RunResult, Strategy, TrainerRun, simulate_run, static_sized_to_trainer
from mixrl.sim.weight_pause import OLD_MODEL, WeightPause

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rlrun-mixed.yaml"
BF16_B200_CAPACITY = 3.2 / 1.5
"""A BF16 B200 replica: the example's NVFP4 capacity over its FP8 → BF16 step (docs/benchmarks.md)."""
PAUSES: tuple[tuple[str, WeightPause], ...] = (
    ("old: every pool 20 s", OLD_MODEL),
    ("per pool (SGLang disk 20 s assumed)", WeightPause()),
    ("per pool + BF16 broadcast", WeightPause(broadcast=True)),
    ("every pool staged (what-if)", WeightPause(staged_everywhere=True)),
)
"""``--pause-compare``'s weight-update pause models, in the order printed."""


def b200_fleet(
    pools: list[FleetPool], capacity: float | None, precision: str | None = None
) -> list[FleetPool]:
    """B200 pools only: the example's B200 pool, with room for the whole demand."""
    b200 = next(p for p in pools if p.gpu_type == "B200")
    return [
        replace(
            b200,
            name="b200-only",
            capacity=capacity or b200.capacity,
            min_replicas=0,
            max_replicas=256,
            weight_precision=precision or b200.weight_precision,
        )
    ]


def sized_run(pools: list[FleetPool], run: TrainerRun) -> tuple[RunResult, dict[str, int]]:
    """The static fleet sized to ``run`` (its pauses included) and its run."""
    sized = static_sized_to_trainer(pools, run)
    return simulate_run(pools, run, Strategy("static", "static", static_replicas=sized)), sized


def pause_compare(pools: list[FleetPool], run: TrainerRun) -> int:
    """Both fleets under each weight-update pause model (``PAUSES``), in one run."""
    started = time.monotonic()
    fleets = (
        ("mixed", pools),
        ("B200 NVFP4", b200_fleet(pools, None)),
        (f"B200 BF16 {BF16_B200_CAPACITY:.2f}", b200_fleet(pools, BF16_B200_CAPACITY, "bf16")),
    )
    print(f"decode step {run.decode_step_s * 1000:g} ms (sessions_per_capacity / tokens_per_s_per_capacity)")
    print(
        f"{'pause model':<37} {'fleet':<15} {'$/update':>9} {'steps/h':>8} {'paused':>7}  {'pause s':<14} replicas"
    )
    rows: dict[str, dict[str, RunResult]] = {}
    for label, pause in PAUSES:
        moved = replace(run, pause=pause)
        rows[label] = {}
        for name, fleet in fleets:
            result, sized = sized_run(fleet, moved)
            rows[label][name] = result
            seconds = sorted(
                {
                    round(float(s), 3)
                    for s, p in zip(moved.pause_seconds(fleet), fleet, strict=True)
                    if sized.get(p.name)
                }
            )
            used = ", ".join(f"{pool} {n}" for pool, n in sized.items() if n)
            print(
                f"{label:<37} {name:<15} {result.cost_per_step:>9.3f} {result.steps_per_hour:>8.2f} "
                f"{result.extra['paused_share']:>7.2%}  {'/'.join(f'{s:g}' for s in seconds):<14} {used}"
            )
    print(f"\n{'pause model':<37} " + " ".join(f"{'mixed ÷ ' + n:>22}" for n, _ in fleets[1:]))
    for label, results in rows.items():
        ratios = [results["mixed"].cost_per_step / results[n].cost_per_step for n, _ in fleets[1:]]
        print(f"{label:<37} " + " ".join(f"{r:>22.3f}" for r in ratios))
    print(f"\n({time.monotonic() - started:.0f} s; {run.hours:g} simulated hours per run)")
    return 0


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
    parser.add_argument(
        "--pause-compare",
        action="store_true",
        help="only the weight-update pause: old 20 s and per pool, side by side",
    )
    args = parser.parse_args()
    pools, _, _, _ = fleet_from_spec(str(EXAMPLE))
    run = TrainerRun(hours=args.hours)
    if args.pause_compare:
        return pause_compare(pools, run)
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
