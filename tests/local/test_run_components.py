"""`mixrl run`'s processes without running them: which ones the supervisor builds (rollout workers,
engines), how it supervises the rollout workers, and what it refuses before starting anything.
The whole run: tests/local/test_run.py."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.local.processes import Process
from mixrl.local.run import Supervisor, main
from mixrl.operator.builders.resources import seed_replicas

ROOT = Path(__file__).resolve().parents[2]


def quickstart(**rollout: object) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["rollout"].update(rollout)
    return doc


def resolved_of(doc: dict) -> ResolvedRun:
    run = parse_document(doc)
    assert isinstance(run, RLRun)
    return resolve(run)


def supervisor(tmp_path: Path, run: ResolvedRun) -> Supervisor:
    """A supervisor whose servers are known (as after they started), none of its processes started."""
    built = Supervisor(run, tmp_path, "/model", "/tokenizer.json")
    built.where = replace(
        built.where, buffer_url="http://127.0.0.1:1", router_url="http://127.0.0.1:2", engine_model_path="/v0"
    )
    return built


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_rollout_workers_start_one_process_per_worker_with_its_own_index(tmp_path: Path) -> None:
    """rollout.workers: 4 starts four workers, 0..3: each takes only its index's shard of the
    training split, so one worker alone would train on a quarter of it."""
    built = supervisor(tmp_path, resolved_of(quickstart(workers=4)))
    workers = built.rollout_workers()
    assert [w.name for w in workers] == ["rollout-0", "rollout-1", "rollout-2", "rollout-3"]
    assert [flag(w.command, "--worker-index") for w in workers] == ["0", "1", "2", "3"]
    assert [w.log_path for w in workers] == [tmp_path / "logs" / f"rollout-{i}.log" for i in range(4)]
    assert built.rollouts == workers and all(w in built.components for w in workers)


def test_a_single_rollout_worker_keeps_its_name_log_and_index(tmp_path: Path) -> None:
    built = supervisor(tmp_path, resolved_of(quickstart()))
    (worker,) = built.rollout_workers()
    assert worker.name == "rollout" and worker.log_path == tmp_path / "logs" / "rollout.log"
    assert flag(worker.command, "--worker-index") == "0"


def exits(process: Process, code: int) -> Process:
    """``process`` with its command replaced by one that exits with ``code`` at once."""
    process.command = [sys.executable, "-c", f"raise SystemExit({code})"]
    return process


def test_every_rollout_worker_is_supervised_and_stopped(tmp_path: Path) -> None:
    built = supervisor(tmp_path, resolved_of(quickstart(workers=3)))
    built.trainer = exits(built._component("trainer"), 0)
    workers = built.rollout_workers()
    for process in (built.trainer, *workers):
        exits(process, 0).start()
    for process in (built.trainer, *workers):
        assert process.process is not None and process.process.wait(timeout=60) == 0
    assert built.failed_component() is None  # workers may end on their own after the last step

    exits(workers[2], 3).start()
    assert workers[2].process is not None and workers[2].process.wait(timeout=60) == 3
    failed = built.failed_component()
    assert failed is workers[2] and failed.name == "rollout-2"
    built.stop()  # every worker among the processes it stops (all have exited here)


@pytest.mark.parametrize(("minimum", "maximum"), [(0, 4), (2, 8), (0, 0), (3, 3)])
def test_local_engines_are_the_operators_seed(tmp_path: Path, minimum: int, maximum: int) -> None:
    """A pool starts with minReplicas engines, at least 1, never above maxReplicas: the number the
    operator seeds a new SamplerPool with."""
    doc = quickstart()
    doc["spec"]["samplerPools"][0].update(minReplicas=minimum, maxReplicas=maximum)
    run = resolved_of(doc)
    engines = supervisor(tmp_path, run).pool_engines()
    expected = min(max(minimum, 1), maximum)
    assert len(engines[run.pools[0].name]) == expected == seed_replicas(run.pools[0])
    assert [len(engines[pool.name]) for pool in run.pools[1:]] == [1] * (len(run.pools) - 1)


def refused(tmp_path: Path, doc: dict, capsys: pytest.CaptureFixture[str]) -> list[str]:
    spec = tmp_path / "run.yaml"
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert main([str(spec), "--run-dir", str(tmp_path / "run")]) == 1
    assert not (tmp_path / "run").exists()  # refused before anything was written
    return capsys.readouterr().err.splitlines()


def test_sandbox_pods_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = quickstart(sandbox={"poolSize": 2})
    (line,) = refused(tmp_path, doc, capsys)
    assert line.startswith("mixrl run: spec.rollout.sandbox: sandbox pods exist only in a cluster")
    assert "bubblewrap" in line


def test_pools_that_start_no_engine_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = quickstart()
    for pool in doc["spec"]["samplerPools"]:
        pool.update(minReplicas=0, maxReplicas=0)
    (line,) = refused(tmp_path, doc, capsys)
    assert line.startswith("mixrl run: spec.samplerPools: every pool has maxReplicas 0")
