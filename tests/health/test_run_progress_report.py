"""`mixrl run`'s progress line and `mixrl report`'s report.md on a recorded metrics.jsonl (no training).

The run directory is laid out as `mixrl run` leaves it (metrics.jsonl from the trainer, rlrun.yaml
copied from the user's file); the code under test is the real Progress and write_report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.models import CollapseSpec
from mixrl.local.report import main as report_main
from mixrl.local.report import run_thresholds
from mixrl.local.run import Progress

from .streams import recorded, with_changes

ROOT = Path(__file__).resolve().parents[2]


def run_dir_with(tmp_path: Path, records: list[dict[str, Any]], health: dict[str, Any] | None = None) -> Path:
    run_dir = tmp_path / "quickstart"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    if health is not None:
        doc["spec"]["health"] = health
    (run_dir / "rlrun.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return run_dir


def progress_lines(
    run_dir: Path, records: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> list[str]:
    """The lines `mixrl run` prints as the trainer appends each record."""
    progress = Progress(run_dir, 100, CollapseSpec())
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("")
    for record in records:
        with metrics.open("a") as out:
            out.write(json.dumps(record) + "\n")
        progress.update()
    return capsys.readouterr().out.splitlines()


def kl_collapse_in_mxfp4(record: dict[str, Any]) -> None:
    record["pools"]["mxfp4"]["kl_k3"] *= 40.0


def test_a_healthy_recorded_run_shows_no_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = recorded()
    run_dir = run_dir_with(tmp_path, records)
    lines = progress_lines(run_dir, records, capsys)
    assert len(lines) == 100 and "step 100/100" in lines[-1]
    assert not [line for line in lines if "WARNING" in line or "warning" in line]

    assert report_main([str(run_dir)]) == 0
    report = (run_dir / "report.md").read_text()
    assert "## Run health" in report and "No sign of collapse." in report
    assert "RAISED" not in report
    assert "kl_growing [ok] KL (k3) of pool mxfp4" in report


def test_an_injected_kl_collapse_warns_on_the_progress_line_and_in_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = with_changes(recorded(), 60, kl_collapse_in_mxfp4)
    run_dir = run_dir_with(tmp_path, records)
    lines = progress_lines(run_dir, records, capsys)
    progress = [line for line in lines if line.startswith("[")]
    first = next(i for i, line in enumerate(progress) if "WARNING collapse risk" in line)
    assert "step 62/100" in progress[first]  # within one window (5 steps) of step 60
    assert "kl_growing(mxfp4" in progress[first]
    assert all("WARNING collapse risk" in line for line in progress[first:])
    details = [line for line in lines if line.startswith("mixrl run: warning:")]
    assert len(details) == 1 and "pool mxfp4" in details[0] and ">=" in details[0]

    assert report_main([str(run_dir)]) == 0
    report = (run_dir / "report.md").read_text()
    (raised,) = [line for line in report.splitlines() if "**RAISED**" in line]
    assert "kl_growing" in raised and "pool mxfp4" in raised and "judged at step 100" in raised
    assert "No sign of collapse." not in report


def test_the_report_judges_by_the_runs_own_thresholds(tmp_path: Path) -> None:
    records = with_changes(recorded(), 60, kl_collapse_in_mxfp4)
    run_dir = run_dir_with(tmp_path, records, {"collapse": {"klGrowth": 100.0}})
    assert run_thresholds(run_dir)[0].kl_growth == 100.0
    assert report_main([str(run_dir)]) == 0
    report = (run_dir / "report.md").read_text()
    assert "RAISED" not in report and "KL ≥ 100×" in report


def test_an_unreadable_rlrun_falls_back_to_the_defaults_and_says_so(tmp_path: Path) -> None:
    run_dir = run_dir_with(tmp_path, recorded()[:20], {"collapse": {"klGrowth": 0.5}})
    thresholds, source = run_thresholds(run_dir)
    assert thresholds == CollapseSpec()
    assert "defaults" in source and "klGrowth" in source and "\n" not in source
