"""``mixrl report DIR``: plots and a summary of a run directory.

Reads ``metrics.jsonl`` (one line per trainer step) and ``evaluations.jsonl`` (held-out pass@k; the
buffer's ``buffer/evaluations.jsonl`` where that is newer, as for a run that crashed or still runs)
and writes ``report.png`` (all panels), one PNG per panel under ``plots/``, and ``report.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mixrl.api.errors import InvalidSpec
from mixrl.api.loader import ManifestUnreadable, load_rlrun
from mixrl.api.models import CollapseSpec
from mixrl.api.plain_text import plain_text
from mixrl.rl.health.collapse import assess, report_lines

PANELS: list[tuple[str, str, str]] = [
    # (file name, title, y label)
    ("reward", "Training reward", "mean reward"),
    ("pass_at_k", "Held-out pass@k", "pass@k"),
    ("kl", "Sampler–trainer KL (k3) per pool", "KL"),
    ("extreme_ratio", "Tokens with ratio outside [0.2, 5] per pool", "share"),
    ("staleness", "Staleness (trainer version − token version)", "versions"),
    ("grad_norm", "Gradient norm", "‖g‖"),
    ("entropy", "Trainer entropy", "nats"),
    ("format_errors", "Episodes ended on repeated format errors", "share"),
    ("kl_fresh", "Fresh (staleness-0) KL (k3) per pool: precision alone", "KL"),
    ("kl_fresh_k1", "Fresh KL (k1, unbiased without replay) per pool", "KL"),
    ("kl_by_staleness", "KL (k3) of the run by staleness", "KL"),
    ("extreme_vs_samples", "Share of samples vs share of extreme-ratio tokens", "share of the run"),
]


_WARNED: set[tuple[Path, int]] = set()

EVALUATIONS = "evaluations.jsonl"
"""The held-out results: the buffer's log of them (``mixrl.rl.buffer.store.EVALUATIONS``, not
imported: the buffer's store is more than a report needs) and the run directory's copy of it."""
RESTART_GAP_S = 1.0
"""How far apart the start times of two metrics records (``time - elapsed``) must be to come from
two trainer processes: one process's differ by the microseconds between its two clock readings, and
a restart (a new interpreter, a checkpoint loaded) takes seconds."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records (JSON objects) of a JSON-lines log such as metrics.jsonl or evaluations.jsonl.

    Telemetry never stops a run or its report: a line that is not a JSON object (a line cut short
    by a crash, a stray edit) is skipped, with one warning per line.
    """
    if not path.exists():
        return []
    records = []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif number < len(lines) and (path, number) not in _WARNED:
            # (an unterminated last line may be a record still being written: no warning for it)
            _WARNED.add((path, number))
            print(f"mixrl: {path}: skipping line {number}, not a JSON object", file=sys.stderr)
    return records


def has_step(record: dict[str, Any]) -> bool:
    step = record.get("step")
    return isinstance(step, int) and not isinstance(step, bool)


def number(value: Any) -> float | None:
    """A JSON number as a float; anything else a damaged or foreign record may hold there (a
    string, a list, a bool) is None, so it is left off a plot rather than ending the report."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def pass_at_k(evaluation: dict[str, Any]) -> dict[str, float]:
    """An evaluation's ``{k: rate}``, keeping the entries with an integer k and a numeric rate."""
    rates = {
        k: number(v) for k, v in mapping(evaluation.get("pass_at_k")).items() if k.isascii() and k.isdigit()
    }
    return {k: v for k, v in rates.items() if v is not None}


def step_records(path: Path) -> list[dict[str, Any]]:
    """The records of a telemetry log that carry their step (the others cannot be placed on a plot)."""
    return [record for record in read_jsonl(path) if has_step(record)]


def buffer_directory(run_dir: Path) -> Path:
    """The buffer's directory of a local run."""
    return run_dir / "buffer"


def buffer_evaluations(run_dir: Path) -> Path:
    """The held-out evaluations as the buffer writes them, while the run goes on."""
    return buffer_directory(run_dir) / EVALUATIONS


def evaluations_file(run_dir: Path) -> Path:
    """Where a run directory's held-out evaluations are read from: the copy ``mixrl run`` makes once
    its components have stopped, unless the buffer's own log is newer — a run that crashed or still
    runs has no copy, or the previous start's — so pass@k is never left out of a report."""
    copy, log = run_dir / EVALUATIONS, buffer_evaluations(run_dir)
    try:
        logged = log.stat().st_mtime
    except OSError:
        return copy
    try:
        return log if logged > copy.stat().st_mtime else copy
    except OSError:
        return log


def trainer_processes(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """metrics.jsonl's records split by the trainer process that wrote them, in order.

    Each process's ``elapsed`` starts at zero (a resumed run, a restarted trainer), while the steps
    go on from its checkpoint: a new process is where ``elapsed`` goes backwards, or where a
    record's start time (``time - elapsed``) moves, for a restart slower than the steps before it.
    """
    processes: list[list[dict[str, Any]]] = []
    last_elapsed: float | None = None
    last_origin: float | None = None
    for record in records:
        elapsed, wall = number(record.get("elapsed")), number(record.get("time"))
        origin = wall - elapsed if wall is not None and elapsed is not None else None
        restarted = (elapsed is not None and last_elapsed is not None and elapsed < last_elapsed) or (
            origin is not None and last_origin is not None and abs(origin - last_origin) > RESTART_GAP_S
        )
        if restarted or not processes:
            processes.append([])
        processes[-1].append(record)
        last_elapsed = elapsed if elapsed is not None else last_elapsed
        last_origin = origin if origin is not None else last_origin
    return processes


def process_elapsed(records: list[dict[str, Any]]) -> float | None:
    """The last ``elapsed`` of one trainer process's records (None: none carries one)."""
    figures = [value for r in records if (value := number(r.get("elapsed"))) is not None]
    return figures[-1] if figures else None


def trainer_seconds(records: list[dict[str, Any]]) -> float | None:
    """The trainer's time over the whole run: each trainer process's clock up to its last record,
    summed (the last record's ``elapsed`` alone is the last process's, after a resume or restart)."""
    figures = [value for p in trainer_processes(records) if (value := process_elapsed(p)) is not None]
    return sum(figures) if figures else None


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [
        (r["step"], value) for r in records if has_step(r) and (value := number(r.get(key))) is not None
    ]
    return [p[0] for p in points], [p[1] for p in points]


def _series_by(
    records: list[dict[str, Any]], group: str, key: str, *, ordered: bool = False
) -> dict[str, tuple[list[int], list[float]]]:
    """The run's ``key`` per member of each record's ``group`` mapping, by member (``ordered``: the
    members taken in sorted order, so the first record decides the order of the result)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        members = mapping(record.get(group)).items()
        for member, stats in sorted(members) if ordered else members:
            value = number(mapping(stats).get(key))
            if value is not None:
                steps, values = out.setdefault(member, ([], []))
                steps.append(record["step"])
                values.append(value)
    return out


def pool_series(records: list[dict[str, Any]], key: str) -> dict[str, tuple[list[int], list[float]]]:
    return _series_by(records, "pools", key)


def staleness_series(records: list[dict[str, Any]], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """The run's ``key`` per staleness bin (``by_staleness`` of each record), by bin."""
    return _series_by(records, "by_staleness", key, ordered=True)


def pool_shares(records: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Each pool's share of the run's trained samples and of its extreme-ratio tokens, over the
    whole run (the seed's table: a pool can draw 10 % of samples and 29 % of extreme tokens)."""
    samples: dict[str, float] = {}
    extreme: dict[str, float] = {}
    for record in records:
        for pool, raw in mapping(record.get("pools")).items():
            stats = mapping(raw)
            trajectories, tokens = number(stats.get("trajectories")), number(stats.get("tokens"))
            share = number(stats.get("extreme_ratio"))
            samples[pool] = samples.get(pool, 0.0) + (trajectories or 0.0)
            extreme[pool] = extreme.get(pool, 0.0) + (share or 0.0) * (tokens or 0.0)
    total_samples, total_extreme = sum(samples.values()), sum(extreme.values())
    return {
        pool: (
            samples[pool] / total_samples if total_samples else 0.0,
            extreme.get(pool, 0.0) / total_extreme if total_extreme else 0.0,
        )
        for pool in samples
    }


def mismatch_lines(records: list[dict[str, Any]]) -> list[str]:
    """The report's mismatch section: per pool, fresh KL (its precision alone) over the last steps
    and its share of samples against its share of extreme-ratio tokens."""
    shares = pool_shares(records)
    if not shares:
        return []
    late = records[-max(1, min(10, len(records) // 4 or 1)) :]
    lines = [
        "## Mismatch per pool",
        "",
        "Fresh tokens are those sampled with the weights the trainer scored them with (staleness 0): their",
        "KL is the pool's precision and kernels alone. k1 is unbiased whatever the sampling; k3 has lower",
        "variance but reads low without top-p replay. Shares are over the whole run.",
        "",
        "| pool | fresh KL k3 (last steps) | fresh KL k1 | share of samples | share of extreme-ratio tokens |",
        "|---|---|---|---|---|",
    ]
    for pool in sorted(shares):
        figures = []
        for key in ("kl_k3_fresh", "kl_k1_fresh"):
            values = [
                v
                for r in late
                if (v := number(mapping(mapping(r.get("pools")).get(pool)).get(key))) is not None
            ]
            figures.append(f"{sum(values) / len(values):.4g}" if values else "no fresh tokens")
        sample_share, extreme_share = shares[pool]
        lines.append(f"| {pool} | {figures[0]} | {figures[1]} | {sample_share:.1%} | {extreme_share:.1%} |")
    return lines


def summary(records: list[dict[str, Any]], evaluations: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures a closing note or a comparison table needs."""
    out: dict[str, Any] = {"steps": records[-1]["step"] if records else 0}
    if records:
        window = max(1, min(5, len(records) // 4 or 1))
        early, late = records[:window], records[-window:]
        for key in ("reward", "kl_k3", "extreme_ratio", "grad_norm", "entropy", "staleness_mean"):
            e = [v for r in early if (v := number(r.get(key))) is not None]
            lt = [v for r in late if (v := number(r.get(key))) is not None]
            if e and lt:
                out[f"{key}_early"] = sum(e) / len(e)
                out[f"{key}_late"] = sum(lt) / len(lt)
        if out.get("kl_k3_early"):
            out["kl_growth"] = out["kl_k3_late"] / max(out["kl_k3_early"], 1e-12)
        out["tokens_per_s"] = sum(number(r.get("tokens_per_s")) or 0.0 for r in records) / len(records)
        # The trainer's time summed over its processes, not the last one's (which a resume resets).
        out["elapsed_s"] = trainer_seconds(records)
    if evaluations:
        first, last = evaluations[0], evaluations[-1]
        out["eval_first_step"], out["eval_last_step"] = first["step"], last["step"]
        for k in sorted({k for e in evaluations for k in pass_at_k(e)}, key=int):
            rates = [rate for e in evaluations if (rate := pass_at_k(e).get(k)) is not None]
            out[f"pass@{k}_first"], out[f"pass@{k}_last"] = rates[0], rates[-1]
    return out


def run_thresholds(run_dir: Path) -> tuple[CollapseSpec, str]:
    """The run's spec.health.collapse (from the rlrun.yaml ``mixrl run`` copies into the run
    directory) and where it came from; the defaults when that file is missing or no longer valid."""
    path = run_dir / "rlrun.yaml"
    if not path.exists():
        return CollapseSpec(), "the defaults (no rlrun.yaml in the run directory)"
    try:
        return load_rlrun(path).spec.health.collapse, "spec.health.collapse of rlrun.yaml"
    except (InvalidSpec, ManifestUnreadable) as exc:
        return CollapseSpec(), f"the defaults (rlrun.yaml is not a valid RLRun: {exc})"


def write_report(run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = step_records(run_dir / "metrics.jsonl")
    evaluations = step_records(evaluations_file(run_dir))
    plots = run_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)

    def draw(ax: Any, name: str) -> None:
        if name == "reward":
            ax.plot(*series(records, "reward"), label="all pools", color="black")
            for pool, (s, v) in pool_series(records, "reward").items():
                ax.plot(s, v, alpha=0.5, label=pool)
        elif name == "pass_at_k":
            ks = sorted({k for e in evaluations for k in pass_at_k(e)}, key=int)
            for k in ks:
                pts = [(e["step"], pass_at_k(e)[k]) for e in evaluations if k in pass_at_k(e)]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"pass@{k}")
        elif name in ("kl", "extreme_ratio"):
            key = "kl_k3" if name == "kl" else "extreme_ratio"
            for pool, (s, v) in pool_series(records, key).items():
                ax.plot(s, v, label=pool)
        elif name == "staleness":
            ax.plot(*series(records, "staleness_mean"), label="mean")
            ax.plot(*series(records, "staleness_max"), label="max", linestyle="--")
        elif name == "grad_norm":
            ax.plot(*series(records, "grad_norm"))
        elif name == "entropy":
            ax.plot(*series(records, "entropy"))
        elif name == "format_errors":
            ax.plot(*series(records, "format_error_endings"))
        elif name in ("kl_fresh", "kl_fresh_k1"):
            key = "kl_k3_fresh" if name == "kl_fresh" else "kl_k1_fresh"
            for pool, (s, v) in pool_series(records, key).items():
                ax.plot(s, v, label=pool)
        elif name == "kl_by_staleness":
            for lag, (s, v) in staleness_series(records, "kl_k3").items():
                ax.plot(s, v, label=f"staleness {lag}")
        elif name == "extreme_vs_samples":
            shares = pool_shares(records)
            pools = sorted(shares)
            x = range(len(pools))
            ax.bar([i - 0.2 for i in x], [shares[p][0] for p in pools], width=0.4, label="samples")
            ax.bar(
                [i + 0.2 for i in x], [shares[p][1] for p in pools], width=0.4, label="extreme-ratio tokens"
            )
            ax.set_xticks(list(x), pools, fontsize=7)
            ax.set_xlabel("pool")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)

    figure, axes = plt.subplots(3, 4, figsize=(20, 12.5))
    for ax, (name, title, ylabel) in zip(axes.flat, PANELS, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("trainer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        draw(ax, name)
        single, single_ax = plt.subplots(figsize=(6, 4))
        single_ax.set_title(title)
        single_ax.set_xlabel("trainer step")
        single_ax.set_ylabel(ylabel)
        single_ax.grid(alpha=0.3)
        draw(single_ax, name)
        single.tight_layout()
        single.savefig(plots / f"{name}.png", dpi=90)
        plt.close(single)
    figure.suptitle(f"mixrl run: {run_dir.name}")
    figure.tight_layout()
    figure.savefig(run_dir / "report.png", dpi=80)
    plt.close(figure)

    figures = summary(records, evaluations)
    (run_dir / "summary.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        "![report](report.png)",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in figures.items()]
    lines += ["", *mismatch_lines(records)]
    from mixrl.local.routing import routing_lines  # torch and the engine: only when a report is written

    routing = routing_lines(run_dir)
    lines += ["", *routing] if routing else []
    collapse, source = run_thresholds(run_dir)
    lines += ["", *report_lines(assess(records, collapse), collapse, source)]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return run_dir / "report.png"


def fetch_from_buffer(url: str, run_dir: Path, timeout_s: float = 60.0) -> int:
    """A cluster run's telemetry from its buffer (which outlives the finished trainer): the
    trainer's records as ``metrics.jsonl`` and the held-out results as ``evaluations.jsonl``.
    Returns the number of steps fetched; OSError or ValueError name what failed."""
    import urllib.error
    import urllib.request

    def get(path: str) -> bytes:
        try:
            with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout_s) as response:
                return bytes(response.read())
        except urllib.error.URLError as exc:
            raise OSError(f"{url.rstrip('/')}{path}: {exc.reason}") from None

    records = get("/trainer-metrics")
    evaluations = json.loads(get("/evaluations")).get("evaluations")
    if not isinstance(evaluations, list):
        raise ValueError(f"{url}/evaluations: not a buffer's answer")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_bytes(records)
    lines = "".join(json.dumps(e) + "\n" for e in evaluations)
    (run_dir / EVALUATIONS).write_text(lines, encoding="utf-8")
    return len(records.splitlines())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mixrl report", description=plain_text(__doc__))
    parser.add_argument("run_dir", help="a run directory (runs/<name>); with --buffer, where to write")
    parser.add_argument(
        "--buffer",
        default=None,
        metavar="URL",
        help="fetch a cluster run's telemetry from its buffer first, e.g. after"
        " `kubectl port-forward svc/<run>-buffer 8100`: http://127.0.0.1:8100",
    )
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if args.buffer is not None:
        try:
            steps = fetch_from_buffer(args.buffer, run_dir)
        except (OSError, ValueError) as exc:
            print(f"mixrl report: --buffer: {exc}", file=sys.stderr)
            return 2
        print(f"fetched {steps} steps from {args.buffer}")
    if not (run_dir / "metrics.jsonl").exists():
        print(f"mixrl report: {run_dir}: no metrics.jsonl (not a run directory?)", file=sys.stderr)
        return 2
    print(f"wrote {write_report(run_dir)}")
    return 0
