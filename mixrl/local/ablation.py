"""``mixrl ablate FILE``: the seed's stability study on this machine — arms × fleets × seeds.

From one RLRun, every combination of

- an **arm** (:data:`ARMS`): which corrections train and how the samplers sample — plain GRPO on the
  full vocabulary, GRPO + MIS, score centering (SC) alone, GRPO with top-p and no mask replay,
  SC + MIS, and SC + MIS + top-p with mask replay (the seed's stable recipe);
- a **fleet** (:data:`FLEETS`): the run's own sampler pools (``mixed``), as many pools all at
  BF16 with a BF16 KV cache (``bf16``, the homogeneous baseline), or the run's pools with
  mismatch-aware routing (``mixed-health``);
- a **seed**: each engine's ``--random-seed`` (the samplers' draws; the tasks, the warm start and
  the trainer stay the same, so seeds differ by sampling alone);

is run with ``mixrl run`` into ``OUT/runs/<arm>-<fleet>-s<seed>/``, ``--jobs`` at a time.  A
finished run (its ``summary.json`` names the wanted step count) is skipped, an interrupted one
resumes from its checkpoint, so running the same command again completes a study; a run made from
another RLRun or other ``--evaluation``/``--kernels`` (its ``OUT/runs/<job>.yaml`` differs) is
refused before anything starts, not reused (:func:`manifest_mismatch`).  Ctrl-C or SIGTERM stops
the study: no queued run starts, the running ones stop (each ``mixrl run`` stops its components and
keeps its data, to resume later), and one line names the runs that finished.  Then one table
(``OUT/ablation.md``, ``OUT/ablation.json``) and plots (``OUT/ablation.png``): final and best
held-out pass@1 with the spread over seeds, the collapse signs raised, the fresh (staleness-0) KL
of each fleet and the mixed/homogeneous ratio of it (the seed's 4.7×), and each pool's share of
samples against its share of extreme-ratio tokens.

The arms and fleets are pure functions of the RLRun document (:func:`arm_document`); the runs are
the real local runtime.  Held-out pass@k comes from the BF16 evaluator (``evaluation.sampler:
bf16``: exactly the version each evaluation names, the full vocabulary; docs/rollout.md#the-bf16-evaluator)
unless ``--evaluation pools`` asks for the run's own pools, as the first study recorded used.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mixrl.api.errors import InvalidSpec
from mixrl.api.loader import ManifestUnreadable, load_rlrun, parse_document
from mixrl.api.plain_text import plain_text
from mixrl.local.processes import StopSignals
from mixrl.local.report import evaluations_file, mapping, number, pool_shares, step_records
from mixrl.rl.health.collapse import assess

Doc = dict[str, Any]

FULL_VOCABULARY = {"p": 1.0, "k": -1, "maskReplay": True}
MIS = [0.2, 5.0]


@dataclass(frozen=True)
class Arm:
    name: str
    title: str
    mis: bool
    score_centering: bool
    top_p: bool
    replay: bool = True


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("grpo", "GRPO", mis=False, score_centering=False, top_p=False),
        Arm("grpo-mis", "GRPO+MIS", mis=True, score_centering=False, top_p=False),
        Arm("sc", "SC", mis=False, score_centering=True, top_p=False),
        Arm(
            "grpo-topp", "GRPO+top-p (no replay)", mis=False, score_centering=False, top_p=True, replay=False
        ),
        Arm("sc-mis", "SC+MIS", mis=True, score_centering=True, top_p=False),
        Arm("sc-mis-topp", "SC+MIS+top-p replay", mis=True, score_centering=True, top_p=True),
    )
}
"""The seed's six arms.  Without top-p the samplers draw from the whole vocabulary (p 1, no top-k)."""
FLEETS = ("mixed", "bf16", "mixed-health")
"""``mixed-health``: the run's own pools with mismatch-aware routing (``spec.health.routing`` at
:data:`ROUTING`): the comparison of capacity × health against plain capacity routing."""
ROUTING = {"klThreshold": 0.003, "extremeShareThreshold": 0.002, "degradeAfter": 3, "recoverAfter": 3}
"""Thresholds of the ``mixed-health`` fleet: between the quickstart's BF16 pool's fresh mismatch
(k3 about 3e-5) and its low-precision pools' (2e-3 to 4e-3), so the FP4 pools are the ones to
lose traffic if their fresh mismatch stays high."""
KERNELS = {
    "serving": ["--dtype", "bfloat16", "--attention-backend", "split_kv"],
    "trainer": [],
}
"""``--kernels``: how every torch-engine pool of every fleet computes.  ``serving`` (the default):
BF16 activations and a serving kernel's attention order, so the BF16 fleet differs from its
trainer by kernels as a real one does (docs/engine.md, "Precision emulation"); ``trainer``: the
trainer's float32 and attention order (a BF16 pool is then the trainer up to its weights' rounding,
the first studies' fleets)."""
DEFAULT_TOP_P = {"p": 0.95, "k": 32}
"""The nucleus of the top-p arms when the RLRun itself samples the whole vocabulary."""


def arm_document(
    run: Doc, arm: Arm, fleet: str, seed: int, evaluation: str = "bf16", kernels: str = "serving"
) -> Doc:
    """The RLRun document of one run of the study (pure: ``run`` is left as it was); ``evaluation``
    is its ``evaluation.sampler`` (the BF16 evaluator by default, the study's protocol), ``kernels``
    what the torch-engine pools compute with (:data:`KERNELS`)."""
    if fleet not in FLEETS:
        raise ValueError(f"fleet: {fleet!r} is not one of {', '.join(FLEETS)}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels: {kernels!r} is not one of {', '.join(KERNELS)}")
    doc = copy.deepcopy(run)
    doc["metadata"]["name"] = f"{arm.name}-{fleet}-s{seed}"[:40]
    spec = doc["spec"]
    algorithm = spec.setdefault("algorithm", {})
    given = algorithm.get("topP") or {}
    nucleus = {"p": given["p"], "k": given.get("k", -1)} if given.get("p", 1.0) < 1.0 else dict(DEFAULT_TOP_P)
    algorithm["topP"] = {**nucleus, "maskReplay": arm.replay} if arm.top_p else dict(FULL_VOCABULARY)
    corrections = algorithm.setdefault("corrections", {})
    corrections["mis"] = list(MIS) if arm.mis else None
    corrections["scoreCentering"] = arm.score_centering
    pools = []
    for pool in spec["samplerPools"]:
        pool = dict(pool)
        if fleet == "bf16":
            pool.update(weightPrecision="bf16", kvCacheDtype="bf16")
        served_by_torch = pool.get("engine", "sglang") == "torch"
        kernel_args = KERNELS[kernels] if served_by_torch else []
        pool["engineArgs"] = [*pool.get("engineArgs", []), *kernel_args, "--random-seed", str(seed)]
        pools.append(pool)
    if fleet == "bf16":  # pool names carry the precision in the examples: say it is a BF16 copy
        for index, pool in enumerate(pools):
            pool["name"] = f"bf16-{index}"
    spec["samplerPools"] = pools
    if fleet == "mixed-health":
        spec.setdefault("health", {})["routing"] = dict(ROUTING)
    spec.setdefault("evaluation", {})["sampler"] = evaluation
    return doc


@dataclass(frozen=True)
class Job:
    arm: Arm
    fleet: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.arm.name}-{self.fleet}-s{self.seed}"


def jobs_of(arms: Sequence[str], fleets: Sequence[str], seeds: int) -> list[Job]:
    return [Job(ARMS[arm], fleet, seed) for seed in range(seeds) for arm in arms for fleet in fleets]


def finished(run_dir: Path, steps: int) -> bool:
    """A run of the study is done when its report names the wanted number of steps."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("steps") == steps
    except (OSError, ValueError, AttributeError):
        return False


def manifest_mismatch(manifest: Path, document: Doc) -> str | None:
    """Why the run whose manifest is ``manifest`` is not the run ``document`` asks for (None when it
    is, or when there is no manifest: nothing ran there yet).  ``finished`` and ``mixrl run
    --run-dir`` look at the run directory alone, so without this a study re-run with other flags or
    an edited RLRun would reuse runs made with other settings under a header naming the new ones.
    Compared as YAML data, the way :func:`run_job` writes the manifest, so key order and formatting
    do not count."""
    try:
        text = manifest.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"unreadable ({exc.strerror}), so the run there cannot be checked against this study"
    wanted = yaml.safe_load(yaml.safe_dump(document, sort_keys=False))
    try:
        made = yaml.safe_load(text)
    except yaml.YAMLError:
        return "not valid YAML, so the run there cannot be checked against this study"
    if made != wanted:
        return "that run was made from another RLRun or other flags (--evaluation/--kernels)"
    return None


def study_command(
    file: Path,
    arms: Sequence[str],
    fleets: Sequence[str],
    seeds: int,
    steps: int,
    evaluation: str,
    kernels: str,
) -> str:
    """The command at the top of ``ablation.md``: every flag that changes the runs, so running it
    again reproduces the study (``--jobs`` and ``--out`` do not change a run)."""
    flags = {"--arms": ",".join(arms), "--fleets": ",".join(fleets), "--seeds": seeds, "--steps": steps,
             "--evaluation": evaluation, "--kernels": kernels}  # fmt: skip
    return " ".join(["mixrl ablate", str(file), *(f"{flag} {value}" for flag, value in flags.items())])


NOT_STARTED = "not started (the study was stopped)"


class RunningRuns:
    """The study's ``mixrl run`` processes now running, so that stopping the study stops them; once
    it is stopping, no other starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._processes: set[subprocess.Popen[bytes]] = set()
        self.stopping = False

    def start(self, command: list[str], **popen: Any) -> subprocess.Popen[bytes] | None:
        """``subprocess.Popen(command, **popen)``, or None once the study is stopping."""
        with self._lock:  # (a run started while stop() looks would be missed by it)
            if self.stopping:
                return None
            process = subprocess.Popen(command, **popen)
            self._processes.add(process)
            return process

    def ended(self, process: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._processes.discard(process)

    def stop(self) -> None:
        """SIGTERM to every running ``mixrl run``, which stops its components in order and keeps what
        it collected (a Ctrl-C at the terminal has sent them SIGINT already: they ignore this second
        signal), then wait for them: each bounds its own shutdown, and one killed here would
        orphan its components, which run in their own sessions."""
        with self._lock:
            self.stopping = True
            running = list(self._processes)
        for process in running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in running:
            process.wait()


def run_job(
    job: Job,
    run: Doc,
    out: Path,
    steps: int,
    python: str = sys.executable,
    evaluation: str = "bf16",
    kernels: str = "serving",
    runs: RunningRuns | None = None,
) -> tuple[Job, float, str]:
    """One run of the study through ``mixrl run`` (resumed when interrupted); (job, seconds, status).
    ``runs``: where the process is registered while it runs, so stopping the study stops it."""
    run_dir = out / "runs" / job.name
    if finished(run_dir, steps):
        return job, 0.0, "done before"
    runs = runs if runs is not None else RunningRuns()
    if runs.stopping:
        return job, 0.0, NOT_STARTED
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = run_dir.parent / f"{job.name}.yaml"
    document = arm_document(run, job.arm, job.fleet, job.seed, evaluation, kernels)
    manifest.write_text(yaml.safe_dump(document, sort_keys=False))
    started = time.monotonic()
    with (run_dir.parent / f"{job.name}.log").open("ab") as log:
        process = runs.start(
            [
                python,
                "-m",
                "mixrl.cli",
                "run",
                str(manifest),
                "--run-dir",
                str(run_dir),
                "--steps",
                str(steps),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        if process is None:
            return job, 0.0, NOT_STARTED
        try:
            returncode = process.wait()
        finally:
            runs.ended(process)
    status = "ok" if returncode == 0 and finished(run_dir, steps) else f"failed (exit {returncode})"
    return job, time.monotonic() - started, status


# ----------------------------------------------------------------------------- the table


def late_mean(records: list[Doc], key: str, pool: str | None = None, fraction: float = 0.25) -> float | None:
    """Mean of ``key`` over the last ``fraction`` of the steps (a pool's own figure with ``pool``)."""
    tail = records[-max(1, int(len(records) * fraction)) :]
    values = []
    for record in tail:
        source = mapping(mapping(record.get("pools")).get(pool)) if pool is not None else record
        value = number(source.get(key))
        if value is not None:
            values.append(value)
    return sum(values) / len(values) if values else None


def run_figures(run_dir: Path) -> Doc:
    """What the table needs from one finished run directory."""
    records = step_records(run_dir / "metrics.jsonl")
    evaluations = step_records(evaluations_file(run_dir))
    pass1 = [rate for e in evaluations if (rate := number(mapping(e.get("pass_at_k")).get("1"))) is not None]
    pools = sorted({pool for r in records for pool in mapping(r.get("pools"))})
    return {
        "steps": records[-1]["step"] if records else 0,
        "final_pass1": pass1[-1] if pass1 else None,
        "best_pass1": max(pass1) if pass1 else None,
        "pass1_curve": [(e["step"], number(mapping(e.get("pass_at_k")).get("1"))) for e in evaluations],
        "reward_curve": [(r["step"], number(r.get("reward"))) for r in records],
        "signs": sorted({f"{s.name}({s.scope})" for s in assess(records).raised}),
        "fresh_kl_k3": late_mean(records, "kl_k3_fresh"),
        "fresh_kl_k1": late_mean(records, "kl_k1_fresh"),
        "kl_k3": late_mean(records, "kl_k3"),
        "format_error_endings": late_mean(records, "format_error_endings"),
        "pool_fresh_kl_k3": {pool: late_mean(records, "kl_k3_fresh", pool) for pool in pools},
        "pool_shares": pool_shares(records),
        "pool_routing": _routing(run_dir),
    }


def _routing(run_dir: Path) -> dict[str, float]:
    """Per pool, the share of sampled positions routed to other experts than the trainer's (MoE
    runs: ``routing.json`` of ``mixrl report``); empty for a dense model."""
    try:
        measured = json.loads((run_dir / "routing.json").read_text())
        return {pool: float(figures["any_layer"]) for pool, figures in measured.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def spread(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, standard deviation over seeds, how many seeds had the figure)."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None, 0
    deviation = statistics.stdev(present) if len(present) > 1 else 0.0
    return statistics.fmean(present), deviation, len(present)


def shown(value: tuple[float | None, float | None, int], digits: str = ".3f") -> str:
    mean, deviation, count = value
    if mean is None:
        return "–"
    return f"{mean:{digits}} ± {deviation:{digits}}" if count > 1 else f"{mean:{digits}}"


def study_table(
    figures: dict[str, Doc], arms: Sequence[str], fleets: Sequence[str], seeds: int
) -> tuple[list[str], Doc]:
    """The study's Markdown table and its figures as JSON (means and spreads over seeds)."""
    rows: Doc = {}
    lines = [
        "| arm | fleet | seeds | final pass@1 | best pass@1 | seeds with a collapse sign | fresh KL k3 | fresh KL k1 | format-error endings |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        for fleet in fleets:
            runs = [figures[name] for s in range(seeds) if (name := f"{arm}-{fleet}-s{s}") in figures]
            if not runs:
                continue
            row = {
                key: spread([r[key] for r in runs])
                for key in ("final_pass1", "best_pass1", "fresh_kl_k3", "fresh_kl_k1", "format_error_endings")
            }
            collapsed = sum(1 for r in runs if r["signs"])
            rows[f"{arm}/{fleet}"] = {**row, "runs": len(runs), "collapsed": collapsed,
                                      "signs": sorted({s for r in runs for s in r["signs"]})}  # fmt: skip
            lines.append(
                f"| {ARMS[arm].title} | {fleet} | {len(runs)} | {shown(row['final_pass1'])} | "
                f"{shown(row['best_pass1'])} | {collapsed}/{len(runs)} | {shown(row['fresh_kl_k3'], '.2e')} | "
                f"{shown(row['fresh_kl_k1'], '.2e')} | {shown(row['format_error_endings'], '.2f')} |"
            )
    ratios = []
    for arm in arms:
        mixed, bf16 = rows.get(f"{arm}/mixed"), rows.get(f"{arm}/bf16")
        # k3 where it is unbiased (no top-p, or top-p with replay): it has the lower variance; k1
        # where top-p runs without replay (k3 reads low there: docs/corrections.md).
        key = "fresh_kl_k1" if ARMS[arm].top_p and not ARMS[arm].replay else "fresh_kl_k3"
        if mixed and bf16 and mixed[key][0] and bf16[key][0]:
            ratio = mixed[key][0] / bf16[key][0]
            ratios.append(f"| {ARMS[arm].title} | {key.removeprefix('fresh_kl_')} | {ratio:.1f}× |")
            rows[f"{arm}/mixed"]["fresh_kl_ratio_to_bf16"] = ratio
    if ratios:
        lines += ["", "Fresh (staleness-0) KL, mixed fleet ÷ homogeneous BF16 fleet (the seed: ≈ 4.7×):", "",
                  "| arm | estimate | ratio |", "|---|---|---|", *ratios]  # fmt: skip
    return lines, rows


def extreme_lines(figures: dict[str, Doc]) -> list[str]:
    """Per pool of the mixed fleet, over every arm and seed: share of samples, share of extreme tokens."""
    samples: dict[str, list[float]] = {}
    extreme: dict[str, list[float]] = {}
    for name, figure in figures.items():
        if "-mixed-" not in name:
            continue
        for pool, (sample_share, extreme_share) in figure["pool_shares"].items():
            samples.setdefault(pool, []).append(sample_share)
            extreme.setdefault(pool, []).append(extreme_share)
    if not samples:
        return []
    lines = ["", "Mixed fleet, per pool (mean over every arm and seed; the seed: H100 FP8 drew 10 % of the",
             "samples and 29 % of the extreme-ratio tokens):", "",
             "| pool | share of samples | share of extreme-ratio tokens |", "|---|---|---|"]  # fmt: skip
    for pool in sorted(samples):
        lines.append(
            f"| {pool} | {statistics.fmean(samples[pool]):.1%} | {statistics.fmean(extreme[pool]):.1%} |"
        )
    return lines


def routing_lines(figures: dict[str, Doc]) -> list[str]:
    """Per fleet and pool, over every arm and seed: the MoE routing mismatch (none for a dense model)."""
    shares: dict[tuple[str, str], list[float]] = {}
    for name, figure in figures.items():
        fleet = next((f for f in sorted(FLEETS, key=len, reverse=True) if f"-{f}-s" in name), "?")
        for pool, share in (figure.get("pool_routing") or {}).items():
            shares.setdefault((fleet, pool), []).append(share)
    if not shares:
        return []
    lines = ["", "MoE routing mismatch (mean over every arm and seed): the share of sampled positions whose",
             "top-k experts differ from the trainer's in at least one layer, at staleness 0 (`mixrl report`):", "",
             "| fleet | pool | routed differently | runs |", "|---|---|---|---|"]  # fmt: skip
    for (fleet, pool), values in sorted(shares.items()):
        lines.append(f"| {fleet} | {pool} | {statistics.fmean(values):.1%} | {len(values)} |")
    return lines


def plot_study(
    figures: dict[str, Doc], arms: Sequence[str], fleets: Sequence[str], seeds: int, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, kl) = plt.subplots(1, 2, figsize=(14, 5))
    for arm in arms:
        for fleet in fleets:
            runs = [figures[n] for s in range(seeds) if (n := f"{arm}-{fleet}-s{s}") in figures]
            by_step: dict[int, list[float]] = {}
            for run in runs:
                for step, rate in run["pass1_curve"]:
                    if rate is not None:
                        by_step.setdefault(step, []).append(rate)
            if not by_step:
                continue
            steps = sorted(by_step)
            means = [statistics.fmean(by_step[s]) for s in steps]
            low = [min(by_step[s]) for s in steps]
            high = [max(by_step[s]) for s in steps]
            style = "-" if fleet == "mixed" else "--"
            (line,) = curves.plot(steps, means, style, label=f"{ARMS[arm].title} / {fleet}")
            curves.fill_between(steps, low, high, alpha=0.15, color=line.get_color())
    curves.set(
        title=f"Held-out pass@1 (band: min–max over {seeds} seeds)", xlabel="trainer step", ylabel="pass@1"
    )
    curves.legend(fontsize=7)
    curves.grid(alpha=0.3)
    labels, values = [], []
    for arm in arms:
        key = "fresh_kl_k1" if ARMS[arm].top_p and not ARMS[arm].replay else "fresh_kl_k3"
        for fleet in fleets:
            got = [
                f[key]
                for s in range(seeds)
                if (f := figures.get(f"{arm}-{fleet}-s{s}")) and f[key] is not None
            ]
            if got:
                labels.append(f"{ARMS[arm].title}\n{fleet} ({key.removeprefix('fresh_kl_')})")
                values.append(statistics.fmean(got))
    kl.bar(range(len(values)), values)
    kl.set_yscale("log")
    kl.set_xticks(range(len(values)), labels, fontsize=6, rotation=60)
    kl.set(title="Fresh (staleness-0) KL, last quarter of the steps, mean over seeds", ylabel="KL")
    kl.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def write_study(out: Path, arms: Sequence[str], fleets: Sequence[str], seeds: int, command: str) -> Path:
    figures = {
        job.name: run_figures(out / "runs" / job.name)
        for job in jobs_of(arms, fleets, seeds)
        if (out / "runs" / job.name / "metrics.jsonl").exists()
    }
    table, rows = study_table(figures, arms, fleets, seeds)
    lines = ["# Ablation study", "", f"`{command}`", "", *table, *extreme_lines(figures), *routing_lines(figures), "",
             "![ablation](ablation.png)", ""]  # fmt: skip
    (out / "ablation.md").write_text("\n".join(lines), encoding="utf-8")
    (out / "ablation.json").write_text(json.dumps({"rows": rows, "runs": figures}, indent=1) + "\n")
    plot_study(figures, arms, fleets, seeds, out / "ablation.png")
    return out / "ablation.md"


def _names(raw: str, known: Sequence[str], flag: str) -> list[str]:
    names = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"{flag}: {unknown[0] if unknown else raw!r} is not one of {', '.join(known)}")
    return names


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mixrl ablate", description=plain_text(__doc__).split("\n\n")[0])
    parser.add_argument("file", type=Path, help="the RLRun the study varies")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument(
        "--fleets", default="mixed,bf16", help=f"comma-separated, of {', '.join(FLEETS)} (default mixed,bf16)"
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm and fleet (default 3)")
    parser.add_argument(
        "--steps", type=int, default=None, help="trainer steps per run (default: the RLRun's)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each is several processes)")
    parser.add_argument(
        "--evaluation",
        choices=("bf16", "pools"),
        default="bf16",
        help="evaluation.sampler of every run: the BF16 evaluator (default) or the training pools",
    )
    parser.add_argument(
        "--kernels",
        choices=tuple(KERNELS),
        default="serving",
        help="what the torch-engine pools compute with: serving kernels (BF16 activations, split-KV "
        "attention; default) or the trainer's (float32, its attention order)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs") / "ablation", help="study directory")
    args = parser.parse_args(argv)
    try:
        arms = _names(args.arms, list(ARMS), "--arms")
        fleets = _names(args.fleets, FLEETS, "--fleets")
        if args.seeds <= 0 or args.jobs <= 0 or (args.steps is not None and args.steps <= 0):
            raise ValueError("--seeds, --jobs and --steps: must be positive")
        run = load_rlrun(args.file)
    except (ValueError, InvalidSpec, ManifestUnreadable) as exc:
        print(f"mixrl ablate: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    steps = args.steps or run.spec.trainer.total_steps
    if steps is None:
        print("mixrl ablate: --steps: required (the RLRun has no trainer.totalSteps)", file=sys.stderr)
        return 2
    # The document as written (a dump would turn a null the user chose back into its default).
    document = yaml.safe_load(args.file.read_text(encoding="utf-8"))
    jobs = jobs_of(arms, fleets, args.seeds)
    # Every derived run must be valid, and must not clash with a run already in --out (made with
    # other settings, it would be skipped or resumed as if it were this study's), before any starts.
    for job in jobs:
        derived = arm_document(document, job.arm, job.fleet, job.seed, args.evaluation, args.kernels)
        try:
            load_rlrun_document(derived)
        except InvalidSpec as exc:
            print(f"mixrl ablate: {job.name}: {exc.first_line}", file=sys.stderr)
            return 2
        manifest = args.out / "runs" / f"{job.name}.yaml"
        if (reason := manifest_mismatch(manifest, derived)) is not None:
            print(
                f"mixrl ablate: {manifest}: {reason}; use another --out, "
                f"or delete {args.out / 'runs' / job.name}* to redo it",
                file=sys.stderr,
            )
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"mixrl ablate: {len(jobs)} runs of {steps} steps, {args.jobs} at a time, in {args.out}", flush=True
    )
    started, done, took = time.monotonic(), 0, []
    failed = []
    runs, interrupted = RunningRuns(), False
    pool = ThreadPoolExecutor(max_workers=args.jobs)
    # SIGTERM as Ctrl-C: either stops the study (a second one is ignored while it stops).
    with StopSignals(KeyboardInterrupt) as signals:
        try:
            futures: list[Future[tuple[Job, float, str]]] = [
                pool.submit(
                    run_job,
                    job,
                    document,
                    args.out,
                    steps,
                    sys.executable,
                    args.evaluation,
                    args.kernels,
                    runs,
                )
                for job in jobs
            ]
            pending = set(futures)  # waited for a second at a time, so that a lost raise is found
            while pending:
                completed, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                signals.check()
                for future in (future for future in futures if future in completed):
                    job, seconds, status = future.result()
                    done += 1
                    if seconds:
                        took.append(seconds)
                    if not status.startswith(("ok", "done")):
                        failed.append(job.name)
                    left = len(jobs) - done
                    eta = statistics.fmean(took) * math.ceil(left / args.jobs) if took else 0.0
                    rate = len(took) / max(time.monotonic() - started, 1e-9) * 3600  # of runs that ran
                    print(
                        f"[{done}/{len(jobs)}] {job.name}: {status} in {seconds:.0f}s  ({rate:.1f} runs/h, ETA {eta:.0f}s)",
                        flush=True,
                    )
        except KeyboardInterrupt:
            interrupted = True
            print("\nmixrl ablate: interrupted; stopping the running runs", flush=True)
        finally:  # (also when a job fails unexpectedly: no run of the study is left running)
            signals.stopping = True
            # Without cancel_futures the pool would go on to start every queued job (each a whole
            # run); once every job has ended, there is nothing left to cancel or stop.
            pool.shutdown(wait=False, cancel_futures=True)
            runs.stop()
            pool.shutdown(wait=True)  # the running jobs' threads end once their run has stopped
    if interrupted:
        complete = [job.name for job in jobs if finished(args.out / "runs" / job.name, steps)]
        print(
            f"mixrl ablate: stopped; {len(complete)} of {len(jobs)} runs finished"
            + (f" ({', '.join(complete)})" if complete else "")
            + "; run the same command again to resume the others",
            flush=True,
        )
        return 130
    command = study_command(args.file, arms, fleets, args.seeds, steps, args.evaluation, args.kernels)
    report = write_study(args.out, arms, fleets, args.seeds, command)
    print(f"mixrl ablate: table in {report}, plots in {args.out / 'ablation.png'}")
    if failed:
        print(
            f"mixrl ablate: failed: {', '.join(failed)} (logs in {args.out / 'runs'}); run again to resume",
            file=sys.stderr,
        )
        return 1
    return 0


def load_rlrun_document(doc: Doc) -> None:
    """Validate a derived document as ``mixrl run`` will load it."""
    parse_document(doc)
