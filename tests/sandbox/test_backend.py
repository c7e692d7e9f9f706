"""Where a process's sandboxed commands run: the environment asks the process's backend, and the
rollout worker with ``spec.rollout.sandbox`` makes that its warm pool of sandbox pods (refused in
one line where it cannot: no manifest, no pod name, no service account)."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace

import pytest

from mixrl.api.loader import load_rlrun
from mixrl.api.models import SandboxPodsSpec
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.rl.environments.coding.environment import CodingEnvironment
from mixrl.rl.environments.coding.tasks import generate_tasks
from mixrl.rl.rollout import worker as worker_module
from mixrl.rl.rollout.worker import sandbox_pods
from mixrl.rl.sandbox import Limits, Sandbox, SandboxConfig, SandboxResult
from mixrl.rl.sandbox.backend import make_sandbox, use_sandbox
from mixrl.rl.sandbox.kubernetes import PodApiError

ROOT = Path(__file__).resolve().parents[2]


class RecordingSandbox:
    """A stand-in backend that records what it is asked to run and passes every test."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, set[str]]] = []
        self.checked = 0

    def check(self) -> None:
        self.checked += 1

    async def run(
        self, command: str, files: Mapping[str, str | bytes] | None = None, limits: Limits | None = None
    ) -> SandboxResult:
        self.commands.append((command, set(files or {})))
        return SandboxResult(0, "", "", "exited", 0.01)


@pytest.fixture
def backend() -> Iterator[RecordingSandbox]:
    stand_in = RecordingSandbox()
    use_sandbox(lambda config: stand_in)
    try:
        yield stand_in
    finally:
        use_sandbox(None)


async def test_the_coding_environment_runs_its_tests_where_the_process_says(
    backend: RecordingSandbox,
) -> None:
    environment = CodingEnvironment(levels=[1])
    assert environment.sandbox is backend and backend.checked == 1  # checked at start, not first use
    task = generate_tasks("train", 1, 0, (1,))[0]
    await environment.run_tests(task, {path: text.encode() for path, text in task.files.items()})
    ((command, files),) = backend.commands
    assert set(task.hidden_tests) <= files and command  # the hidden tests went to the backend


def test_without_a_backend_it_is_the_local_sandbox() -> None:
    assert isinstance(make_sandbox(SandboxConfig()), Sandbox)


def run_with_sandbox_pods() -> ResolvedRun:
    run = load_rlrun(ROOT / "examples" / "rlrun-coding.yaml")
    run.spec.rollout.sandbox = SandboxPodsSpec()
    return resolve(run)


def test_the_worker_refuses_sandbox_pods_it_cannot_have_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = run_with_sandbox_pods()
    with pytest.raises(
        ValueError, match=r"^spec.rollout.sandbox: cannot read the sandbox pod manifest .*sandbox-pod.json"
    ):
        sandbox_pods(run, tmp_path)
    (tmp_path / "sandbox-pod.json").write_text(json.dumps({"spec": {"containers": []}}))
    monkeypatch.delenv("POD_NAME", raising=False)
    with pytest.raises(ValueError, match=r"^spec\.rollout\.sandbox: POD_NAME is not set"):
        sandbox_pods(run, tmp_path)
    monkeypatch.setenv("POD_NAME", "r-rollout-0")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match=r"^sandbox pods: not in a pod with a service-account token"):
        sandbox_pods(run, tmp_path)


class RecordingPool:
    """A stand-in for the worker's KubernetesSandbox: records whether it was started and closed."""

    def __init__(self, start_fails: bool = False) -> None:
        self.start_fails = start_fails
        self.started = self.closed = False

    async def start(self) -> None:
        self.started = True
        if self.start_fails:  # e.g. deleting an earlier incarnation's pod was refused half-way
            raise PodApiError("DELETE r-rollout-0-sb-old-1: 429 Too Many Requests", status=429)

    async def close(self) -> None:
        self.closed = True


class Idle:
    """Stand-in router client, buffer client and rollout worker: they take anything and do nothing."""

    heldout: tuple[()] = ()

    def __init__(self, *_: object, **__: object) -> None:
        pass

    async def run(self, stopping: asyncio.Event) -> None:
        return None

    async def close(self) -> None:
        return None


async def test_the_worker_never_leaves_its_pool_started_and_unclosed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RouterClient", "BufferClient", "RolloutWorker"):
        monkeypatch.setattr(worker_module, name, Idle)
    settings = SimpleNamespace(
        run="r",
        sampling=None,
        worker_index=0,
        workers=1,
        environment="coding",
        concurrency=1,
        samples_per_prompt=1,
    )
    tokenizer = SimpleNamespace(stop_token_ids=[])
    with socket.socket() as taken:  # the metrics port is in use: serve fails before its try
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        args = argparse.Namespace(
            metrics_port=taken.getsockname()[1], router="r", buffer="b", poll_every=1, progress_every=1
        )
        pool = RecordingPool()
        with pytest.raises(OSError):
            await worker_module.serve(args, settings, None, tokenizer, None, pool)  # type: ignore[arg-type]
        assert not pool.started or pool.closed  # was started, then never closed
    args.metrics_port = None
    pool = RecordingPool(start_fails=True)
    with pytest.raises(PodApiError):
        await worker_module.serve(args, settings, None, tokenizer, None, pool)  # type: ignore[arg-type]
    assert pool.closed  # the pods it had listed are deleted at close
