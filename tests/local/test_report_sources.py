"""What `mixrl report` reads from a run directory whatever state the run left it in: the buffer's
held-out results when the run directory has no (or an older) copy of them, and the trainer's time
summed over its processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mixrl.local.report import (
    EVALUATIONS,
    buffer_evaluations,
    evaluations_file,
    main,
    summary,
    trainer_seconds,
)
from mixrl.rl.buffer import store


def write_jsonl(path: Path, records: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_crashed_runs_report_has_the_pass_at_k_of_the_buffers_log(tmp_path: Path) -> None:
    # A run that crashed (or still runs): no evaluations.jsonl copied into the run directory yet.
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.75}])
    write_jsonl(
        buffer_evaluations(tmp_path),
        [{"step": 0, "pass_at_k": {"1": 0.25}}, {"step": 2, "pass_at_k": {"1": 0.5}}],
    )
    assert main([str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "summary.json").read_text())
    assert figures["pass@1_first"] == 0.25 and figures["pass@1_last"] == 0.5
    assert not (tmp_path / EVALUATIONS).exists()  # read where it is, not copied


def test_the_newer_of_the_copy_and_the_buffers_log_is_read(tmp_path: Path) -> None:
    assert EVALUATIONS == store.EVALUATIONS  # the buffer's name for the file
    copy, log = tmp_path / EVALUATIONS, buffer_evaluations(tmp_path)
    assert evaluations_file(tmp_path) == copy  # neither: the copy's name (read as empty)
    write_jsonl(copy, [{"step": 0}])
    assert evaluations_file(tmp_path) == copy  # a cluster run's (mixrl report --buffer)
    write_jsonl(log, [{"step": 0}, {"step": 5}])
    os.utime(copy, (1_000, 1_000))  # the previous start's copy; this start went on in the buffer
    assert evaluations_file(tmp_path) == log
    os.utime(log, (500, 500))  # the copy made when the components stopped
    assert evaluations_file(tmp_path) == copy


def test_the_trainers_time_is_summed_over_its_processes() -> None:
    records = [{"step": s, "elapsed": e} for s, e in [(1, 0.2), (2, 0.4), (3, 0.3), (4, 0.8), (5, 1.1)]]
    assert trainer_seconds(records) == 0.4 + 1.1
    assert summary(records, [])["elapsed_s"] == 0.4 + 1.1
    assert trainer_seconds([{"step": 1}]) is None and summary([{"step": 1}], [])["elapsed_s"] is None
