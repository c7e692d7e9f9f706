"""Activation formats (the GEMM inputs of W8A8 / W4A4 kernels): references, hand-worked cases, refusals."""

from __future__ import annotations

import pytest
import torch

from mixrl.rl import quant

from . import reference


def _activations(seed: int = 3) -> torch.Tensor:
    """[2, 5, 200] with a heavy tail and an outlier token, as hidden states have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 200, generator=g) * torch.rand(2, 5, 1, generator=g) * 4
    x[1, 2, 7] = 300.0
    return x


@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel", "mxfp4", "nvfp4"])
def test_each_activation_format_matches_its_reference(fmt: str) -> None:
    x = _activations()
    rows = x.reshape(-1, 200)
    amax = (
        float(rows.abs().max()) / 2 if fmt == "nvfp4" else None
    )  # calibrated below the outlier: it saturates
    expected = {
        "fp8": lambda: reference.fp8_token_groups(rows, 128),
        "fp8_channel": lambda: reference.fp8_channel(rows),
        "mxfp4": lambda: reference.mxfp4(rows),
        "nvfp4": lambda: reference.nvfp4(rows, global_amax=amax),
    }[fmt]()
    got = quant.quantize_activation(x, fmt, amax=amax)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got.reshape(-1, 200), expected)
    assert got.bfloat16().dtype == torch.bfloat16
    assert quant.quantize_activation(x.bfloat16(), fmt, amax=amax).dtype == torch.bfloat16


def test_scales_are_per_token_and_per_group() -> None:
    quiet = torch.full((1, 256), 0.3)
    loud = quiet.clone()
    loud[0, 200] = 400.0  # an outlier in the second group of the second token
    x = torch.cat([quiet, loud])
    for fmt in ("fp8", "fp8_channel"):
        out = quant.quantize_activation(x, fmt)
        assert torch.equal(out[0], quant.quantize_activation(quiet, fmt)[0])  # tokens do not share scales
    grouped, per_token = quant.quantize_activation(x, "fp8"), quant.quantize_activation(x, "fp8_channel")
    # per 1×128 group the outlier leaves the first group's 0.3s alone; one scale per token flushes
    # them to E4M3's coarse low range (0.3 / (400 / 448) lands between subnormal steps)
    assert torch.equal(grouped[1, :128], grouped[0, :128])
    assert not torch.equal(per_token[1, :128], per_token[0, :128])


def test_nvfp4_saturates_beyond_the_calibrated_max() -> None:
    x = torch.tensor([[10.0, -10.0, 0.5] + [0.0] * 13])
    out = quant.quantize_activation(x, "nvfp4", amax=1.0)
    assert out[0, 0].item() == pytest.approx(1.0) and out[0, 1].item() == pytest.approx(-1.0)
    assert quant.quantize_activation(x, "nvfp4", amax=10.0)[0, 0].item() == pytest.approx(10.0)


def test_bf16_keeps_its_inputs_and_the_scale_rule_is_enforced() -> None:
    x = _activations()
    assert quant.quantize_activation(x, "bf16") is x
    with pytest.raises(ValueError, match="amax: nvfp4 activations need"):
        quant.quantize_activation(x, "nvfp4")
    with pytest.raises(ValueError, match="amax"):
        quant.quantize_activation(x, "fp8", amax=1.0)
    with pytest.raises(ValueError, match="fmt: unknown weight format"):
        quant.quantize_activation(x, "int8")
    assert set(quant.ACTIVATION_SCHEMES) == set(quant.WEIGHT_FORMATS)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel", "mxfp4", "nvfp4"])
def test_a_non_finite_token_comes_out_nan_and_leaves_the_others_alone(fmt: str) -> None:
    x = torch.full((3, 32), 0.5)
    x[0, 1], x[2, 5] = float("nan"), float("inf")
    out = quant.quantize_activation(x, fmt, amax=1.0 if fmt == "nvfp4" else None)  # no refusal mid-forward
    assert torch.isnan(out[0]).all() and torch.isnan(out[2]).all()  # never silently finite
    assert torch.equal(out[1], torch.full((32,), 0.5))
