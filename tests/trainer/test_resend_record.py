"""A trainer stopped after saving step s's checkpoint and before posting step s's metrics record
(SIGTERM, the buffer unreachable) sends it again when it resumes: the buffer's copy of the run's
metrics (what ``mixrl report`` reads once the trainer is gone) lacked that step for good."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
import torch

from mixrl.rl.buffer import BufferError
from mixrl.rl.buffer.client import BufferClient

from ..servers import buffer_at
from .conftest import synthetic_group
from .test_loop import RUN, trainer_loop


async def test_a_resume_sends_the_checkpoint_steps_record_again(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with buffer_at(tmp_path / "buffer", run=RUN) as url:
        async with BufferClient(url) as client:
            await client.post_trajectories(synthetic_group(model, "a", 2, pool="bf16", seed=0, run=RUN))

        async def lost(self: BufferClient, report: object) -> None:
            raise BufferError("POST /mismatch: cannot reach the buffer")

        with monkeypatch.context() as patched:  # committed, then neither report nor record is sent
            patched.setattr(BufferClient, "post_mismatch", lost)
            with pytest.raises(BufferError):
                await trainer_loop(tmp_path, url, tiny_model_dir, total_steps=1).train()
        line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
        async with aiohttp.ClientSession() as http, http.get(f"{url}/trainer-metrics") as response:
            assert (await response.text()).strip() == ""  # the step's record never reached the buffer
        async with BufferClient(url) as client:
            assert (await client.stats())["mismatch"] is None

        resumed = trainer_loop(tmp_path, url, tiny_model_dir, total_steps=1)
        assert resumed.step == 1
        await resumed.train()
        async with aiohttp.ClientSession() as http, http.get(f"{url}/trainer-metrics") as response:
            records = [json.loads(text) for text in (await response.text()).splitlines()]
        async with BufferClient(url) as client:
            stats = await client.stats()
    assert records == [line]
    assert stats["committed_step"] == 1 and stats["mismatch"]["step"] == 1
