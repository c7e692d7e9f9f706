"""A trainer told to stop (SIGTERM: a pod deleted, evicted or preempted; `mixrl run` stopped) ends
the step under way, saves a checkpoint of the last step and exits 0, so the next start redoes no
step. With two ranks, SIGTERM to one of them alone (its pod evicted) stops both after the same step.

Each runs ``mixrl trainer`` as a process (under torchrun for two ranks) against a real buffer, with
``checkpointEvery`` far beyond the run's steps: every checkpoint found is the stop's."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from mixrl.rl.buffer.client import BufferClient
from mixrl.rl.trainer import main as trainer_main
from mixrl.rl.trainer.main import RANKS_MEET_SECONDS, TrainerLoop

from ..servers import buffer_at, rank_pid
from .conftest import synthetic_group
from .test_loop import RUN, small_run, trainer_loop

NEVER = 1000
"""``checkpointEvery``: no checkpoint but the stop's."""


def trainer_command(config: Path, url: str, run_dir: Path, model_dir: Path, ranks: int) -> list[str]:
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return [
        sys.executable, *(torchrun if ranks > 1 else []), "-m", "mixrl.cli", "trainer",
        "--config", str(config), "--buffer", url, "--run-dir", str(run_dir),
        "--model-path", str(model_dir), "--insecure-no-auth",
    ]  # fmt: skip


async def steps_logged(run_dir: Path, process: asyncio.subprocess.Process, at_least: int) -> list[int]:
    """The steps of ``metrics.jsonl`` once it has ``at_least`` of them (the trainer still running)."""
    for _ in range(1200):
        assert process.returncode is None, "the trainer exited before its steps"
        path = run_dir / "metrics.jsonl"
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []
        if len(steps) >= at_least:
            return steps
        await asyncio.sleep(0.1)
    raise AssertionError(f"the trainer took no {at_least} steps in 120 s")


async def sigterm_after(
    command: list[str], run_dir: Path, steps: int, settle: float = 0.0, rank: int | None = None
) -> tuple[int | None, str, float]:
    """Run ``command``; ``settle`` s after its ``steps``-th step, SIGTERM to it (or to that rank of
    it under torchrun). Its exit code, its log and the seconds from the signal to its exit."""
    process = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
    try:
        await steps_logged(run_dir, process, at_least=steps)
        await asyncio.sleep(settle)
        os.kill(process.pid if rank is None else rank_pid(process.pid, local_rank=rank), signal.SIGTERM)
        sent = time.monotonic()
        _, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
        return process.returncode, stderr.decode(), time.monotonic() - sent
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(path.name for path in run_dir.glob("checkpoint*"))


async def test_sigterm_between_steps_saves_the_last_step_and_the_next_start_redoes_none(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module
) -> None:
    run_dir, config = tmp_path / "run", tmp_path / "resolved.json"
    config.write_text(small_run(tmp_path, total_steps=3, checkpoint_every=NEVER).model_dump_json())
    async with buffer_at(tmp_path / "buffer", run=RUN) as url, BufferClient(url) as client:
        for seed, prompt in enumerate("ab"):
            await client.post_trajectories(synthetic_group(model, prompt, 2, pool="bf16", seed=seed, run=RUN))
        command = trainer_command(config, url, run_dir, tiny_model_dir, ranks=1)
        # 1 s after step 2: in its long-poll for step 3's batch, which has no groups yet.
        code, log, seconds = await sigterm_after(command, run_dir, steps=2, settle=1.0)
        assert code == 0, log[-3000:]
        assert seconds < 20, "the stop waited for the 30 s long-poll"
        assert "saving a checkpoint of step 2" in log
        assert "raise trainer.stopGraceSeconds" not in log  # its steps fit in the default grace
        assert checkpoints(run_dir) == ["checkpoint-2"]

        await client.post_trajectories(synthetic_group(model, "c", 2, pool="bf16", seed=2, run=RUN))
        resumed = TrainerLoop(
            small_run(tmp_path, total_steps=3, checkpoint_every=NEVER),
            buffer_url=url,
            router_url=None,
            run_dir=run_dir,
            model_path=str(tiny_model_dir),
        )
        resumed.resume()
        assert resumed.step == 2
        await resumed.train()
        assert (await client.stats())["committed_step"] == 3
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in records] == [1, 2, 3]  # each step trained once


@pytest.mark.parametrize("groups", [40, 2], ids=["mid-run", "idle"])
async def test_sigterm_to_one_rank_of_two_stops_both_after_the_same_step(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module, groups: int
) -> None:
    """Mid-run (batches for more steps than it takes before it stops) or idle (rank 0 waiting for a
    batch, which it does in waits of RANKS_MEET_SECONDS, not the 30 s long-poll)."""
    run_dir, config = tmp_path / "run", tmp_path / "resolved.json"
    config.write_text(small_run(tmp_path, total_steps=NEVER, checkpoint_every=NEVER).model_dump_json())
    async with buffer_at(tmp_path / "buffer", run=RUN) as url, BufferClient(url) as client:
        for seed in range(groups):
            await client.post_trajectories(
                synthetic_group(model, f"p{seed}", 2, pool="bf16", seed=seed, run=RUN)
            )
        command = trainer_command(config, url, run_dir, tiny_model_dir, ranks=2)
        # Rank 1 alone: rank 0 learns of it when the ranks next meet.
        settle = 0.0 if groups > 2 else 1.0
        code, log, seconds = await sigterm_after(command, run_dir, steps=2, settle=settle, rank=1)
        assert code == 0, log[-4000:]
        stats = await client.stats()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = steps[-1]
    assert steps == list(range(1, last + 1))
    # mid-run: it stopped before the batches ran out; idle: after the two it had batches for
    assert last < groups if groups > 2 else last == groups
    assert stats["committed_step"] == last
    assert checkpoints(run_dir) == [f"checkpoint-{last}"]  # every rank's shards, committed
    assert f"saving a checkpoint of step {last}" in log
    assert seconds < 2 * RANKS_MEET_SECONDS + 10, "the ranks did not meet within two of their waits"


async def test_a_step_and_checkpoint_longer_than_a_stop_has_are_warned_of_once(
    tmp_path: Path,
    tiny_model_dir: Path,
    model: torch.nn.Module,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(trainer_main, "ranks_stop_seconds", lambda grace: 0)  # no time at all
    async with buffer_at(tmp_path / "buffer", run=RUN) as url, BufferClient(url) as client:
        for seed, prompt in enumerate("ab"):
            await client.post_trajectories(synthetic_group(model, prompt, 2, pool="bf16", seed=seed, run=RUN))
        with caplog.at_level(logging.WARNING, logger="mixrl.trainer"):
            await trainer_loop(tmp_path, url, tiny_model_dir, total_steps=2).train()  # a checkpoint each
    warnings = [r.getMessage() for r in caplog.records if "raise trainer.stopGraceSeconds" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("step 1 and its checkpoint took"), warnings
