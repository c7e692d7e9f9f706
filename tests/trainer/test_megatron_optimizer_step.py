"""``MegatronPolicyTrainer``'s update and checkpoint load on the CPU, around megatron-core's own
``ChainedOptimizer`` (what ``get_megatron_optimizer`` returns) holding CPU stand-ins.

The trainer itself needs CUDA (megatron-core 0.16's ``GPTModel``, DDP buffers and distributed
optimizer), so its collaborators are stand-ins with their surface: the forward-backward schedule
sets the gradients, and each of the chained optimizers is an AdamW over FP32 parameters with
param groups as megatron-core builds them, whose ``prepare_grads`` finds nothing, as the
distributed optimizer's in BF16 (no loss scaler, so no look for inf or NaN).

- A NaN gradient: megatron-core's step applied it (every weight NaN, and the loop published them);
  the trainer now raises the torch backend's ``NonFiniteGradient`` first, the weights and the
  moments unchanged, the gradients cleared.
- A finite one: the update is exactly ``ChainedOptimizer.step``'s, clipping included.
- A checkpoint load restored the checkpoint's lr, betas and weight decay over the spec's; the spec's
  now win, the moments are the checkpoint's.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mixrl.rl.corrections import CorrectionConfig
from mixrl.rl.trainer import megatron_backend
from mixrl.rl.trainer.batch import PolicyBatch, collate
from mixrl.rl.trainer.megatron_backend import MegatronPolicyTrainer
from mixrl.rl.trainer.torch_backend import NonFiniteGradient, OptimizerSettings

from .conftest import synthetic_group

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core.optimizer.optimizer as megatron_optimizer
    from megatron.core.optimizer import ChainedOptimizer


def clip_on_cpu(parameters: list[torch.Tensor], max_norm: float, total_norm: float, **_: Any) -> None:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` (CUDA tensors only) on CPU tensors."""
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(coefficient)


class Part:
    """One optimizer of the chain (a ``DistributedOptimizer`` on CUDA): AdamW over the FP32 main
    parameters, their ``.grad`` the main gradients."""

    is_stub_optimizer = False

    def __init__(self, groups: list[dict[str, Any]], settings: OptimizerSettings) -> None:
        self.optimizer = torch.optim.AdamW(
            groups, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
        )
        self.config = SimpleNamespace(
            clip_grad=settings.grad_clip if settings.grad_clip is not None else 0.0,
            use_precision_aware_optimizer_no_fp8_or_ds_fp8=False,
            log_num_zeros_in_grad=False,
            overlap_param_gather_with_optimizer_step=False,
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def get_parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def prepare_grads(self) -> bool:
        return False  # BF16 without a loss scaler: megatron-core looks for no inf or NaN

    def get_grad_norm(self) -> float:
        grads = [p.grad for p in self.get_parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)  # param groups included, as megatron-core's

    def sharded_state_dict(self, model: Any, is_loading: bool = False, **_: Any) -> dict[str, Any]:
        return {}


class Net(torch.nn.Linear):
    def sharded_state_dict(self) -> dict[str, Any]:
        return {}


class Ddp:
    """``DistributedDataParallel``'s surface: the module and its gradient buffer."""

    def __init__(self, module: Net) -> None:
        self.module = module
        self.buffer_zeroed = 0

    def zero_grad_buffer(self) -> None:
        self.buffer_zeroed += 1
        for p in self.module.parameters():
            p.grad = None


def stand_in(
    settings: OptimizerSettings, loaded: dict[str, Any] | None = None
) -> tuple[MegatronPolicyTrainer, dict[str, float]]:
    """A trainer (built without ``__init__``, which needs CUDA) on one data-parallel rank and one
    stage, whose schedule backpropagates a loss of a fixed linear map times ``scale["value"]``; and
    that ``scale``.  ``loaded``: what its checkpoint holds besides the model."""
    torch.manual_seed(0)
    net = Net(4, 3)
    # megatron-core's groups: decayed weights, and biases (wd_mult 0.0: a scheduler's, none runs)
    groups = [
        {"params": [net.weight], "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
         "is_decoupled_lr": False, "max_lr": settings.lr, "min_lr": 0.0, "default_config": True},
        {"params": [net.bias], "wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False,
         "is_decoupled_lr": False, "max_lr": settings.lr, "min_lr": 0.0, "default_config": True},
    ]  # fmt: skip
    trainer = MegatronPolicyTrainer.__new__(MegatronPolicyTrainer)
    ddp = Ddp(net)
    scale = {"value": 1.0}

    def forward_backward(**_: Any) -> None:
        x = torch.arange(8, dtype=torch.float32).view(2, 4) / 8
        (net(x).square().sum() * scale["value"]).backward()

    mpu = SimpleNamespace(
        get_data_parallel_world_size=lambda: 1,
        get_data_parallel_rank=lambda: 0,
        is_pipeline_last_stage=lambda: True,
    )
    checkpoints = SimpleNamespace(load=lambda state, path: {"model": net.state_dict(), **(loaded or {})})
    trainer.mc = {
        "get_forward_backward_func": lambda: forward_backward,
        "clip_grad_by_total_norm_fp32": clip_on_cpu,
        "dist_checkpointing": checkpoints,
    }
    trainer.mpu = mpu
    trainer.place = (0, 0, 0)
    trainer.settings = settings
    trainer.corrections = CorrectionConfig()
    trainer.model = ddp
    trainer.optimizer = ChainedOptimizer([Part(groups, settings)])
    return trainer, scale


def weights(trainer: MegatronPolicyTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.module.named_parameters()}


def adam_state(trainer: MegatronPolicyTrainer) -> dict[str, Any]:
    return copy.deepcopy(trainer.optimizer.state_dict())


@pytest.fixture(autouse=True)
def megatron_clips_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ChainedOptimizer.step`` (the reference, and the trainer's update before the fix) clips on
    the CPU."""
    monkeypatch.setattr(megatron_optimizer, "clip_grad_by_total_norm_fp32", clip_on_cpu)


@pytest.fixture
def batch(model: torch.nn.Module) -> PolicyBatch:
    return collate([synthetic_group(model, "p", 2, "pool", seed=1)], trainer_version=0)


def test_it_is_the_torch_backends_exception() -> None:
    assert megatron_backend.NonFiniteGradient is NonFiniteGradient


def test_a_non_finite_gradient_leaves_the_weights_and_the_moments_as_they_were(batch: PolicyBatch) -> None:
    # No clipping: the update then reaches AdamW with the NaN gradient untouched.
    trainer, scale = stand_in(OptimizerSettings(lr=1e-2, grad_clip=None))
    first = weights(trainer)
    assert trainer.step(batch).grad_norm > 0  # a good step first: AdamW has moments to lose
    before, moments = weights(trainer), adam_state(trainer)
    assert any(not torch.equal(before[name], first[name]) for name in first)
    scale["value"] = float("nan")
    zeroed = trainer.model.buffer_zeroed
    with pytest.raises(NonFiniteGradient, match=r"gradient norm is nan; the update is skipped"):
        trainer.step(batch)
    after = weights(trainer)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert all(p.grad is None for p in trainer.model.module.parameters())  # cleared
    assert trainer.model.buffer_zeroed > zeroed
    state = adam_state(trainer)
    for index, old in moments["state"].items():
        assert int(state["state"][index]["step"]) == int(old["step"]) == 1
        assert torch.equal(state["state"][index]["exp_avg"], old["exp_avg"])
        assert torch.equal(state["state"][index]["exp_avg_sq"], old["exp_avg_sq"])
    scale["value"] = 1.0
    assert trainer.step(batch).grad_norm > 0  # the next batch trains as before
    assert all(torch.isfinite(p).all() for p in trainer.model.module.parameters())


@pytest.mark.parametrize("grad_clip", [None, 1e-3, 1e3])
def test_a_finite_update_is_megatrons_chained_optimizer_step(
    batch: PolicyBatch, grad_clip: float | None
) -> None:
    """The trainer takes ChainedOptimizer.step apart to look at the norm before the update; the
    update and the norm it reports are still exactly Megatron's, clipping included."""
    settings = OptimizerSettings(lr=1e-2, grad_clip=grad_clip, weight_decay=0.1)
    (ours, _), (theirs, _) = stand_in(settings), stand_in(settings)
    for _ in range(3):
        norm = ours.step(batch).grad_norm
        theirs.optimizer.zero_grad()
        theirs.mc["get_forward_backward_func"]()()
        success, megatron_norm, _ = theirs.optimizer.step()
        assert success and norm == pytest.approx(megatron_norm, rel=1e-12)
    mine, megatron = weights(ours), weights(theirs)
    for name, value in megatron.items():
        assert torch.equal(mine[name], value), name


BEFORE = OptimizerSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1)
AFTER = OptimizerSettings(lr=1e-5, betas=(0.8, 0.95), weight_decay=0.0)


def test_a_load_takes_the_specs_optimizer_settings_and_the_checkpoints_moments(
    tmp_path: Path, batch: PolicyBatch
) -> None:
    old, _ = stand_in(BEFORE)
    old.step(batch)
    saved = {"optimizer": adam_state(old), "step": 1}  # what dist_checkpointing gives back
    new, _ = stand_in(AFTER, loaded=saved)
    assert new.load_checkpoint(tmp_path / "checkpoint-1") == 1
    groups = new.optimizer.param_groups
    assert len(groups) == 2
    for group in groups:
        assert group["lr"] == AFTER.lr and tuple(group["betas"]) == AFTER.betas
        assert group["weight_decay"] == AFTER.weight_decay and group["max_lr"] == AFTER.lr
    assert [group["wd_mult"] for group in groups] == [1.0, 0.0]  # megatron's own keys untouched
    state = adam_state(new)["state"].values()
    moments = [s["exp_avg"] for s in state]
    assert moments and all(float(m.abs().sum()) > 0 for m in moments)  # the checkpoint's, not fresh
    assert {int(s["step"]) for s in state} == {1}
