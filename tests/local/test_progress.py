"""`mixrl run`'s progress line, without starting a run: the files it reads are written by hand
where the trainer and the buffer write them during a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixrl.local.run import Progress, buffer_evaluations, evaluations_to_run_dir


def write_jsonl(path: Path, records: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_progress_line_shows_the_pass_at_k_the_buffer_holds_while_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 3, "reward": 0.5}])
    # A resume: runs/<name>/evaluations.jsonl is the previous start's copy, the buffer's file has
    # the evaluations of this start too.
    write_jsonl(tmp_path / "evaluations.jsonl", [{"step": 0, "weight_version": 0, "pass_at_k": {"1": 0.25}}])
    write_jsonl(
        buffer_evaluations(tmp_path),
        [
            {"step": 0, "weight_version": 0, "pass_at_k": {"1": 0.25}},
            {"step": 2, "weight_version": 2, "pass_at_k": {"1": 0.625}},
        ],
    )
    assert buffer_evaluations(tmp_path) == tmp_path / "buffer" / "evaluations.jsonl"  # the buffer's file
    Progress(tmp_path, total_steps=10).update(force=True)
    line = capsys.readouterr().out
    assert "step 3/10" in line
    assert "held-out pass@1 0.625 (step 2)" in line, line


def test_a_fresh_run_shows_pass_at_k_before_the_copy_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "reward": 0.5}])
    write_jsonl(buffer_evaluations(tmp_path), [{"step": 0, "weight_version": 0, "pass_at_k": {"1": 0.375}}])
    Progress(tmp_path, total_steps=None).update(force=True)
    assert "held-out pass@1 0.375 (step 0)" in capsys.readouterr().out
    assert not (tmp_path / "evaluations.jsonl").exists()
    evaluations_to_run_dir(tmp_path)  # what the runner does once the components have stopped
    assert (tmp_path / "evaluations.jsonl").read_text() == buffer_evaluations(tmp_path).read_text()


def test_the_eta_after_a_trainer_restart_is_the_pace_of_the_trainer_now_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Steps 1-2, then a restart: the new trainer's clock starts at zero again, its steps go on from 3.
    write_jsonl(
        tmp_path / "metrics.jsonl",
        [{"step": s, "elapsed": e} for s, e in [(1, 0.2), (2, 0.4), (3, 0.3), (4, 0.8), (5, 1.1)]],
    )
    Progress(tmp_path, total_steps=100).update(force=True)
    # 3 steps in 1.1 s: 95 steps left take 35 s (the run's 5 steps over 1.1 s would say 21 s).
    assert "ETA 35s" in capsys.readouterr().out


def test_a_restart_slower_than_the_steps_before_it_is_found_by_the_records_start_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The new trainer took 5 s to reach its first step: its clock never reads less than the last
    # process's, but its start time (time - elapsed) moved on by about 100 s.
    records = [(1, 0.2, 100.2), (2, 0.4, 100.4), (3, 5.3, 205.3), (4, 5.8, 205.8), (5, 6.1, 206.1)]
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": s, "elapsed": e, "time": t} for s, e, t in records])
    Progress(tmp_path, total_steps=100).update(force=True)
    assert "ETA 193s" in capsys.readouterr().out  # 3 steps in 6.1 s, not 5


def test_records_without_a_clock_take_the_pace_since_the_progress_began(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    write_jsonl(metrics, [{"step": 40}])  # a resumed run: 40 steps before this progress began
    progress = Progress(tmp_path, total_steps=100)
    progress.update(force=True)
    assert "ETA" not in capsys.readouterr().out  # no pace yet
    write_jsonl(metrics, [{"step": 40}, {"step": 50}])
    assert progress.first_seen is not None and progress.first_seen[0] == 40
    progress.first_seen = (40, progress.first_seen[1] - 10.0)  # as if step 40 was seen 10 s ago
    progress.update(force=True)
    line = capsys.readouterr().out
    assert "ETA 50s" in line or "ETA 49s" in line, line  # 10 steps in about 10 s: 50 left
