"""FP8 KV-cache emulation and whole-model quantization of tiny Qwen3 / Qwen3-MoE models."""

from __future__ import annotations

import pytest
import torch

from mixrl.rl import quant

from ..tiny_models import tiny_qwen3, tiny_qwen3_moe
from . import reference

# ---------------------------------------------------------------------------------------- KV cache


def test_fp8_kv_hand_worked_values() -> None:
    x = torch.tensor([1.0, 1.0625, 500.0, -1000.0, 0.0])
    assert quant.fp8_kv_quant_dequant(x, 1.0).tolist() == [1.0, 1.0, 448.0, -448.0, 0.0]
    # scale 2: 3/2 = 1.5 exact; 900/2 = 450 saturates at 448 -> 896
    assert quant.fp8_kv_quant_dequant(torch.tensor([3.0, 900.0]), torch.tensor(2.0)).tolist() == [3.0, 896.0]


def test_fp8_kv_matches_reference_and_keeps_dtype() -> None:
    x = torch.randn(2, 4, 33, 16, generator=torch.Generator().manual_seed(2)) * 3
    scale = quant.kv_scale_for(x)
    assert scale == pytest.approx(float(x.abs().max()) / 448)
    expected = reference.round_to_grid(x / scale, reference.E4M3).float() * scale
    assert torch.equal(quant.fp8_kv_quant_dequant(x, scale), expected)
    assert quant.fp8_kv_quant_dequant(x.bfloat16(), scale).dtype == torch.bfloat16


def test_fp8_kv_error_is_bounded_by_e4m3_precision() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(4))
    error = quant.relative_error(x, quant.fp8_kv_quant_dequant(x, quant.kv_scale_for(x)))
    assert 0.01 < error < 0.04  # 3 mantissa bits


def test_kv_scale_defaults_to_one_for_zeros() -> None:
    assert quant.kv_scale_for(torch.zeros(8)) == 1.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), torch.tensor([1.0, 2.0])])
def test_bad_kv_scale_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="scale: "):
        quant.fp8_kv_quant_dequant(torch.ones(3), bad)


# ------------------------------------------------------------------------------------ which layers


@pytest.mark.parametrize(
    ("name", "in_features", "fmt", "reason"),
    [
        ("model.embed_tokens", 64, "fp8", "embedding"),
        ("lm_head", 64, "fp8", "lm_head"),
        ("model.layers.0.input_layernorm", 64, "fp8", "norm"),
        ("model.layers.0.mlp.gate", 64, "fp8", "moe router"),
        ("model.layers.0.mlp.shared_expert_gate", 64, "fp8", "moe router"),
        ("model.layers.0.mlp.gate_proj", 64, "nvfp4", None),
        ("model.layers.0.mlp.experts.3.down_proj", 32, "nvfp4", None),
        ("model.layers.0.mlp.down_proj", 40, "nvfp4", "not a multiple of the nvfp4 block 16"),
        ("model.layers.0.mlp.down_proj", 48, "mxfp4", "not a multiple of the mxfp4 block 32"),
        ("model.layers.0.mlp.down_proj", 40, "fp8", None),
    ],
)
def test_kept_reason(name: str, in_features: int, fmt: str, reason: str | None) -> None:
    got = quant.kept_reason(name, in_features, fmt)
    assert got == reason if reason is None else reason in (got or "")


def test_fusion_groups() -> None:
    assert (
        quant.fusion_group("a.self_attn.k_proj")
        == quant.fusion_group("a.self_attn.v_proj")
        == "a.self_attn.qkv"
    )
    assert quant.fusion_group("a.mlp.up_proj") == "a.mlp.gate_up"
    assert quant.fusion_group("a.self_attn.o_proj") is None


# ---------------------------------------------------------------------------------- whole models


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _high_precision(name: str) -> bool:
    return any(key in name for key in ("embed_tokens", "norm", "lm_head", "mlp.gate."))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_dense_model_quantizes_linear_layers_only(fmt: str) -> None:
    model = tiny_qwen3()
    before = _snapshot(model)
    ids = torch.tensor([[1, 5, 9, 12]])
    logits_before = model(ids).logits
    summary = quant.quantize_model_(model, fmt)
    after = dict(model.named_parameters())
    for name, original in before.items():
        if _high_precision(name):
            assert torch.equal(after[name], original), f"{name} must stay in high precision"
        else:
            assert not torch.equal(after[name], original), f"{name} was not quantized"
    assert len(summary["quantized"]) == 2 * 7  # q k v o gate up down per layer
    assert summary["kept"]["lm_head"] == "lm_head" and summary["kept"]["model.norm"] == "norm"
    assert summary["kept"]["model.embed_tokens"] == "embedding"
    o_proj = "model.layers.1.self_attn.o_proj"
    assert torch.equal(after[o_proj + ".weight"], quant.quantize_dequantize(before[o_proj + ".weight"], fmt))
    band = {"fp8": (0.02, 0.03), "nvfp4": (0.08, 0.11), "mxfp4": (0.09, 0.13)}[fmt]
    assert band[0] < summary["mean_relative_error"] < band[1]
    logits_after = model(ids).logits
    assert torch.isfinite(logits_after).all() and not torch.equal(logits_after, logits_before)


def test_nvfp4_shares_the_global_scale_across_fused_matrices() -> None:
    model = tiny_qwen3()
    attention = "model.layers.0.self_attn"
    weights = {
        p: getattr(model.get_submodule(attention), p).weight.detach().clone()
        for p in ("q_proj", "k_proj", "v_proj")
    }
    shared = max(float(w.abs().max()) for w in weights.values())
    quant.quantize_model_(model, "nvfp4")
    for proj, original in weights.items():
        expected = quant.quantize_dequantize(original, "nvfp4", global_amax=shared)
        assert torch.equal(getattr(model.get_submodule(attention), proj).weight, expected)


def test_layers_that_fp4_kernels_cannot_take_are_kept() -> None:
    model = tiny_qwen3(intermediate_size=40)  # down_proj has in_features 40, not a multiple of 16
    down = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    summary = quant.quantize_model_(model, "nvfp4")
    assert "not a multiple" in summary["kept"]["model.layers.0.mlp.down_proj"]
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, down)
    fp8_summary = quant.quantize_model_(tiny_qwen3(intermediate_size=40), "fp8")
    assert "model.layers.0.mlp.down_proj" in fp8_summary["quantized"]


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_moe_model_quantizes_each_expert_and_keeps_the_router(fmt: str) -> None:
    model = tiny_qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    before = _snapshot(model)
    summary = quant.quantize_model_(model, fmt)
    after = dict(model.named_parameters())
    for name, original in before.items():
        changed = not torch.equal(after[name], original)
        assert changed != _high_precision(name), name
    assert summary["kept"]["model.layers.0.mlp.gate"] == "moe router"
    prefix = "model.layers.0.mlp.experts"
    if isinstance(getattr(experts, "gate_up_proj", None), torch.nn.Parameter):  # transformers ≥ 5: fused 3-D
        gate_up = before[prefix + ".gate_up_proj"][2]
        half = gate_up.shape[0] // 2
        amax = gate_up.abs().max() if fmt == "nvfp4" else None
        expected_up = quant.quantize_dequantize(gate_up[half:], fmt, global_amax=amax)
        assert torch.equal(experts.gate_up_proj[2, half:], expected_up)
        expected_down = quant.quantize_dequantize(before[prefix + ".down_proj"][1], fmt)
        assert torch.equal(experts.down_proj[1], expected_down)
        assert {f"{prefix}.2.gate_proj", f"{prefix}.2.up_proj", f"{prefix}.1.down_proj"} <= set(
            summary["quantized"]
        )
    else:  # older transformers: a ModuleList of nn.Linear experts
        assert f"{prefix}.2.up_proj" in summary["quantized"]
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.isfinite(model(ids).logits).all()


def test_quantize_model_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match="fmt: unknown weight format 'fp6'"):
        quant.quantize_model_(tiny_qwen3(), "fp6")
