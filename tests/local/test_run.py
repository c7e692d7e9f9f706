from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mixrl.local.report import read_jsonl
from mixrl.rl.tiny_models import create_tiny_checkpoint

from ..servers import rank_pid
from .conftest import small_run

pytestmark = pytest.mark.slow


def mixrl_run(spec: Path, run_dir: Path, cache: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mixrl.cli",
        "run",
        str(spec),
        "--run-dir",
        str(run_dir),
        "--cache-dir",
        str(cache),
    ]


def buffer_log(run_dir: Path) -> tuple[list[dict], list[dict]]:
    trajectories = read_jsonl(run_dir / "buffer" / "trajectories.jsonl")
    assignments = read_jsonl(run_dir / "buffer" / "assignments.jsonl")
    return trajectories, assignments


def test_short_run_trains_with_engines_reloading(tmp_path: Path, model_cache: Path) -> None:
    spec = small_run(tmp_path, "itest", steps=4)
    run_dir = tmp_path / "run"
    result = subprocess.run(
        mixrl_run(spec, run_dir, model_cache), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert set().union(*(r["pools"] for r in records)) == {"nvfp4", "bf16"}
    for record in records:
        assert 0.0 <= record["reward"] <= 1.0 and record["grad_norm"] >= 0.0
        assert 0.0 <= record["extreme_ratio"] <= 1.0 and record["kl_k3"] >= 0.0
    # (a step whose groups all tie has zero advantages and no gradient; not all of them do)
    assert any(record["grad_norm"] > 0 for record in records)

    # The engines reloaded while sessions went on: later trajectories carry tokens of newer versions.
    trajectories, _ = buffer_log(run_dir)
    versions = {
        v for t in trajectories for v, m in zip(t["weight_version"], t["loss_mask"], strict=True) if m
    }
    assert max(versions) >= 1, versions
    assert {t["pool"] for t in trajectories} == {"nvfp4", "bf16"}
    assert {t["precision"] for t in trajectories} == {"nvfp4", "bf16"}

    evaluations = read_jsonl(run_dir / "evaluations.jsonl")
    assert evaluations[0]["step"] == 0 and evaluations[-1]["step"] == 4
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    store = sorted(p.name for p in (run_dir / "weights").iterdir() if p.name.startswith("v"))
    assert store[-1] == "v00000004"

    # Every component ran with this start's token (the engines reloaded and the buffer took
    # trajectories, both authenticated); it is in a file only its owner reads, and in no log.
    token_file = run_dir / "auth-token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 40
    for log in (run_dir / "logs").glob("*.log"):
        text = log.read_text()
        assert token not in text, log.name
        assert "authentication is off" not in text and "refused " not in text, log.name
    assert token not in result.stdout + result.stderr


def test_a_two_process_trainer_trains_through_torchrun(tmp_path: Path, model_cache: Path) -> None:
    # Without score centering a correct answer's advantage is its reward, so a step with one has a
    # gradient; with it, a step whose groups each agree has none (the tiny model often samples a
    # group four times alike: all three steps of one CI run had none).
    corrections = {"mis": [0.2, 5.0], "scoreCentering": False}
    spec = small_run(tmp_path, "ranks", steps=3, corrections=corrections)
    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["trainer"]["gpusPerNode"] = 2  # on gpuType cpu: two trainer processes
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = tmp_path / "run"
    result = subprocess.run(
        mixrl_run(spec, run_dir, model_cache), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "rank 0 of 2" in log and "rank 1 of 2" in log
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]  # rank 0 alone logs, each step once
    assert any(r["grad_norm"] > 0 for r in records)
    store = sorted(p.name for p in (run_dir / "weights").iterdir() if p.name.startswith("v"))
    assert store[-1] == "v00000003"


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "a-dead-rank-of-two"])
def test_killed_trainer_resumes_and_loses_no_trajectory(
    tmp_path: Path, model_cache: Path, ranks: int
) -> None:
    """SIGKILL of the trainer, or of one rank of two (torchrun then stops the other and exits, and
    the run restarts the group): the run resumes from the checkpoint and loses nothing."""
    spec = small_run(tmp_path, "killtest", steps=6)
    if ranks > 1:
        doc = yaml.safe_load(spec.read_text())
        doc["spec"]["trainer"]["gpusPerNode"] = ranks  # on gpuType cpu: that many trainer processes
        spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        mixrl_run(spec, run_dir, model_cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 600
        while len(read_jsonl(run_dir / "metrics.jsonl")) < 2:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.2)
        trainer_pid = int((run_dir / "logs" / "trainer.pid").read_text())
        victim = trainer_pid if ranks == 1 else rank_pid(trainer_pid, local_rank=1)
        os.kill(victim, signal.SIGKILL)  # no chance to save or commit anything
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, output[-4000:]
    assert "restarting it (1/3) from its last checkpoint" in output
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()

    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6]  # a step cut short is redone, none is skipped

    # No trajectory lost: each step was given exactly one batch (the same one again after the
    # crash), every batch's trajectories were received and logged, and none served twice.
    trajectories, assignments = buffer_log(run_dir)
    batches = [a for a in assignments if a["kind"] == "batch"]
    assert sorted(b["step"] for b in batches) == list(range(1, len(batches) + 1))
    served = [seq for b in batches for group in b["groups"] for seq in group]
    assert len(served) == len(set(served)) and max(served) < len(trajectories)
    committed = {a["step"] for a in assignments if a["kind"] == "commit"}
    assert set(range(1, 7)) <= committed


def test_a_component_that_cannot_start_is_named_in_one_line(tmp_path: Path) -> None:
    """The buffer refuses a damaged log; `mixrl run` says so in one line and stops the others."""
    spec = small_run(tmp_path, "badstart", steps=1)
    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["model"]["path"] = create_tiny_checkpoint(
        tmp_path / "model", "qwen3", seed=0
    )  # no warm start
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = tmp_path / "run"
    log = run_dir / "buffer" / "assignments.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text('{"kind": "commit", "step": "x"}\n{"kind": "commit", "step": 1}\n')
    result = subprocess.run(
        mixrl_run(spec, run_dir, tmp_path / "cache"), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"mixrl run: buffer failed to start (exited with code 2): mixrl buffer: --dir: log {log} is damaged "
        f"at line 1: step: expected a non-negative integer, got 'x' (log: {run_dir / 'logs' / 'buffer.log'})"
    ], result.stderr
    for pid_file in (run_dir / "logs").glob("*.pid"):  # every component that did start was stopped
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)
