"""``mixrl buffer`` as a real process: SIGKILL mid-run, restart on the same directory, nothing lost."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp

from mixrl.rl.buffer.client import BufferClient

from ..servers import cli_server, free_port, run_cli, write_example_config
from .conftest import group_of, write_run_config


def buffer_flags(directory: Path) -> tuple[str, ...]:
    """``mixrl buffer``'s flags over ``directory``: 2 groups of 2 per step, no token checked."""
    config = write_run_config(directory.parent / "run.json", prompts=2, samples=2)
    return ("--dir", str(directory), "--config", str(config), "--insecure-no-auth")


async def test_sigkill_and_restart_lose_nothing_and_repeat_batches(tmp_path: Path) -> None:
    directory, port_file = tmp_path / "buf", tmp_path / "port"
    async with cli_server("buffer", port_file, *buffer_flags(directory)) as (process, url):
        async with BufferClient(url) as client:
            for prompt in ("a", "b", "c"):
                await client.post_trajectories(group_of(prompt, 2))
            await client.post_trajectories(group_of("d", 1))
            step1 = await client.get_batch(1, timeout=0)
            assert [g.prompt_id for g in step1.groups] == ["a", "b"]
        process.send_signal(signal.SIGKILL)  # no chance to flush anything more
        await process.wait()
    async with cli_server("buffer", port_file, *buffer_flags(directory)) as (process, url):
        async with BufferClient(url) as client:
            assert await client.get_batch(1, timeout=0) == step1  # the trainer asks again after its crash
            stats = await client.stats()
            assert (stats["trajectories"], stats["groups_ready"], stats["groups_partial"]) == (7, 1, 1)
            await client.post_trajectories(group_of("d", 2)[1:])
            await client.commit(1)
            step2 = await client.get_batch(2, timeout=0)
            assert [g.prompt_id for g in step2.groups] == ["c", "d"]
            await client.commit(2)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0


def test_bad_arguments_give_one_line(tmp_path: Path) -> None:
    config = write_run_config(tmp_path / "run.json", prompts=1, samples=2)

    def run(*args: str, env: dict[str, str] | None = None) -> str:
        result = run_cli("buffer", *args, env=env)
        assert result.returncode == 2
        return result.stderr.strip()

    env = {k: v for k, v in os.environ.items() if k != "MIXRL_BUFFER_DIR"}
    assert run("--config", str(config), env=env) == "mixrl buffer: --dir: required (or set MIXRL_BUFFER_DIR)"
    missing = tmp_path / "missing.json"
    assert run("--dir", str(tmp_path), "--config", str(missing)) == (
        f"mixrl buffer: --config {missing}: cannot read it (No such file or directory)"
    )
    (tmp_path / "sizes.json").write_text('{"name": "r"}')
    assert run("--dir", str(tmp_path), "--config", str(tmp_path / "sizes.json")).startswith(
        f"mixrl buffer: --config {tmp_path / 'sizes.json'}: not a resolved run: namespace: required field is missing"
    )
    assert run("--dir", str(tmp_path), "--config", str(config), "--port", "70000") == (
        "mixrl buffer: --port: 70000 is not a TCP port"
    )


def test_a_damaged_log_stops_the_start_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "assignments.jsonl").write_text(
        '{"kind": "commit", "step": "x"}\n{"kind": "commit", "step": 1}\n'
    )
    config = write_run_config(tmp_path / "run.json", prompts=1, samples=2)
    result = run_cli("buffer", "--dir", str(tmp_path), "--config", str(config), "--insecure-no-auth")
    assert (result.returncode, result.stderr.strip()) == (
        2,
        f"mixrl buffer: --dir: log {tmp_path / 'assignments.jsonl'} is damaged at line 1: "
        "step: expected a non-negative integer, got 'x'",
    )


async def test_the_config_supplies_the_run_and_its_sizes(tmp_path: Path) -> None:
    config, metrics_port = tmp_path / "run.json", free_port()
    resolved = write_example_config(config)
    flags = ("--config", str(config), "--metrics-port", str(metrics_port), "--insecure-no-auth")
    env = {**os.environ, "MIXRL_BUFFER_DIR": str(tmp_path / "buf")}
    async with cli_server("buffer", tmp_path / "port", *flags, env=env) as (_, url):
        async with BufferClient(url) as client:
            stats = await client.stats()
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{metrics_port}/metrics") as response,
        ):
            assert 'mixrl_buffer_groups_ready{run="qwen3-moe-coding"} 0.0' in await response.text()
        assert (tmp_path / "buf" / "trajectories.jsonl").exists()  # the directory came from MIXRL_BUFFER_DIR
        trainer = resolved.trainer
        assert (stats["prompts_per_update"], stats["samples_per_prompt"], stats["max_staleness"]) == (
            trainer.prompts_per_update,
            trainer.samples_per_prompt,
            trainer.max_staleness,
        )
