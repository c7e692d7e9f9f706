"""The FSDP2 trainer with real collectives: two torchrun ranks on gloo must make the update one
process makes (parameters, loss, metrics); checkpoints across rank counts are test_checkpoint.py's.

The ranks are real processes started by torchrun, as ``mixrl run`` and the operator start them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from mixrl.rl.tiny_models import load_model
from mixrl.rl.trainer.batch import collate

from .conftest import reference_trainer, synthetic_group, torchrun


def single_process(
    model_dir: Path, groups_json: Path, steps: int, compute_dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor], list[Any]]:
    trainer = reference_trainer(model_dir, compute_dtype)
    from mixrl.api.trajectory import Trajectory

    groups = [[Trajectory.model_validate(t) for t in g] for g in json.loads(groups_json.read_text())]
    results = [trainer.step(collate(groups, trainer_version=0)) for _ in range(steps)]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters()), "FP32 master weights"
    return trainer.state_dict_for_publication(torch.float32), results


def test_two_ranks_make_the_single_process_update(
    tmp_path: Path, tiny_model_dir: Path, groups_json: Path
) -> None:
    expected, results = single_process(tiny_model_dir, groups_json, steps=2)
    torchrun(2, tiny_model_dir, groups_json, tmp_path, 2, cwd=tmp_path)
    weights = load_file(str(tmp_path / "weights.safetensors"))
    assert weights.keys() == expected.keys()
    initial = load_model(tiny_model_dir).state_dict()
    for name, value in expected.items():
        assert not torch.equal(value, initial[name].float()) or "norm" in name  # the step moved it
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for got, want in zip(steps, results, strict=True):
            assert got["loss"] == pytest.approx(want.loss, rel=1e-5, abs=1e-7)
            assert got["grad_norm"] == pytest.approx(want.grad_norm, rel=1e-4)
            for key in ("kl_k3", "extreme_ratio", "reward"):
                assert got["metrics"][key] == pytest.approx(want.metrics[key], rel=1e-5, abs=1e-9), key
            assert got["per_pool"]["a"]["tokens"] == want.per_pool["a"]["tokens"]


def test_a_rank_without_trajectories_still_takes_part(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module
) -> None:
    # Two trajectories for three ranks: rank 2 runs empty passes and the update is still the one
    # a single process makes.
    groups_json = tmp_path / "two.json"
    group = synthetic_group(model, "p", 2, pool="a", seed=7, noise=0.3)
    groups_json.write_text(json.dumps([[t.model_dump(mode="json") for t in group]]))
    expected, results = single_process(tiny_model_dir, groups_json, steps=1)
    torchrun(3, tiny_model_dir, groups_json, tmp_path, 1, cwd=tmp_path)
    weights = load_file(str(tmp_path / "weights.safetensors"))
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)
    (step,) = json.loads((tmp_path / "rank2.json").read_text())
    assert step["metrics"]["kl_k3"] == pytest.approx(results[0].metrics["kl_k3"], rel=1e-5, abs=1e-9)
    assert step["loss"] == pytest.approx(results[0].loss, rel=1e-5, abs=1e-7)


def test_bf16_compute_keeps_fp32_masters_and_two_ranks_agree_with_one(
    tmp_path: Path, tiny_model_dir: Path, groups_json: Path
) -> None:
    """BF16 compute as on GPUs (autocast in one process, FSDP2's mixed-precision policy over two
    ranks): the masters stay FP32, the update is BF16's, not FP32's, and the ranks make it too."""
    fp32, _ = single_process(tiny_model_dir, groups_json, steps=1)
    bf16, results = single_process(tiny_model_dir, groups_json, steps=1, compute_dtype=torch.bfloat16)
    torchrun(2, tiny_model_dir, groups_json, tmp_path, 1, cwd=tmp_path, compute_dtype="bfloat16")
    ranks = load_file(str(tmp_path / "weights.safetensors"))
    moved = max(float((bf16[name] - fp32[name]).abs().max()) for name in fp32)
    assert moved > 1e-6, "BF16 compute changed nothing: it was not used"
    for name, value in bf16.items():
        # The same BF16 rounding happens in other places (autocast's per-op casts against FSDP's
        # cast of the gathered weights), so the two agree to BF16's precision, not bit for bit.
        torch.testing.assert_close(ranks[name], value, rtol=2e-2, atol=2e-3, msg=name)
    (step,) = json.loads((tmp_path / "rank0.json").read_text())
    assert step["loss"] == pytest.approx(results[0].loss, rel=5e-2, abs=1e-3)
