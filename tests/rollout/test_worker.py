"""The rollout worker against the real router and the real buffer over loopback, and ``mixrl rollout`` as a process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from mixrl.api.loader import parse_document
from mixrl.api.resolve import ResolvedRun, SamplingParams, resolve
from mixrl.api.trajectory import Trajectory
from mixrl.rl.auth import AuthToken, write_token_file
from mixrl.rl.engine.protocol import EngineResponseError, PoolInfo, parse_response
from mixrl.rl.environments.base import Episode, Message, Outcome
from mixrl.rl.environments.filetree import FileTreeEnvironment, FileTreeEpisode, FileTreeTask, generate_tasks
from mixrl.rl.rollout.agent import ScoringFailed
from mixrl.rl.rollout.demos import demonstration_tokens
from mixrl.rl.rollout.router_client import RouterClient
from mixrl.rl.rollout.stats import RolloutStats
from mixrl.rl.rollout.worker import (
    RolloutWorker,
    WorkerSettings,
    main,
    next_evaluation_step,
    room_for_a_group,
)
from mixrl.rl.sandbox.runner import SandboxUnavailable

from ..fakes import FakeEngine
from .conftest import (
    TOKENIZER,
    Engines,
    RunningBuffer,
    RunningRouter,
    StartBuffer,
    StartRouter,
    metrics_text,
    reply_records,
)
from .test_agent import TASK

REPO = Path(__file__).resolve().parents[2]


def resolved_run(**rollout: Any) -> ResolvedRun:
    spec: dict[str, Any] = {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "test"},
        "spec": {
            "model": {"path": "tiny:qwen3", "maxContextTokens": 256},
            "trainer": {"backend": "torch", "gpuType": "cpu", "gpusPerNode": 0, "totalSteps": 2},
            "samplerPools": [
                {"name": "a", "gpuType": "cpu", "engine": "torch", "weightPrecision": "bf16"},
                {"name": "b", "gpuType": "cpu", "engine": "torch", "weightPrecision": "bf16"},
            ],
            "algorithm": {
                "promptsPerUpdate": 2,
                "samplesPerPrompt": 4,
                "maxNewTokens": 16,
                "topP": {"p": 0.95, "k": 8},
            },
            "rollout": {
                "maxTurns": 6,
                "concurrency": 6,
                "dataset": {"trainSize": 64, "heldoutSize": 3},
                **rollout,
            },
            "evaluation": {"everySteps": 1, "passK": [1, 2], "samplesPerTask": 2},
        },
    }
    return resolve(parse_document(spec))  # type: ignore[arg-type]


SETTINGS = WorkerSettings.from_run(resolved_run())


def test_settings_come_from_the_resolved_run() -> None:
    assert (SETTINGS.run, SETTINGS.samples_per_prompt, SETTINGS.concurrency, SETTINGS.total_steps) == (
        "test",
        4,
        6,
        2,
    )
    assert (SETTINGS.eval_every, SETTINGS.eval_tasks, SETTINGS.eval_samples, SETTINGS.pass_k) == (
        1,
        3,
        2,
        (1, 2),
    )
    assert (SETTINGS.max_context_tokens, SETTINGS.max_turns, SETTINGS.format_error_limit) == (256, 6, 3)
    assert SETTINGS.sampling.top_k == 8 and SETTINGS.sampling.return_sampling_mask
    # rollout.environment and rollout.tools: mixrl.api refuses a bad one (tests/api/test_validate_cmd.py)
    with pytest.raises(ValueError, match=r"worker-index: 1 outside 0\.\.0"):
        WorkerSettings.from_run(resolved_run(), worker_index=1)


def test_evaluation_schedule() -> None:
    assert [next_evaluation_step(s, 10, 25) for s in (0, 9, 10, 19, 20, 24, 25, 30)] == [
        10,
        10,
        20,
        20,
        25,
        25,
        None,
        None,
    ]
    assert next_evaluation_step(41, 10, None) == 50


def test_request_body_and_response_parsing() -> None:
    sampling = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=8, max_new_tokens=16, top_logprobs_num=4, return_sampling_mask=True
    )
    body = RouterClient("http://router", sampling, [7, 2]).request_body([1, 2, 3], 5)
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "temperature": 0.9,
            "top_p": 0.95,
            "top_k": 8,
            "min_p": 0.0,
            "ignore_eos": False,
            "max_new_tokens": 5,
            "stop_token_ids": [7, 2],
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 8,  # at least top_k, so the support is among the candidates
        "return_sampling_mask": True,
    }
    payload = {
        "output_ids": [40, 7],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 7},
            "weight_version": "5",
            "output_token_logprobs": [[-0.1, 40, None], [-0.2, 7, None]],
            "output_top_logprobs": [[[-0.1, 40, None], [-2.5, 41, None]], [[-0.2, 7, None], [-1.9, 8, None]]],
            "output_token_sampling_mask": [[40], [7, 8]],
        },
    }
    headers = {"X-Mixrl-Pool": "fp8", "X-Mixrl-Gpu-Type": "H100", "X-Mixrl-Precision": "fp8"}
    result = parse_response(payload, headers, PoolInfo("fallback"))
    assert result.finish_reason == "stop" and result.pool == PoolInfo("fp8", "H100", "fp8")
    assert [(r.token_id, r.logprob, r.support_size, r.weight_version) for r in result.records] == [
        (40, -0.1, 1, 5),
        (7, -0.2, 2, 5),
    ]
    assert parse_response(payload, {}, PoolInfo("direct")).pool == PoolInfo("direct")
    broken = {**payload, "meta_info": {**payload["meta_info"], "finish_reason": {"type": "eaten"}}}
    with pytest.raises(EngineResponseError, match=r"meta_info\.finish_reason: unexpected"):
        parse_response(broken, headers, PoolInfo())


def test_progress_line_shows_rates_reward_and_eta() -> None:
    now = [100.0]
    stats = RolloutStats("test", clock=lambda: now[0])

    ids, mask = demonstration_tokens(TASK, TOKENIZER)
    stats.progress_line(2, 10)
    for reward, reason in [(1.0, "submitted")] * 3 + [(0.0, "format_errors")]:
        trajectory = _trajectory(ids, mask, reward, reason)
        stats.episode_ended(trajectory)
    now[0] = 110.0
    line = stats.progress_line(4, 10)
    assert "4 episodes (0.4/s now" in line and "reward 0.75 (last 4)" in line
    assert "format-error endings 25%" in line and "trainer step 4/10 (ETA 30s)" in line


def _trajectory(ids: list[int], mask: list[int], reward: float, reason: str) -> Trajectory:
    prompt = ids[: mask.index(1)]
    trajectory = Trajectory(prompt_id="p", pool="a", prompt_ids=prompt)
    for token, m in zip(ids[len(prompt) :], mask[len(prompt) :], strict=True):
        if m:
            trajectory.append_generated(reply_records([token], 0, TOKENIZER.vocab_size)[0])
        else:
            trajectory.append_observation([token])
    trajectory.reward, trajectory.finish_reason = reward, reason
    return trajectory


async def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


FILETREE = FileTreeEnvironment()


@asynccontextmanager
async def worker_behind_router(
    engine: FakeEngine, start_router: StartRouter, start_buffer: StartBuffer, **worker: Any
) -> AsyncIterator[tuple[RolloutWorker, RunningBuffer]]:
    """A worker of SETTINGS on the file tree, through a router in front of ``engine`` alone, into a
    buffer of one group of one per step; ``worker``: RolloutWorker's keywords. Its client is closed
    at the end."""
    router = await start_router({"a": [engine]})
    buffer = await start_buffer(prompts_per_update=1, samples_per_prompt=1)
    async with RouterClient(router.url, SETTINGS.sampling, TOKENIZER.stop_token_ids) as client:
        yield RolloutWorker(SETTINGS, FILETREE, TOKENIZER, client, buffer.client, **worker), buffer


@asynccontextmanager
async def running(worker: RolloutWorker, client: RouterClient) -> AsyncIterator[None]:
    """``worker`` running for the block; then stopped (its run awaited) and ``client`` closed."""
    stopping = asyncio.Event()
    task = asyncio.create_task(worker.run(stopping))
    try:
        yield
    finally:
        stopping.set()
        await task
        await client.close()


def polling_worker(
    settings: WorkerSettings,
    client: RouterClient,
    buffer: RunningBuffer,
    progress_s: float = 60,
    say: Callable[[str], None] = lambda _: None,
) -> RolloutWorker:
    """A worker of ``settings`` on the file tree into ``buffer`` that polls every 0.05 s; by default
    it says nothing."""
    return RolloutWorker(
        settings, FILETREE, TOKENIZER, client, buffer.client, poll_s=0.05, progress_s=progress_s, say=say
    )


def rollout_flags(tmp_path: Path, router: RunningRouter, buffer: RunningBuffer) -> tuple[str, ...]:
    """``mixrl rollout``'s --config (resolved_run()), --router, --buffer and --tokenizer (TOKENIZER),
    its files written under ``tmp_path``."""
    config, tokenizer = tmp_path / "resolved.json", tmp_path / "tokenizer.json"
    config.write_text(resolved_run().model_dump_json())
    TOKENIZER.save(tokenizer)
    return (
        "--config",
        str(config),
        "--router",
        router.url,
        "--buffer",
        buffer.url,
        "--tokenizer",
        str(tokenizer),
    )


async def run_rollout(*args: str) -> subprocess.CompletedProcess[str]:
    """``mixrl rollout *args`` run to its end (120 s at most) from the repository root, off the loop."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "mixrl.cli", "rollout", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def task_of(prompt_id: str) -> Any:
    task_id = prompt_id.split("/")[0]
    return next(t for t in generate_tasks(0, 64, "train") if t.id == task_id)


async def test_worker_feeds_the_buffer_and_evaluates(
    engines: Engines, start_router: StartRouter, start_buffer: StartBuffer
) -> None:
    engine_a, engine_b = await engines("a", version=1), await engines("b", version=1)
    router = await start_router({"a": [engine_a], "b": [engine_b]})
    buffer = await start_buffer(prompts_per_update=2, samples_per_prompt=4)
    client = RouterClient(router.url, SETTINGS.sampling, TOKENIZER.stop_token_ids)
    lines: list[str] = []
    worker = polling_worker(SETTINGS, client, buffer, progress_s=0.2, say=lines.append)
    async with running(worker, client):
        batches = []
        for step in (1, 2):  # the test plays the trainer
            batch = await buffer.client.get_batch(step, timeout=20)
            assert batch is not None
            batches.append(batch)
            await buffer.client.commit(step)
            # a trainer faster than the poll would skip an evaluation step; this one waits for it
            await wait_for(
                lambda step=step: (
                    bool(worker.stats.last_evaluation) and worker.stats.last_evaluation["step"] >= step
                )
            )
        await asyncio.wait_for(worker.final_evaluation_posted.wait(), 30)
        assert worker.training_done.is_set()

    evaluations = await buffer.client.evaluations()
    assert [e["step"] for e in evaluations] == [0, 1, 2]
    for evaluation in evaluations:
        assert evaluation["pass_at_k"] == {"1": 1.0, "2": 1.0}  # the stand-in policy is the expert
        assert (evaluation["tasks"], evaluation["episodes"], evaluation["weight_version"]) == (3, 6, 1)

    for batch in batches:
        assert len(batch.groups) == 2
        for group in batch.groups:
            trajectories = group.trajectories
            assert sorted(t.sample_index for t in trajectories) == [0, 1, 2, 3]
            task = task_of(group.prompt_id)
            for trajectory in trajectories:
                assert (trajectory.reward, trajectory.finish_reason, trajectory.run) == (
                    1.0,
                    "submitted",
                    "test",
                )
                assert trajectory.pool in ("a", "b") and trajectory.gpu_type == f"gpu-{trajectory.pool}"
                assert trajectory.precision == f"prec-{trajectory.pool}" and trajectory.split == "train"
                ids, mask = demonstration_tokens(task, TOKENIZER)  # token for token what went over HTTP
                assert trajectory.prompt_ids + trajectory.tokens == ids
                assert [0] * len(trajectory.prompt_ids) + trajectory.loss_mask == mask
                assert set(trajectory.weight_version) <= {1, -1}

    # every session stayed on one pool and was ended
    sessions_a, sessions_b = Counter(engine_a.sessions_seen), Counter(engine_b.sessions_seen)
    assert not set(sessions_a) & set(sessions_b) and None not in sessions_a | sessions_b
    assert router.router.state.sessions == {}
    # a finished episode made three requests (ls, cat, submit); those cut by the stop made fewer
    per_session = (sessions_a + sessions_b).values()
    assert max(per_session) == 3 and sum(1 for c in per_session if c == 3) >= worker.stats.episodes
    assert worker.stats.groups_dropped == 0 and worker.stats.groups_posted >= 4
    assert any("held-out evaluation at step 2" in line for line in lines)
    assert any(line.startswith("rollout: done:") for line in lines)


async def test_a_dying_replica_costs_a_retry_not_an_episode(
    engines: Engines, start_router: StartRouter, start_buffer: StartBuffer
) -> None:
    first, second = await engines("a1"), await engines("a2")
    router = await start_router({"a": [first, second]})
    buffer = await start_buffer(prompts_per_update=100, samples_per_prompt=4)
    # No backlog limit: nothing trains here, so the limit (2 steps of 2 groups) would stop the worker
    # after 4 groups in all, and 4 more after the kill only came while none was posted before it.
    settings = WorkerSettings.from_run(resolved_run(concurrency=8), max_steps_ahead=0)
    client = RouterClient(router.url, settings.sampling, TOKENIZER.stop_token_ids, backoff_s=0.01)
    worker = polling_worker(settings, client, buffer)
    async with running(worker, client):
        await wait_for(lambda: len(first.generate_bodies) >= 10)
        await first.kill()  # turns in flight lose their connection; later ones are refused
        posted = worker.stats.groups_posted
        await wait_for(lambda: worker.stats.groups_posted >= posted + 4)
    assert client.retries > 0
    assert worker.stats.groups_dropped == 0
    assert worker.stats.finish_reasons == Counter({"submitted": worker.stats.episodes})
    # whole groups only (a post cut short by the stop may still have landed)
    received = buffer.buffer.stats()["trajectories"]
    assert received % 4 == 0 and received >= 4 * worker.stats.groups_posted


async def test_sigterm_stops_the_process_cleanly(
    tmp_path: Path, engines: Engines, start_router: StartRouter, start_buffer: StartBuffer
) -> None:
    engine = await engines("a")
    # The run's token on both servers: the process must send it (ending sessions, posting groups).
    token = AuthToken("rollout-test-token-" + "x" * 24)
    write_token_file(tmp_path / "auth-token", token)
    router = await start_router({"a": [engine]}, auth_token=token)
    buffer = await start_buffer(prompts_per_update=100, samples_per_prompt=4, auth_token=token)
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "mixrl.cli", "rollout", *rollout_flags(tmp_path, router, buffer)),
        *("--progress-every", "0.5", "--auth-token-file", str(tmp_path / "auth-token")),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        await wait_for(lambda: buffer.buffer.stats()["trajectories"] >= 8, timeout=60)
        process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), 20)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = output.decode()
    assert process.returncode == 0, text
    assert "held-out evaluation at step 0" in text and "rollout: done:" in text
    assert router.router.state.sessions == {}  # in-flight episodes ended their sessions
    assert "Traceback" not in text
    assert token.reveal() not in text


async def test_a_token_the_buffer_refuses_stops_the_process_with_one_line(
    tmp_path: Path, engines: Engines, start_router: StartRouter, start_buffer: StartBuffer
) -> None:
    engine = await engines("a")
    router = await start_router({"a": [engine]})
    buffer = await start_buffer(
        prompts_per_update=100, samples_per_prompt=4, auth_token=AuthToken("the-runs-own-token-0123456789")
    )
    wrong = AuthToken("not-the-runs-token-0123456789")
    write_token_file(tmp_path / "auth-token", wrong)
    flags = rollout_flags(tmp_path, router, buffer)
    result = await run_rollout(*flags, "--auth-token-file", str(tmp_path / "auth-token"))
    # The step-0 evaluation is the first write; its 401 ends the worker instead of every group failing.
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "mixrl rollout: buffer: POST /evaluations: 401: unauthorized: the bearer token is not this run's"
    )
    assert "Traceback" not in result.stderr and wrong.reveal() not in result.stdout + result.stderr
    assert buffer.buffer.stats()["evaluations"] == 0


def test_without_a_token_it_refuses_to_start_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MIXRL_AUTH_TOKEN", raising=False)
    config = tmp_path / "resolved.json"
    config.write_text(resolved_run().model_dump_json())
    assert main(["--config", str(config), "--router", "http://x", "--buffer", "http://y"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mixrl rollout: no auth token: give --auth-token-file PATH or set MIXRL_AUTH_TOKEN "
        "(--insecure-no-auth runs without one, open to anyone who reaches the port)"
    )


def test_bad_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["--config", str(tmp_path / "none.json"), "--router", "http://x", "--buffer", "http://y"]) == 2
    )
    assert capsys.readouterr().err.strip() == (
        f"mixrl rollout: --config {tmp_path / 'none.json'}: cannot read it (No such file or directory)"
    )
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x"}))
    assert main(["--config", str(tmp_path / "bad.json"), "--router", "http://x", "--buffer", "http://y"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(
            f"mixrl rollout: --config {tmp_path / 'bad.json'}: not a resolved run: namespace: required field is missing"
        )
    )


async def test_metrics_are_exported_per_pool() -> None:
    stats = RolloutStats("test")
    ids, mask = demonstration_tokens(TASK, TOKENIZER)
    stats.episode_ended(_trajectory(ids, mask, 1.0, "submitted"))
    stats.episode_ended(_trajectory(ids, mask, 0.0, "format_errors"))
    text = await metrics_text(stats)
    labels = 'gpu_type="",pool="a",precision="",run="test"'
    assert f'mixrl_rollout_episodes_total{{finish_reason="submitted",{labels}}} 1.0' in text
    assert f"mixrl_rollout_format_error_episodes_total{{{labels}}} 1.0" in text
    assert f"mixrl_rollout_reward{{{labels}}} 0.5" in text
    generated = 2 * sum(mask)
    assert f"mixrl_rollout_tokens_total{{{labels}}} {float(generated)}" in text


async def test_production_pauses_when_the_trainer_falls_behind(
    engines: Engines, start_router: StartRouter, start_buffer: StartBuffer
) -> None:
    router = await start_router({"a": [await engines("a")]})
    buffer = await start_buffer(prompts_per_update=2, samples_per_prompt=4)
    settings = WorkerSettings.from_run(resolved_run(), max_steps_ahead=2)  # at most 2 steps x 2 groups
    client = RouterClient(router.url, settings.sampling, TOKENIZER.stop_token_ids)
    worker = polling_worker(settings, client, buffer)
    async with running(worker, client):
        await wait_for(lambda: worker.stats.groups_posted >= 4)
        await asyncio.sleep(1.0)  # unthrottled, this would be dozens of groups
        assert 4 <= buffer.buffer.stats()["groups_ready"] <= 5
        assert worker.stats.groups_posted <= 5
        batch = await buffer.client.get_batch(1, timeout=5)  # the trainer takes one step's worth
        assert batch is not None and len(batch.groups) == 2
        await wait_for(lambda: buffer.buffer.stats()["groups_ready"] >= 4)
        assert worker.stats.groups_posted <= 7
    with pytest.raises(ValueError, match="max-steps-ahead: must be 0 \\(no limit\\) or positive, got -1"):
        WorkerSettings.from_run(resolved_run(), max_steps_ahead=-1)


def test_several_workers_share_the_steps_ahead() -> None:
    # 2 steps x 8 groups: one worker may hold 15 outstanding; four, 3 each (12 in all, under 16).
    # Before, each of four workers counted only its own and held up to 16: 64 in all.
    assert room_for_a_group(16, 0, 15, 1) and not room_for_a_group(16, 0, 16, 1)
    assert room_for_a_group(16, 0, 3, 4) and not room_for_a_group(16, 0, 4, 4)
    assert not room_for_a_group(16, 13, 1, 4) and room_for_a_group(16, 12, 0, 4)
    assert room_for_a_group(0, 1000, 1000, 4)  # 0: no limit


TRAIN_IDS = [task.id for task in generate_tasks(0, 64, "train")]
SCORING_BUG, NO_SANDBOX, RESET_BUG = set(TRAIN_IDS[0::3]), set(TRAIN_IDS[1::3]), set(TRAIN_IDS[2::6])


class BrittleScoringEpisode(FileTreeEpisode):
    async def finish(self, reason: str) -> Outcome:
        if self.task.id in SCORING_BUG:
            raise KeyError("the scorer's own bug")
        if self.task.id in NO_SANDBOX:
            raise SandboxUnavailable("sandbox pods: none became ready within 120 s (Pending)")
        return await super().finish(reason)


class BrittleScoringEnvironment(FileTreeEnvironment):
    """The file tree, but starting one training task in six raises and scoring two in three raises
    (held-out ones start and score)."""

    async def reset(self, task: FileTreeTask) -> tuple[list[Message], Episode]:
        if task.id in RESET_BUG:
            raise ValueError("the environment's own bug at reset")
        return [Message("user", task.question)], BrittleScoringEpisode(task)


async def test_an_episode_whose_start_or_scoring_raises_is_dropped_and_the_worker_goes_on(
    engines: Engines,
    start_router: StartRouter,
    start_buffer: StartBuffer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Starting or scoring a task that raises ends that episode as a failed one: its group is
    dropped and counted, with an ERROR naming the task for the environment's own bug and a WARNING
    for a sandbox that was not there, and the worker goes on posting the other groups (before, the
    exception left the worker's task group and the process exited with a traceback)."""
    router = await start_router({"a": [await engines("a")]})
    buffer = await start_buffer(prompts_per_update=3, samples_per_prompt=4)
    settings = WorkerSettings.from_run(resolved_run(concurrency=8), max_steps_ahead=0)
    client = RouterClient(router.url, settings.sampling, TOKENIZER.stop_token_ids)
    worker = RolloutWorker(
        settings,
        BrittleScoringEnvironment(),
        TOKENIZER,
        client,
        buffer.client,
        poll_s=0.05,
        say=lambda _: None,
    )
    with caplog.at_level("WARNING", logger="mixrl.rollout"):
        async with running(worker, client):  # its run re-raises whatever ended it
            await wait_for(lambda: worker.stats.groups_dropped >= 8 and worker.stats.groups_posted >= 3)
            batch = await buffer.client.get_batch(1, timeout=10)
    assert batch is not None and len(batch.groups) == 3
    for group in batch.groups:  # only whole groups of tasks that started and scored
        assert group.prompt_id.split("/")[0] not in SCORING_BUG | NO_SANDBOX | RESET_BUG
        assert [t.reward for t in group.trajectories] == [1.0] * 4
    assert worker.stats.last_evaluation is not None  # the held-out step 0 scored as ever
    bugs = [r for r in caplog.records if r.levelname == "ERROR" and "environment failed" in r.getMessage()]
    named = [re.search(r"(scoring|starting) task '([^']+)': (\w+)", r.getMessage()) for r in bugs]
    assert all(match is not None for match in named), [r.getMessage() for r in bugs]
    found = {(m.group(1), m.group(3)) for m in named if m}
    assert found == {("scoring", "KeyError"), ("starting", "ValueError")}
    assert all(m.group(2) in (SCORING_BUG if m.group(1) == "scoring" else RESET_BUG) for m in named if m)
    assert all("BrittleScoringEnvironment: " in r.getMessage() for r in bugs)
    assert len({m.group(2) for m in named if m}) == len(bugs)  # one ERROR per group
    sandbox = [r for r in caplog.records if "SandboxUnavailable" in r.getMessage()]
    assert sandbox and all(r.levelname == "WARNING" for r in sandbox)


class HeldOutScoringBugEnvironment(FileTreeEnvironment):
    """The file tree, but scoring every held-out episode raises (``failure``: what it raises)."""

    def __init__(self, failure: Exception) -> None:
        super().__init__()
        self.failure = failure

    async def reset(self, task: FileTreeTask) -> tuple[list[Message], Episode]:
        messages, episode = await super().reset(task)
        if task.split == "heldout":
            episode.finish = self._raise  # type: ignore[method-assign]
        return messages, episode

    async def _raise(self, reason: str) -> Outcome:
        raise self.failure


async def test_a_held_out_episode_the_environment_keeps_failing_counts_as_failed(
    engines: Engines, start_router: StartRouter, start_buffer: StartBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    """Held-out episodes are played again rather than dropped (pass@k without them would be biased);
    when the environment's own bug fails every try, the episode counts as failed (reward 0, finish
    reason environment_error) and the worker goes on: two ERROR lines for the retries, one for the
    count, each naming the task (before, the third try ended the run, and every restart met it again)."""
    router = await start_router({"a": [await engines("a")]})
    buffer = await start_buffer(prompts_per_update=2, samples_per_prompt=4)
    settings = WorkerSettings.from_run(
        resolved_run(concurrency=1, dataset={"trainSize": 64, "heldoutSize": 1})
    )
    client = RouterClient(router.url, settings.sampling, TOKENIZER.stop_token_ids)
    environment = HeldOutScoringBugEnvironment(KeyError("the scorer's own bug"))
    worker = RolloutWorker(
        settings, environment, TOKENIZER, client, buffer.client, poll_s=0.05, say=lambda _: None
    )
    with caplog.at_level("WARNING", logger="mixrl.rollout"):
        async with running(worker, client):
            await wait_for(
                lambda: worker.stats.last_evaluation is not None and worker.stats.groups_posted >= 1
            )
    [evaluation] = await buffer.client.evaluations()
    episodes = settings.eval_samples
    assert evaluation["finish_reasons"] == {"environment_error": episodes}
    assert evaluation["pass_at_k"]["1"] == 0.0 and evaluation["mean_reward"] == 0.0
    retried = [r for r in caplog.records if "playing it again" in r.getMessage()]
    counted = [r for r in caplog.records if "counted as failed" in r.getMessage()]
    assert [r.levelname for r in retried] == ["ERROR"] * (2 * episodes)
    assert [r.levelname for r in counted] == ["ERROR"] * episodes
    assert all("scoring task 'ft-" in r.getMessage() and "KeyError" in r.getMessage() for r in counted)


async def test_a_held_out_episode_without_a_sandbox_on_every_try_stops_the_worker(
    engines: Engines, start_router: StartRouter, start_buffer: StartBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure that is not the environment's bug (here no sandbox; likewise the engine or the
    router) is the infrastructure's: WARNING lines for the retries, then the third try's failure
    ends the run, which ``mixrl rollout`` turns into one line and exit 1, and a restart evaluates
    again."""
    router = await start_router({"a": [await engines("a")]})
    buffer = await start_buffer(prompts_per_update=2, samples_per_prompt=4)
    settings = WorkerSettings.from_run(
        resolved_run(concurrency=1, dataset={"trainSize": 64, "heldoutSize": 1})
    )
    environment = HeldOutScoringBugEnvironment(SandboxUnavailable("sandbox pods: none became ready"))
    async with RouterClient(router.url, settings.sampling, TOKENIZER.stop_token_ids) as client:
        worker = RolloutWorker(settings, environment, TOKENIZER, client, buffer.client, say=lambda _: None)
        with caplog.at_level("WARNING", logger="mixrl.rollout"), pytest.raises(ExceptionGroup) as stopped:
            await worker.run(asyncio.Event())
    assert stopped.group_contains(ScoringFailed, match="scoring task '.*': SandboxUnavailable", depth=None)
    retried = [r for r in caplog.records if "playing it again" in r.getMessage()]
    assert [r.levelname for r in retried] == ["WARNING", "WARNING"]
    assert await buffer.client.evaluations() == []


def test_mixrl_rollout_says_a_held_out_failure_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from mixrl.rl.rollout import worker as worker_module

    failure = ScoringFailed("FileTreeEnvironment: scoring task 'ft-1': KeyError: 'x'", "ft-1")

    async def serve(*_: object) -> None:
        raise ExceptionGroup("task group", [ExceptionGroup("evaluate", [failure])])

    loaded = argparse.Namespace(
        settings=None, environment=None, tokenizer=None, auth_token=None, sandbox_pods=None
    )
    monkeypatch.setattr(worker_module, "start", lambda *_: (argparse.Namespace(), loaded))
    monkeypatch.setattr(worker_module, "serve", serve)
    assert main([]) == 1
    assert capsys.readouterr().err == f"mixrl rollout: held-out evaluation: {failure}\n"
