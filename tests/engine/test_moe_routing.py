"""MoE routing mismatch: every router's top-k recorded, two models compared on the same tokens,
and a run directory measured per pool as `mixrl report` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from mixrl.local.routing import measure, routing_lines
from mixrl.rl.moe_routing import routed_experts, routing_disagreement
from mixrl.rl.weights import WeightStore

from .conftest import publish, random_prompts, reference_model

ROOT = Path(__file__).resolve().parents[2]
IDS = torch.tensor(random_prompts(2, seed=8, low=12, high=13))


def test_routes_are_recorded_per_layer_and_compared(moe_path: str) -> None:
    model = reference_model(moe_path)
    config = model.config
    routes = routed_experts(model, IDS)
    assert routes.shape == (config.num_hidden_layers, IDS.numel(), config.num_experts_per_tok)
    assert bool((routes[..., 1:] > routes[..., :-1]).all())  # sorted, distinct experts
    same = routing_disagreement(routes, routed_experts(model, IDS))
    assert same.tokens == IDS.numel() and same.any_layer == 0.0 and same.per_layer == [0.0, 0.0]
    other = reference_model(moe_path)
    with torch.no_grad():
        router = other.model.layers[1].mlp.gate
        router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(0)))
    moved = routing_disagreement(routes, routed_experts(other, IDS))
    assert moved.per_layer[0] == 0.0 and 0 < moved.per_layer[1] == moved.any_layer  # only layer 1 moved
    selected = torch.zeros(IDS.numel(), dtype=torch.bool)
    selected[:3] = True
    assert routing_disagreement(routes, routed_experts(other, IDS), selected).tokens == 3
    with pytest.raises(ValueError, match="routing: shapes differ"):
        routing_disagreement(routes, routes[:1])


def test_a_dense_model_routes_nothing(dense_path: str) -> None:
    with pytest.raises(ValueError, match="no top-k MoE router"):
        routed_experts(reference_model(dense_path), IDS)


def _sample(pool: str, prompt: list[int], tokens: list[int], version: int) -> dict[str, object]:
    mask = [1, 1, 0, 1] * (len(tokens) // 4)
    return {
        "pool": pool, "prompt_ids": prompt, "tokens": tokens, "loss_mask": mask,
        "weight_version": [version if m else -1 for m in mask],
    }  # fmt: skip


def test_a_run_directory_is_measured_per_pool(moe_path: str, tmp_path: Path) -> None:
    run = yaml.safe_load((ROOT / "examples" / "ablation-moe.yaml").read_text())
    run["spec"]["samplerPools"] = [p for p in run["spec"]["samplerPools"] if p["name"] in ("nvfp4", "bf16")]
    (tmp_path / "rlrun.yaml").write_text(yaml.safe_dump(run))
    store = WeightStore(str(tmp_path / "weights"))
    publish(store, 3, moe_path)
    prompts = random_prompts(24, seed=9, low=6, high=10)
    lines = [_sample(pool, p, random_prompts(1, seed=i, low=12, high=13)[0], 3)
             for i, p in enumerate(prompts) for pool in ("nvfp4", "bf16")]  # fmt: skip
    lines.append(_sample("nvfp4", prompts[0], prompts[1][:4], 2))  # another version: not this one's
    (tmp_path / "buffer").mkdir()
    (tmp_path / "buffer" / "trajectories.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines)
    )
    measured = measure(tmp_path)
    assert set(measured) == {"nvfp4", "bf16"}
    assert (
        measured["bf16"].tokens == 24 * 9 and measured["bf16"].any_layer == 0.0
    )  # the trainer's own numbers
    assert measured["nvfp4"].any_layer > 0  # W4A4 with an FP8 KV cache moves some routes
    report = routing_lines(tmp_path)
    assert report[0] == "## MoE routing mismatch per pool" and any(
        line.startswith("| nvfp4 | 216 |") for line in report
    )
    assert json.loads((tmp_path / "routing.json").read_text())["nvfp4"]["tokens"] == 216
