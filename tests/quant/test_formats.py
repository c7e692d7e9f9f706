"""Weight formats: hand-worked cases, float64 references, error bands, packed round trips."""

from __future__ import annotations

import pytest
import torch

from mixrl.rl import quant

from . import reference

P = 2.0**-10  # a power of two keeps every hand-worked product exact in float32


# ---------------------------------------------------------------------------------------------- E2M1


def test_e2m1_rounding_at_every_threshold_ties_to_even() -> None:
    cases = {
        0.0: 0.0,
        0.25: 0.0,  # tie 0 | 0.5 -> 0 (even)
        0.2500001: 0.5,
        0.74999: 0.5,
        0.75: 1.0,  # tie 0.5 | 1 -> 1
        1.25: 1.0,  # tie 1 | 1.5 -> 1
        1.75: 2.0,  # tie 1.5 | 2 -> 2
        2.5: 2.0,  # tie 2 | 3 -> 2
        2.50001: 3.0,
        3.5: 4.0,  # tie 3 | 4 -> 4
        5.0: 4.0,  # tie 4 | 6 -> 4
        5.00001: 6.0,
        6.0: 6.0,
        7.9: 6.0,  # saturates
        1e30: 6.0,
    }
    x = torch.tensor(list(cases), dtype=torch.float32)
    expected = torch.tensor(list(cases.values()))
    assert torch.equal(quant.e2m1_round(x), expected)
    assert torch.equal(quant.e2m1_round(-x), -expected)
    assert torch.equal(quant.e2m1_decode(quant.e2m1_codes(-x)), -expected)


def test_e2m1_threshold_rounding_matches_enumeration() -> None:
    generator = torch.Generator().manual_seed(0)
    ties = torch.arange(-64, 65, dtype=torch.float32) / 8  # every multiple of 1/8 in [-8, 8]
    x = torch.cat([ties, torch.randn(4000, generator=generator) * 3])
    assert torch.equal(quant.e2m1_round(x), reference.round_to_grid(x, reference.E2M1).float())


def test_nibbles_put_the_even_element_in_the_low_half() -> None:
    codes = torch.tensor([[0x1, 0xF, 0x7, 0x8]], dtype=torch.uint8)
    packed = quant.pack_nibbles(codes)
    assert packed.tolist() == [[0xF1, 0x87]]
    assert torch.equal(quant.unpack_nibbles(packed), codes)


# --------------------------------------------------------------------------------------- hand cases


def test_nvfp4_hand_worked_blocks() -> None:
    # global amax 2.625 = 6·448·2^-10 -> global scale exactly 2^-10.
    ties = [6, -6, 3, 2.5, 1.5, 1.25, 1, 0.75, 0.5, 0.25, 0, 5, 3.5, 1.75, 0.3, -2.5]
    rounded = [6, -6, 3, 2, 1.5, 1, 1, 1, 0.5, 0, 0, 4, 4, 2, 0.5, -2]
    rows = torch.zeros(1, 5 * 16)
    rows[0, 0:16] = torch.tensor(ties) * 4 * P  # block scale 6·4·P / (6·P) = 4
    # 16:32 all zero -> block scale 1, codes 0
    rows[0, 32] = 6 * 2.0**-8 * P  # block scale 2^-8: an E4M3 subnormal, still exact
    rows[0, 48] = 6 * 2.0**-12 * P  # block scale 2^-12 < 2^-9 -> clamped to 2^-9; 0.75 -> 1
    rows[0, 64] = 6 * 4.2 * P  # block scale 4.2 rounds down to 4.0 in E4M3: 6.3 saturates to 6
    out = quant.quantize_dequantize(rows, "nvfp4", global_amax=2.625)
    assert out[0, 0:16].tolist() == [v * 4 * P for v in rounded]
    assert out[0, 16:32].abs().sum() == 0
    assert out[0, 32].item() == 6 * 2.0**-8 * P
    assert out[0, 48].item() == 2.0**-9 * P
    assert out[0, 64].item() == 6 * 4.0 * P
    packed = quant.pack(rows, "nvfp4", global_amax=2.625)
    assert packed["weight_scale"].float().tolist() == [[4.0, 1.0, 2.0**-8, 2.0**-9, 4.0]]
    assert packed["weight_scale_2"].item() == P
    assert packed["weight"][0, 0].item() == 0xF7  # +6 (0x7) low, -6 (0xF) high


@pytest.mark.parametrize("shared", [float("inf"), float("nan"), 0.5])
def test_an_nvfp4_global_amax_must_be_finite_and_cover_the_weight(shared: float) -> None:
    with pytest.raises(ValueError, match="global_amax: must be one finite number at least"):
        quant.quantize_dequantize(torch.ones(2, 16), "nvfp4", global_amax=shared)


def test_mxfp4_hand_worked_blocks() -> None:
    rows = torch.zeros(1, 5 * 32)
    rows[0, 0:6] = torch.tensor([1.0, 0.75, 0.625, -0.3125, 0.0625, 0.1])  # amax 1 -> X = 2^-2
    rows[0, 32] = 1.9  # floor(log2 1.9) - 2 = -2: 1.9/0.25 = 7.6 is clipped to 6 -> 1.5
    rows[0, 64] = 2.0**-130  # float32 subnormal: exponent -132 clamps to -127, value rounds to 0
    # 96:128 all zero -> exponent -127 (E8M0 code 0)
    rows[0, 128] = 1.5 * 2.0**127  # exponent 125, code 252
    out = quant.quantize_dequantize(rows, "mxfp4")
    # 0.625/0.25 = 2.5 ties to 2; 0.3125/0.25 = 1.25 ties to 1; 0.0625/0.25 = 0.25 ties to 0; 0.4 -> 0.5
    assert out[0, 0:6].tolist() == [1.0, 0.75, 0.5, -0.25, 0.0, 0.125]
    assert out[0, 32].item() == 1.5
    assert out[0, 64].item() == 0.0
    assert out[0, 128].item() == 1.5 * 2.0**127
    assert quant.pack(rows, "mxfp4")["weight_scale"].tolist() == [[125, 125, 0, 0, 252]]


def test_fp8_block_hand_worked_tile() -> None:
    w = torch.zeros(130, 200)
    w[0, :4] = torch.tensor([448.0, 1.0625, 17.0, -500.0 / 1.2])  # tile amax 448 -> scale 1
    w[129, 199] = 896.0  # a tile of its own in both directions -> scale 2
    out = quant.quantize_dequantize(w, "fp8")
    # 1.0625 ties between 1 and 1.125 -> 1; 17 ties between 16 and 18 -> 16; 416.67 -> 416
    assert out[0, :4].tolist() == [448.0, 1.0, 16.0, -416.0]
    assert out[129, 199].item() == 896.0
    scales = quant.pack(w, "fp8")["weight_scale_inv"]
    empty_tile = torch.tensor(1e-12) / 448  # all-zero tiles keep the eps scale; their codes are 0
    assert torch.equal(
        scales,
        torch.stack(
            [torch.stack([torch.tensor(1.0), empty_tile]), torch.stack([empty_tile, torch.tensor(2.0)])]
        ),
    )


def test_fp8_scales_are_amax_over_448_per_tile_and_per_row() -> None:
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(200, 300, generator=generator)
    scales = quant.pack(w, "fp8")["weight_scale_inv"]
    assert scales.shape == (2, 3)
    assert scales[1, 2] == w[128:, 256:].abs().max() / 448
    rows = quant.pack(w, "fp8_channel")["weight_scale"]
    assert rows.shape == (200, 1)
    assert torch.equal(rows[:, 0], w.abs().amax(dim=1) / 448)


# ------------------------------------------------------------------------------ float64 references

SHAPES = [(3, 53), (130, 200), (16, 64)]  # not block multiples, and one that is


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_matches_reference(shape: tuple[int, int]) -> None:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 0.02
    assert torch.equal(quant.quantize_dequantize(w, "fp8"), reference.fp8_block(w))
    assert torch.equal(quant.quantize_dequantize(w, "fp8_channel"), reference.fp8_channel(w))


@pytest.mark.parametrize("shape", SHAPES)
def test_fp4_formats_match_reference(shape: tuple[int, int]) -> None:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(6)) * 0.02
    w[0, : min(16, shape[1])] = 0.0  # an all-zero block
    w[-1, -1] = 0.5  # one outlier: other blocks get small (subnormal E4M3) NVFP4 scales
    assert torch.equal(quant.quantize_dequantize(w, "mxfp4"), reference.mxfp4(w))
    assert torch.equal(quant.quantize_dequantize(w, "nvfp4"), reference.nvfp4(w))
    assert torch.equal(quant.quantize_dequantize(w, "nvfp4", global_amax=2.0), reference.nvfp4(w, 2.0))


def test_large_weights_take_the_chunked_path_identically() -> None:
    # 1100 rows × 1024 spans two row chunks; the per-row formats must not depend on chunking.
    w = torch.randn(1100, 1024, generator=torch.Generator().manual_seed(8)) * 0.02
    for fmt in ("mxfp4", "nvfp4"):
        whole = quant.quantize_dequantize(w, fmt)
        first = quant.quantize_dequantize(w[:600], fmt, global_amax=w.abs().max() if fmt == "nvfp4" else None)
        assert torch.equal(whole[:600], first)


# ------------------------------------------------------------------------------------ error bands

BANDS = {"bf16": (0.0005, 0.003), "fp8": (0.024, 0.029), "fp8_channel": (0.024, 0.029)}
BANDS |= {"nvfp4": (0.090, 0.100), "mxfp4": (0.105, 0.120)}


@pytest.mark.parametrize("fmt", quant.WEIGHT_FORMATS)
def test_relative_error_band_on_gaussian_weights(fmt: str, gaussian_weight: torch.Tensor) -> None:
    low, high = BANDS[fmt]
    error = quant.relative_error(gaussian_weight, quant.quantize_dequantize(gaussian_weight, fmt))
    assert low < error < high, f"{fmt}: relative error {error:.4f} outside [{low}, {high}]"


# ------------------------------------------------------------------------------------ packed forms


@pytest.mark.parametrize("fmt", quant.WEIGHT_FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_round_trip_is_exact(fmt: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(9)) * 0.02).to(dtype)
    packed = quant.pack(w, fmt)
    assert set(packed) == set(quant.packed_keys(fmt))
    assert torch.equal(quant.unpack(packed, fmt, w.shape, dtype=dtype), quant.quantize_dequantize(w, fmt))


def test_packed_layouts_match_the_checkpoint_formats() -> None:
    w = torch.randn(256, 96)
    fp8 = quant.pack(w, "fp8")
    assert (fp8["weight"].dtype, fp8["weight"].shape) == (torch.float8_e4m3fn, (256, 96))
    assert (fp8["weight_scale_inv"].dtype, fp8["weight_scale_inv"].shape) == (torch.float32, (2, 1))
    nv = quant.pack(w, "nvfp4")
    assert (nv["weight"].dtype, nv["weight"].shape) == (torch.uint8, (256, 48))
    assert (nv["weight_scale"].dtype, nv["weight_scale"].shape) == (torch.float8_e4m3fn, (256, 6))
    assert (nv["weight_scale_2"].dtype, nv["weight_scale_2"].shape) == (torch.float32, ())
    mx = quant.pack(w, "mxfp4")
    assert (mx["weight"].dtype, mx["weight"].shape) == (torch.uint8, (256, 48))
    assert (mx["weight_scale"].dtype, mx["weight_scale"].shape) == (torch.uint8, (256, 3))


# -------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: quant.quantize_dequantize(torch.zeros(2, 2), "int4"), "fmt: unknown weight format"),
        (lambda: quant.quantize_dequantize(torch.zeros(2, 2, 2), "fp8"), "weight: expected a 2-D"),
        (lambda: quant.pack(torch.tensor([[1.0, float("nan")]]), "nvfp4"), "weight: contains NaN"),
        (
            lambda: quant.quantize_dequantize(torch.zeros(2, 2, dtype=torch.int32), "fp8"),
            "weight: expected a float",
        ),
        (
            lambda: quant.quantize_dequantize(torch.ones(2, 2), "fp8", global_amax=1.0),
            "global_amax: only nvfp4",
        ),
        (
            lambda: quant.quantize_dequantize(torch.ones(2, 2), "nvfp4", global_amax=0.5),
            "global_amax: must be",
        ),
        (lambda: quant.unpack({"weight": torch.zeros(1)}, "fp8", (1, 1)), "tensors: fp8 needs keys"),
    ],
)
def test_bad_input_names_the_argument(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
