"""Telemetry logs (metrics.jsonl, evaluations.jsonl) never stop `mixrl run` or its progress lines:
bad lines are skipped, with one warning each, on a real file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixrl.local.report import read_jsonl, step_records
from mixrl.local.run import Progress, buffer_evaluations


def write_lines(path: Path, lines: list[str], tail: str = "") -> None:
    path.write_text("".join(line + "\n" for line in lines) + tail)


def test_bad_telemetry_lines_are_skipped_with_one_warning_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = [json.dumps({"step": 1, "reward": 0.5}), json.dumps({"step": 2, "reward": 0.75})]
    stepless = [json.dumps({"reward": 1.0}), json.dumps({"step": "3"})]
    path = tmp_path / "metrics.jsonl"
    bad = ["garbage", "[1, 2]", "[" * 100_000]
    write_lines(path, [good[0], *bad, *stepless, good[1]], tail='{"step": 4, "rew')  # still being written
    assert read_jsonl(path) == [json.loads(line) for line in (good[0], *stepless, good[1])]
    warnings = capsys.readouterr().err.splitlines()
    assert warnings == [f"mixrl: {path}: skipping line {n}, not a JSON object" for n in range(2, 5)]
    read_jsonl(path)
    assert capsys.readouterr().err == ""  # once per line, not on every progress tick
    assert step_records(path) == [json.loads(line) for line in good]  # what plots and progress use


def test_progress_lines_survive_odd_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_lines(tmp_path / "metrics.jsonl", [json.dumps({"step": 3, "reward": "high", "elapsed": None})])
    evaluations = buffer_evaluations(tmp_path)  # where the progress line reads them while the run goes on
    evaluations.parent.mkdir()
    write_lines(evaluations, [json.dumps({"step": 2, "pass_at_k": {"1": "most"}})])
    Progress(tmp_path, total_steps=10).update(force=True)
    line = capsys.readouterr().out
    assert "step 3/10" in line and "reward 0.000" in line and "pass@1 0.000 (step 2)" in line
