"""The buffer keeps the trainer's per-step records durably, so a cluster run's telemetry outlives
its finished trainer, and ``mixrl report --buffer URL`` builds the report from them (real buffer
server on loopback, real ``mixrl report`` process)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp

from mixrl.rl.buffer.client import BufferClient

from ..servers import buffer_at


def record(step: int, reward: float) -> dict:
    return {"step": step, "reward": reward, "kl_k3": 0.01, "pools": {"bf16": {"kl_k3": 0.01, "tokens": 10}}}


async def test_records_survive_a_restart_a_redone_step_wins_and_the_report_is_built(tmp_path: Path) -> None:
    directory = tmp_path / "buffer"
    async with buffer_at(directory) as url, BufferClient(url) as trainer:
        for step, reward in ((1, 0.1), (2, 0.2), (3, 0.3)):
            await trainer.post_trainer_record(record(step, reward))
        await trainer.post_trainer_record(record(3, 0.35))  # step 3 redone after a crash
        await trainer.post_evaluation(3, 3, {1: 0.5})
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{url}/trainer-metrics", json={"step": 0}) as refused,
        ):
            assert refused.status == 400
            assert (await refused.json())["error"] == (
                "record: a trainer record is a JSON object with an integer step >= 1"
            )
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{url}/trainer-metrics", data=b'{"step": 4,') as not_json,
        ):
            assert not_json.status == 400  # the same line as every other route's (docs/buffer.md)
            assert (await not_json.json())["error"].startswith("body: not JSON (")
    async with buffer_at(directory) as url:  # a new buffer process on the same logs
        async with aiohttp.ClientSession() as http, http.get(f"{url}/trainer-metrics") as response:
            lines = (await response.text()).splitlines()
        assert [json.loads(line)["reward"] for line in lines] == [0.1, 0.2, 0.35]
        out = tmp_path / "report"
        result = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "mixrl.cli", "report", str(out), "--buffer", url],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    assert "fetched 3 steps" in result.stdout
    assert (out / "report.png").exists() and "| steps | 3 |" in (out / "report.md").read_text()
    assert json.loads((out / "evaluations.jsonl").read_text())["pass_at_k"] == {"1": 0.5}


def test_an_unreachable_buffer_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "report", str(tmp_path), "--buffer", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("mixrl report: --buffer: http://127.0.0.1:9/trainer-metrics: ")
    assert len(result.stderr.strip().splitlines()) == 1
