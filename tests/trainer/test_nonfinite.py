"""A step whose gradient is not finite (an overflow in the forward, a diverging batch) must not
touch the weights: before, AdamW applied the NaN gradient, every weight became NaN, and the loop
published that version to the engines."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from mixrl.rl.buffer.client import BufferClient
from mixrl.rl.corrections import CorrectionConfig
from mixrl.rl.trainer.batch import collate
from mixrl.rl.trainer.main import PoisonBatch
from mixrl.rl.trainer.torch_backend import NonFiniteGradient, OptimizerSettings, TorchPolicyTrainer
from mixrl.rl.weights import WeightStore

from ..servers import buffer_at
from .conftest import synthetic_group
from .test_loop import RUN, small_run, trainer_loop


def overflow(model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Make the final norm's output infinite (what an overflow in the forward gives)."""
    norm = model.get_decoder().norm
    return norm.register_forward_hook(lambda module, inputs, output: output * float("inf"))


def test_a_non_finite_gradient_leaves_the_weights_and_adamw_as_they_were(model: torch.nn.Module) -> None:
    batch = collate([synthetic_group(model, "p", 2, "pool", seed=1)], trainer_version=0)
    trainer = TorchPolicyTrainer(copy.deepcopy(model), CorrectionConfig(), OptimizerSettings(lr=1e-3))
    trainer.step(batch)  # a good step first: AdamW has moments to lose
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    moments = copy.deepcopy(trainer.optimizer.state_dict())
    handle = overflow(trainer.model)
    with pytest.raises(NonFiniteGradient, match=r"gradient norm is nan; the update is skipped"):
        trainer.step(batch)
    handle.remove()
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), weights[name]), name
    assert all(p.grad is None for p in trainer.model.parameters())
    after = trainer.optimizer.state_dict()
    for index, state in moments["state"].items():
        assert int(after["state"][index]["step"]) == int(state["step"])
        assert torch.equal(after["state"][index]["exp_avg"], state["exp_avg"])
    assert trainer.step(batch).grad_norm > 0  # the next batch trains as before


async def test_the_loop_quarantines_the_batch_and_publishes_no_poisoned_version(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module
) -> None:
    async with buffer_at(tmp_path / "buffer", run=RUN) as url:
        async with BufferClient(url) as client:
            await client.post_trajectories(synthetic_group(model, "nan", 2, pool="bf16", seed=0, run=RUN))
        loop = trainer_loop(tmp_path, url, tiny_model_dir, total_steps=1)
        assert isinstance(loop.trainer, TorchPolicyTrainer)
        overflow(loop.trainer.model)
        with pytest.raises(PoisonBatch, match=r"step 1: .*NonFiniteGradient: the gradient norm is nan"):
            await loop.train()
        async with BufferClient(url) as client:
            stats = await client.stats()
    assert [q["prompt_ids"] for q in stats["quarantined"]] == [["nan"]]
    assert WeightStore(small_run(tmp_path, 1).weights.store).versions() == [0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
