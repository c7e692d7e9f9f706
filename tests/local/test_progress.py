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
