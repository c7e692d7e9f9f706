"""The BF16 evaluator (``evaluation.sampler: bf16``) in a real ``mixrl run``: exactly the version
each evaluation names, the full vocabulary, nothing lost when the evaluator is killed, and its
versions kept by the trainer until they are evaluated even with ``weights.keepVersions: 1``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from mixrl.local.report import read_jsonl

from .conftest import small_run
from .test_run import mixrl_run

pytestmark = pytest.mark.slow


def test_the_bf16_evaluator_survives_a_kill_and_evaluates_each_named_version(
    tmp_path: Path, model_cache: Path
) -> None:
    spec = small_run(tmp_path, "evaltest", steps=6)
    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["evaluation"] = {
        "everySteps": 2,
        "sampler": "bf16",
        "passK": [1, 2],
        "samplesPerTask": 2,
        "tasks": 16,
    }
    # Without the trainer's protection v2 and v4 would go.  A snapshot per version: with deltas every
    # version's chain back to its snapshot is kept as well (weights.snapshotEvery), which this is not about.
    doc["spec"]["weights"] = {"keepVersions": 1, "snapshotEvery": 1}
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        mixrl_run(spec, run_dir, model_cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    evaluations_log = run_dir / "buffer" / "evaluations.jsonl"
    try:
        deadline = time.monotonic() + 600
        while not (evaluations_log.exists() and read_jsonl(evaluations_log)):
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            assert time.monotonic() < deadline, "no evaluation arrived"
            time.sleep(0.2)
        os.kill(int((run_dir / "logs" / "evaluator.pid").read_text()), signal.SIGKILL)
        output, _ = process.communicate(timeout=900)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, output[-4000:]
    assert "evaluator exited with code -9; restarting it (1/3)" in output

    evaluations = read_jsonl(run_dir / "evaluations.jsonl")
    # Each evaluation step once (the killed evaluator's successor went on, none redone or lost),
    # all by the BF16 evaluator (the rollout worker evaluated nothing), each at exactly its version.
    assert [e["step"] for e in evaluations] == [0, 2, 4, 6]
    assert all(e["protocol"] == "bf16" for e in evaluations)
    assert all(e["weight_version"] == e["step"] for e in evaluations)
    assert all(e["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1} for e in evaluations)
    assert all(e["episodes"] == 16 * 2 and set(e["pass_at_k"]) == {"1", "2"} for e in evaluations)
    evaluator_log = (run_dir / "logs" / "evaluator.log").read_text()
    assert "not evaluated" not in evaluator_log
    # The protection held only what was still to be evaluated: the trainer pruned the rest.
    assert len([p for p in (run_dir / "weights").iterdir() if p.name.startswith("v")]) < 7
