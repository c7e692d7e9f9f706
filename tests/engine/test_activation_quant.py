"""GEMM inputs quantized in the served model: which layers, the same numbers as hooks on a plain
model, the MoE experts' two inputs, calibration per version, and the lean decode step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from mixrl.rl import activation_quant, quant
from mixrl.rl.activation_quant import InputQuantExperts, InputQuantLinear
from mixrl.rl.engine.client import EngineClient
from mixrl.rl.engine.staging import StagedWeights
from mixrl.rl.tiny_models import create_tiny_checkpoint
from mixrl.rl.weights import WeightStore

from .conftest import VOCAB, random_prompts, reference_logprobs, reference_model, serve_in_process

IDS = torch.tensor(random_prompts(3, seed=4, low=9, high=10))


@torch.no_grad()
def _hooked_logits(path: str, fmt: str, amax: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """The weights-only model with each quantized linear's input quantized by a forward pre-hook."""
    model = reference_model(path, fmt, activations=False)
    quantized = set(quant.quantize_model_(reference_model(path, "bf16", activations=False), fmt)["quantized"])
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name in quantized:
            limit = amax[name] if amax else None
            module.register_forward_pre_hook(
                lambda _m, args, limit=limit: (quant.quantize_activation(args[0], fmt, amax=limit),)
            )
    return model(input_ids=IDS).logits


@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel", "mxfp4", "nvfp4"])
def test_the_served_dense_model_quantizes_the_inputs_of_its_quantized_layers(
    dense_path: str, fmt: str
) -> None:
    model = reference_model(dense_path, fmt)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    taken = {name for name, m in linears.items() if isinstance(m, InputQuantLinear)}
    assert taken and "lm_head" not in taken and all("proj" in name for name in taken)
    inputs = activation_quant.install_(model, fmt, [])  # idempotent: the installed quantizers are kept
    assert inputs is not None and set(inputs.quantizers) == taken
    amax = {name: q.amax for name, q in inputs.quantizers.items()} if fmt == "nvfp4" else None
    with torch.no_grad():
        served = model(input_ids=IDS).logits
    assert torch.equal(served, _hooked_logits(dense_path, fmt, amax))
    weights_only = reference_model(dense_path, fmt, activations=False)
    with torch.no_grad():
        assert not torch.equal(served, weights_only(input_ids=IDS).logits)  # the inputs did move


def test_bf16_and_off_leave_the_model_alone(dense_path: str) -> None:
    model = reference_model(dense_path, "bf16")
    assert not any(isinstance(m, InputQuantLinear) for m in model.modules())
    assert activation_quant.install_(model, "bf16", ["model.layers.0.mlp.up_proj"]) is None


def test_calibration_follows_the_weights_and_fused_inputs_share_a_scale(
    dense_path: str, tmp_path: Path
) -> None:
    first = activation_quant.install_(reference_model(dense_path, "nvfp4"), "nvfp4", [])
    other = activation_quant.install_(
        reference_model(create_tiny_checkpoint(tmp_path / "v1", vocab_size=VOCAB, seed=7), "nvfp4"),
        "nvfp4",
        [],
    )
    assert first and other and first.needs_calibration
    amax = {name: float(q.amax) for name, q in first.quantizers.items()}
    for layer in ("model.layers.0.self_attn", "model.layers.1.self_attn"):
        assert amax[f"{layer}.q_proj"] == amax[f"{layer}.k_proj"] == amax[f"{layer}.v_proj"]
    assert amax["model.layers.0.mlp.gate_proj"] == amax["model.layers.0.mlp.up_proj"]
    assert all(value > 0 for value in amax.values())
    assert amax != {name: float(q.amax) for name, q in other.quantizers.items()}
    with pytest.raises(ValueError, match=r"input amax of 'model\.layers\.0\.mlp\.up_proj'"):
        first.set_amax(
            {
                **{n: q.amax for n, q in first.quantizers.items()},
                "model.layers.0.mlp.up_proj": torch.tensor(0.0),
            }
        )


def _per_token_moe(experts: Qwen3MoeExperts, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                   fmt: str) -> torch.Tensor:  # fmt: skip
    """Each token through each of its top-k experts, one at a time (the definition, not a loop over experts)."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        x = quant.quantize_activation(hidden[t : t + 1], fmt)
        for k, expert in enumerate(index[t].tolist()):
            gate, up = (x @ experts.gate_up_proj[expert].T).chunk(2, dim=-1)
            inner = quant.quantize_activation(experts.act_fn(gate) * up, fmt)
            out[t] += (inner @ experts.down_proj[expert].T)[0] * weights[t, k]
    return out


def test_moe_experts_quantize_both_inputs_and_equal_transformers_without(moe_path: str) -> None:
    model = reference_model(moe_path, "fp8", activations=False)
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, experts.hidden_dim, generator=g)
    index = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=g)
    with torch.no_grad():
        plain = experts(hidden, index, weights)
        inputs = activation_quant.install_(model, "fp8", quant.quantize_model_(model, "fp8")["quantized"])
        assert inputs and type(experts) is InputQuantExperts
        assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"} <= set(
            inputs.quantizers
        )
        quantized = experts(hidden, index, weights)
        expected = _per_token_moe(experts, hidden, index, weights, "fp8")
        experts.gate_up_input = experts.down_input = None
        assert torch.equal(experts(hidden, index, weights), plain)  # the same loop as transformers'
    assert torch.allclose(quantized, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(quantized, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preparer", ["thread", "process"])
def test_the_preparer_calibrates_each_version(dense_path: str, tmp_path: Path, preparer: str) -> None:
    live = reference_model(dense_path, "nvfp4")
    other = create_tiny_checkpoint(tmp_path / "v1", "qwen3", vocab_size=VOCAB, seed=7)
    staged = StagedWeights(live.config, "nvfp4", torch.float32, preparer, calibrate_inputs=True)
    try:
        prepared = staged.prepare_state(live, load_file(Path(other) / "model.safetensors"))
    finally:
        staged.close()
    expected = activation_quant.install_(reference_model(other, "nvfp4"), "nvfp4", [])
    assert expected and set(prepared.input_amax) == set(expected.quantizers)
    for name, quantizer in expected.quantizers.items():  # the preparer's model runs eager attention
        assert float(prepared.input_amax[name]) == pytest.approx(float(quantizer.amax), rel=1e-5), name


async def test_an_nvfp4_engine_serves_each_version_with_its_own_calibration(
    dense_path: str, tmp_path: Path, other_version: tuple[str, WeightStore]
) -> None:
    other, store = other_version
    prompt = IDS[0].tolist()
    served = []
    async with serve_in_process(
        model_path=dense_path, weight_precision="nvfp4", weight_root=str(tmp_path)
    ) as (
        url,
        service,
    ):
        async with EngineClient(url) as client:
            for version in (0, 1):
                if version:
                    assert (await client.update_weights_from_disk(store.path(1), 1))["success"]
                result = await client.generate(
                    prompt, max_new_tokens=1, temperature=1.0, top_logprobs_num=VOCAB
                )
                record = result.records[0]
                row = torch.empty(VOCAB, dtype=torch.float64)
                row[record.cand_ids] = torch.tensor(record.cand_logprobs, dtype=torch.float64)
                served.append(row)
        assert service.inputs is not None and service.inputs.needs_calibration
    for row, path in zip(served, (dense_path, other), strict=True):
        expected = reference_logprobs(reference_model(path, "nvfp4"), prompt, [0])[0]
        assert torch.allclose(row, expected, atol=2e-4, rtol=0)  # test_precisions' tolerance


def test_fused_layers_share_one_quantizer_and_quantize_their_input_once(
    dense_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = reference_model(dense_path, "fp8")
    inputs = activation_quant.install_(model, "fp8", [])
    assert inputs is not None
    attn = "model.layers.0.self_attn"
    assert inputs.quantizers[f"{attn}.q_proj"] is inputs.quantizers[f"{attn}.v_proj"]
    assert inputs.quantizers[f"{attn}.q_proj"] is not inputs.quantizers[f"{attn}.o_proj"]
    calls = 0
    real = activation_quant.quantize_activation

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(activation_quant, "quantize_activation", counted)
    with torch.no_grad():
        model(input_ids=IDS)
    assert calls == 4 * model.config.num_hidden_layers  # q/k/v, o, gate/up, down
    assert all(q._held is None for q in inputs.quantizers.values())  # nothing kept after the forward
