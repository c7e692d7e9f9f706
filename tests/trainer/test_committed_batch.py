"""A batch that crashes the step after a resume that redoes committed steps: the buffer refuses to
quarantine a committed step's batch, and the trainer says so (one line), rather than claiming the
batch is quarantined and that a restart goes on (it would crash the same way, forever)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mixrl.rl.buffer.client import BufferClient
from mixrl.rl.trainer.batch import PolicyBatch
from mixrl.rl.trainer.main import CommittedBatch, TrainerLoop
from mixrl.rl.trainer.torch_backend import StepResult, TorchPolicyTrainer

from ..servers import buffer_at
from .conftest import synthetic_group
from .test_loop import RUN, trainer_loop


async def test_a_committed_batch_that_crashes_is_not_called_quarantined(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with buffer_at(tmp_path / "buffer", run=RUN) as url:
        async with BufferClient(url) as client:
            for seed, prompt in enumerate(["first", "second"]):
                await client.post_trajectories(
                    synthetic_group(model, prompt, 2, pool="bf16", seed=seed, run=RUN)
                )
        await trainer_loop(tmp_path, url, tiny_model_dir, total_steps=1).train()
        # The checkpoint of step 1 is lost: the trainer resumes from the start and redoes step 1,
        # which the buffer has committed, on the same batch; this time the step crashes.
        shutil.rmtree(tmp_path / "run" / "checkpoint-1")

        def crash(self: TorchPolicyTrainer, batch: PolicyBatch) -> StepResult:
            raise IndexError("index 7 is out of bounds for dimension 0 with size 3")

        monkeypatch.setattr(TorchPolicyTrainer, "step", crash)
        resumed = trainer_loop(tmp_path, url, tiny_model_dir, total_steps=1)
        assert resumed.step == 0
        with pytest.raises(CommittedBatch) as refused:
            await resumed.train()
        assert str(refused.value) == (
            "step 1: its batch cannot be trained (the trainer crashed on it (IndexError: index 7 is out"
            " of bounds for dimension 0 with size 3)) nor quarantined: the buffer has the step committed"
            " (trained after the checkpoint this trainer resumed from), so a restart redoes it the same way"
        )
        async with BufferClient(url) as client:
            stats = await client.stats()
            assert stats["quarantined"] == [] and stats["committed_step"] == 1
            # Step 2's batch crashes every rank: the first report quarantines it, the second finds it
            # quarantined already, which is no error.
            batch = await client.get_batch(2)
            assert batch is not None
            ranks = [SimpleNamespace(buffer=client), SimpleNamespace(buffer=client)]
            for rank in ranks:
                await TrainerLoop.quarantine(rank, batch, "the trainer crashed on it")  # type: ignore[arg-type]
            assert [q["prompt_ids"] for q in (await client.stats())["quarantined"]] == [["second"]]
