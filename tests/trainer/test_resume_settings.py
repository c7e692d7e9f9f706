"""A resumed trainer trains with the optimizer settings of the spec it is started with.

AdamW's ``load_state_dict`` restores the param groups too (lr, betas, weight decay), so a run
whose ``trainer.optimizer`` was changed (the lr lowered after a spike, and the trainer restarted
on it) went on with the checkpoint's settings and said nothing; the moments and step counters are
the checkpoint's, the hyperparameters are the spec's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from mixrl.rl.corrections import CorrectionConfig
from mixrl.rl.trainer import checkpoint
from mixrl.rl.trainer.batch import collate
from mixrl.rl.trainer.torch_backend import OptimizerSettings, TorchPolicyTrainer

from .conftest import synthetic_group

BEFORE = OptimizerSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1)
AFTER = OptimizerSettings(lr=1e-5, betas=(0.8, 0.95), weight_decay=0.0)


@pytest.mark.parametrize("kind", ["sharded", "single file"])
def test_a_resume_takes_the_specs_optimizer_settings_and_the_checkpoints_moments(
    tmp_path: Path, model: torch.nn.Module, kind: str
) -> None:
    batch = collate([synthetic_group(model, "p", 2, "pool", seed=1)], trainer_version=0)
    old = TorchPolicyTrainer(copy.deepcopy(model), CorrectionConfig(), BEFORE)
    old.step(batch)
    if kind == "sharded":
        path = old.save_checkpoint(tmp_path, 1)
    else:
        path = tmp_path / checkpoint.LEGACY
        torch.save({"step": 1, **old._full_state(with_optimizer=True)}, path)
    new = TorchPolicyTrainer(copy.deepcopy(model), CorrectionConfig(), AFTER)
    assert new.load_checkpoint(path) == 1
    for group in new.optimizer.param_groups:
        assert group["lr"] == AFTER.lr and tuple(group["betas"]) == AFTER.betas
        assert group["weight_decay"] == AFTER.weight_decay
    moments = [s["exp_avg"] for s in new.optimizer.state.values()]
    assert moments and all(float(m.abs().sum()) > 0 for m in moments)  # the checkpoint's, not fresh
    assert {int(s["step"]) for s in new.optimizer.state.values()} == {1}
