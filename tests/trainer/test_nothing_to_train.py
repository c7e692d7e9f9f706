"""A batch without a single generated token (every trajectory only tool or environment tokens:
a rollout whose agent failed before it sampled) has nothing to train on.  Before, the step "trained"
it: no gradient, no update, loss 0, and yet a step counted towards totalSteps, a version published
identical to the last and a metrics line as if it had learned.  Now it is quarantined like any
batch that cannot be trained, and the step takes the next full groups."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mixrl.api.trajectory import Trajectory
from mixrl.rl.buffer.client import BufferClient

from ..servers import buffer_at
from .conftest import synthetic_group
from .test_loop import RUN, trainer_loop


def tool_tokens_only(prompt_id: str) -> list[Trajectory]:
    group = []
    for index in range(2):
        trajectory = Trajectory(
            run=RUN, prompt_id=prompt_id, sample_index=index, pool="bf16", prompt_ids=[3, 4]
        )
        trajectory.append_observation([5, 6, 7])
        trajectory.reward = float(index)
        trajectory.finish_reason = "error"
        group.append(trajectory)
    return group


async def test_a_batch_without_generated_tokens_is_quarantined_and_the_step_trains_the_next(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module
) -> None:
    async with buffer_at(tmp_path / "buffer", run=RUN) as url:
        async with BufferClient(url) as client:
            await client.post_trajectories(tool_tokens_only("empty"))
            await client.post_trajectories(synthetic_group(model, "good", 2, pool="bf16", seed=1, run=RUN))
        await trainer_loop(tmp_path, url, tiny_model_dir, total_steps=1).train()
        async with BufferClient(url) as client:
            stats = await client.stats()
            assert (await client.read_batch(1)).groups[0].prompt_id == "good"  # type: ignore[union-attr]
    (quarantined,) = stats["quarantined"]
    assert quarantined["prompt_ids"] == ["empty"]
    assert "no generated token" in quarantined["reason"]
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["tokens"] > 0
