"""Ctrl-C or SIGTERM during `mixrl ablate` stops the study: no queued run starts, the running
`mixrl run` is stopped, and one line names the runs that finished, also when the signal handler's
raise was lost (it ran inside a finalizer).  Each run is stood in for by
a job function (a real child process for the one that is running), not a whole `mixrl run`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mixrl.local import ablation
from mixrl.local.ablation import Job, RunningRuns
from tests.fakes import HandledInAFinalizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("signum", "lost"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["ctrl-c", "sigterm", "ctrl-c-raised-in-a-finalizer"],
)
def test_an_interrupted_study_starts_no_queued_run_and_stops_the_running_one(
    tmp_path: Path,
    signum: int,
    lost: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    started: list[str] = []
    children: list[subprocess.Popen[bytes]] = []

    def run_job(job: Job, run: Any, out: Path, steps: int, *args: Any) -> tuple[Job, float, str]:
        runs: RunningRuns = args[-1]
        started.append(job.name)
        if len(started) == 1:  # the first run finishes
            (out / "runs" / job.name).mkdir(parents=True)
            (out / "runs" / job.name / "summary.json").write_text(json.dumps({"steps": steps}))
            return job, 0.1, "ok"
        process = runs.start([sys.executable, "-c", "import time; time.sleep(120)"])
        assert process is not None
        children.append(process)
        signal.pthread_kill(threading.main_thread().ident or 0, signum)  # while this run goes on
        return job, 1.0, f"failed (exit {process.wait()})"

    monkeypatch.setattr(ablation, "run_job", run_job)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    out = tmp_path / "study"
    argv = [str(ROOT / "examples" / "quickstart.yaml"), "--arms", "grpo,sc", "--fleets", "mixed",
            "--seeds", "2", "--steps", "2", "--out", str(out)]  # fmt: skip
    dropped: list[Any] = []
    if lost:
        monkeypatch.setattr(ablation, "StopSignals", HandledInAFinalizer)
    hook, sys.unraisablehook = sys.unraisablehook, dropped.append
    try:
        began = time.monotonic()
        assert ablation.main(argv) == 130
        took = time.monotonic() - began
    finally:
        sys.unraisablehook = hook
    assert [drop.exc_type for drop in dropped] == ([KeyboardInterrupt] if lost else [])
    assert took < 60  # the running run (2 min of sleep) was stopped, whether the raise was lost or not
    assert started == ["grpo-mixed-s0", "sc-mixed-s0"]  # grpo-mixed-s1 and sc-mixed-s1 never start
    (child,) = children
    assert child.returncode == -signal.SIGTERM  # stopped, not waited for to the end
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (
        "mixrl ablate: stopped; 1 of 4 runs finished (grpo-mixed-s0); run the same command again to "
        "resume the others"
    )
    assert not (out / "ablation.md").exists()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def test_a_stopping_study_starts_no_run(tmp_path: Path) -> None:
    runs = RunningRuns()
    runs.stop()
    assert runs.start([sys.executable, "-c", "raise SystemExit(3)"]) is None
    job = ablation.jobs_of(["grpo"], ["mixed"], 1)[0]
    run = {"metadata": {"name": "x"}, "spec": {"samplerPools": []}}
    assert ablation.run_job(job, run, tmp_path, 2, runs=runs) == (job, 0.0, ablation.NOT_STARTED)
    assert not (tmp_path / "runs").exists()
