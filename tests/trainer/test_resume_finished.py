"""A finished run resumed with a larger ``totalSteps`` is not finished: its ``finished.json`` goes.

Before, the file of the first end stayed until the new last step was taken, so a resumed run that
stopped or crashed before then still read as finished at the old last step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mixrl.rl.buffer.client import BufferClient
from mixrl.rl.trainer.main import FINISHED, TrainerLoop

from ..servers import buffer_at
from .conftest import synthetic_group
from .test_loop import RUN, small_run, trainer_loop


@pytest.mark.parametrize(("total_steps", "finished"), [(2, False), (None, False), (1, True)])
async def test_a_resume_with_steps_left_removes_finished_json(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module, total_steps: int | None, finished: bool
) -> None:
    run_dir = tmp_path / "run"
    async with buffer_at(tmp_path / "buffer", run=RUN) as url:
        async with BufferClient(url) as client:
            await client.post_trajectories(synthetic_group(model, "a", 2, pool="bf16", seed=0, run=RUN))
        await trainer_loop(tmp_path, url, tiny_model_dir, total_steps=1).train()
        assert json.loads((run_dir / FINISHED).read_text())["step"] == 1
        # A restarted trainer on the changed spec (totalSteps None: no last step).
        run = small_run(tmp_path, 1)
        spec = run.trainer.spec.model_copy(update={"total_steps": total_steps})
        run = run.model_copy(update={"trainer": run.trainer.model_copy(update={"spec": spec})})
        resumed = TrainerLoop(
            run, buffer_url=url, router_url=None, run_dir=run_dir, model_path=str(tiny_model_dir)
        )
        resumed.resume()
        await resumed.buffer.close()
    assert resumed.step == 1
    assert (run_dir / FINISHED).exists() == finished
