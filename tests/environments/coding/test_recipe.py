"""examples/rlrun-coding.yaml end to end with ``mixrl run``: every component a real local process,
the coding environment's episodes in real bubblewrap sandboxes, the tiny model from random weights
(its reward is expected to be about zero; the machinery is what is tested)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mixrl.local.report import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.needs_bwrap]
ROOT = Path(__file__).resolve().parents[3]
FINISH_REASONS = {"submitted", "max_turns", "context_limit", "format_errors"}


def test_the_coding_recipe_runs_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "run", str(ROOT / "examples" / "rlrun-coding.yaml"),
         "--run-dir", str(run_dir), "--steps", "2", "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    rollout_log = (run_dir / "logs" / "rollout.log").read_text()
    assert "environment coding-plain" in rollout_log
    trajectories = read_jsonl(run_dir / "buffer" / "trajectories.jsonl")
    assert len(trajectories) >= 2 * 4 * 4  # two steps of promptsPerUpdate x samplesPerPrompt
    assert {t["finish_reason"] for t in trajectories} <= FINISH_REASONS
    assert all(0.0 <= t["reward"] <= 1.0 for t in trajectories)
    assert {t["prompt_id"].split("-")[0] for t in trajectories} <= {
        "affine",
        "clamp",
        "multiple",
    }  # levels: [1]
    assert [e["step"] for e in read_jsonl(run_dir / "evaluations.jsonl")] == [0, 2]
