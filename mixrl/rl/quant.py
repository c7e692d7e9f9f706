"""Precision emulation: what a sampler's weights and KV cache look like at its serving precision.

Every format follows its published recipe (docs/precisions.md states each rule, its source and the
measured error bands). Weights are quantized once and dequantized back to the caller's dtype
("fake quantization"), so a torch model runs at the numbers the real kernels would see. The packed
forms (`pack` / `unpack`) hold the same numbers as checkpoint tensors, bit for bit.

Formats (all symmetric, all computed in float32):
- ``bf16``        round to bfloat16.
- ``fp8``         E4M3 with one FP32 scale per 128×128 tile (Qwen / DeepSeek FP8 checkpoints).
- ``fp8_channel`` E4M3 with one FP32 scale per output channel (row).
- ``mxfp4``       OCP MX: blocks of 32 along the last dim, E2M1 elements, E8M0 power-of-two scale
                  chosen by the specification rule ``floor(log2 amax) − 2``.
- ``nvfp4``       ModelOpt: blocks of 16, E2M1 elements, E4M3 block scale, FP32 per-tensor scale.

Pure torch: no HTTP, Kubernetes or file I/O here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

WEIGHT_FORMATS = ("bf16", "fp8", "fp8_channel", "mxfp4", "nvfp4")

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_TILE = 128
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
E8M0_BIAS = 127
# Avoids 0/0 for an all-zero tile or row; any positive value gives the same (zero) codes there.
FP8_SCALE_EPS = 1e-12
NVFP4_MIN_BLOCK_SCALE = 2.0**-9  # smallest E4M3 subnormal

# E2M1 magnitudes by 3-bit code; the 4th bit is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round-to-nearest-even decision points between consecutive magnitudes. At a midpoint the value goes
# to the neighbour with the even code: "strict" points round a tie down, "inclusive" points round it up.
# |x| ≤ 0.25 → 0, < 0.75 → 0.5, ≤ 1.25 → 1, < 1.75 → 1.5, ≤ 2.5 → 2, < 3.5 → 3, ≤ 5 → 4, else 6.
_E2M1_THRESHOLDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)

# Rows per chunk: keeps every float32 temporary of a 4096-wide weight within ~4 MB (cache sized).
_CHUNK_ELEMENTS = 1 << 20


def _check_format(fmt: str) -> None:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"fmt: unknown weight format {fmt!r}; expected one of {', '.join(WEIGHT_FORMATS)}")


def _check_weight(weight: Tensor) -> None:
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        raise ValueError("weight: expected a floating-point torch.Tensor")
    if weight.ndim != 2:
        raise ValueError(
            f"weight: expected a 2-D [out_features, in_features] matrix, got shape {tuple(weight.shape)} "
            "(quantize stacked expert weights one expert at a time)"
        )
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight: contains NaN or infinity; refusing to quantize")


def _row_chunks(rows: int, width: int) -> Iterator[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(width, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _pad_last(x: Tensor, multiple: int) -> Tensor:
    pad = -x.shape[-1] % multiple
    return nn.functional.pad(x, (0, pad)) if pad else x


def _pow2(exponent: Tensor) -> Tensor:
    """Exact 2**e in float32 for integer e in [-149, 127] (exp2 is exact on integers)."""
    return torch.exp2(exponent.to(torch.float32))


# ---------------------------------------------------------------------------------------------- E2M1


def e2m1_index(magnitude: Tensor) -> Tensor:
    """3-bit E2M1 code (0..7, uint8) of non-negative values by threshold counting, saturating at 6."""
    index = torch.zeros(magnitude.shape, dtype=torch.uint8, device=magnitude.device)
    for threshold, tie_rounds_up in _E2M1_THRESHOLDS:
        index += (magnitude >= threshold) if tie_rounds_up else (magnitude > threshold)
    return index


def e2m1_codes(x: Tensor) -> Tensor:
    """4-bit E2M1 codes (uint8, sign in bit 3) of values already divided by their block scale."""
    return e2m1_index(x.abs()) | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor) -> Tensor:
    """float32 values of 4-bit E2M1 codes."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return torch.take(table, codes.to(torch.int64))


def e2m1_round(x: Tensor) -> Tensor:
    """x rounded to the nearest E2M1 value (ties to even, saturating at ±6), as float32."""
    table = torch.tensor(E2M1_VALUES, device=x.device)
    magnitude = torch.take(table, e2m1_index(x.abs()).to(torch.int64))
    return torch.copysign(magnitude, x.to(torch.float32))


def pack_nibbles(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte along the last dim: even element in the low nibble (ModelOpt, OCP)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8, device=packed.device)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


# ----------------------------------------------------------------------------------------- FP8 E4M3


def _fp8_codes(scaled: Tensor) -> Tensor:
    # Clamp before casting: older torch releases turned values above 464 into NaN.
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _tiles(x: Tensor) -> Tensor:
    """Zero-padded [N, K] seen as [⌈N/128⌉, 128, ⌈K/128⌉, 128] tiles."""
    n, k = x.shape
    padded = nn.functional.pad(x, (0, -k % FP8_TILE, 0, -n % FP8_TILE))
    return padded.view(padded.shape[0] // FP8_TILE, FP8_TILE, padded.shape[1] // FP8_TILE, FP8_TILE)


def _untile(tiles: Tensor, n: int, k: int) -> Tensor:
    return tiles.reshape(tiles.shape[0] * FP8_TILE, -1)[:n, :k]


def _fp8_block_parts(w: Tensor) -> tuple[Tensor, Tensor]:
    """E4M3 codes [N, K] and one scale per 128×128 tile, max(amax, eps) / 448, [⌈N/128⌉, ⌈K/128⌉]."""
    tiles = _tiles(w)
    scales = tiles.abs().amax(dim=(1, 3)).clamp(min=FP8_SCALE_EPS) / E4M3_MAX
    codes = _fp8_codes(tiles / scales[:, None, :, None])
    return _untile(codes, *w.shape), scales


def _fp8_block_dequant(codes: Tensor, scales: Tensor) -> Tensor:
    tiles = _tiles(codes.to(torch.float32))
    return _untile(tiles * scales[:, None, :, None], *codes.shape)


def _fp8_channel_parts(w: Tensor) -> tuple[Tensor, Tensor]:
    scales = w.abs().amax(dim=1, keepdim=True).clamp(min=FP8_SCALE_EPS) / E4M3_MAX
    return _fp8_codes(w / scales), scales


def _fp8_dequant(codes: Tensor, expanded_scales: Tensor) -> Tensor:
    return codes.to(torch.float32) * expanded_scales


# -------------------------------------------------------------------------------------------- MXFP4


def _mxfp4_exponents(blocks: Tensor) -> Tensor:
    """Shared exponent per block: floor(log2 amax) − 2, clamped to [-127, 127]; -127 for a zero block."""
    amax = blocks.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m · 2^e with m in [0.5, 1), so floor(log2 amax) = e − 1
    shared = (exponent - 1 - 2).clamp(-E8M0_BIAS, E8M0_BIAS)
    return torch.where(amax > 0, shared, torch.full_like(shared, -E8M0_BIAS))


def _mxfp4_chunk(w: Tensor) -> tuple[Tensor, Tensor]:
    """Codes [R, nb, 32] and shared exponents [R, nb] of one chunk of rows."""
    blocks = _pad_last(w, MXFP4_BLOCK).view(w.shape[0], -1, MXFP4_BLOCK)
    shared = _mxfp4_exponents(blocks)
    return e2m1_codes(blocks * _pow2(-shared).unsqueeze(-1)), shared


def _mxfp4_qdq_chunk(w: Tensor) -> Tensor:
    blocks = _pad_last(w, MXFP4_BLOCK).view(w.shape[0], -1, MXFP4_BLOCK)
    shared = _mxfp4_exponents(blocks)
    values = e2m1_round(blocks * _pow2(-shared).unsqueeze(-1))
    return (values * _pow2(shared).unsqueeze(-1)).flatten(1)[:, : w.shape[1]]


def _mxfp4_dequant(codes: Tensor, shared: Tensor, k: int) -> Tensor:
    return (e2m1_decode(codes) * _pow2(shared).unsqueeze(-1)).flatten(1)[:, :k]


# -------------------------------------------------------------------------------------------- NVFP4


def nvfp4_global_scale(amax: float | Tensor) -> Tensor:
    """Per-tensor FP32 scale amax / (6 · 448); 1 for an all-zero tensor (its codes are all zero)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def _nvfp4_block_scales(blocks: Tensor, global_scale: Tensor) -> Tensor:
    """E4M3 scale per 16-block: clamp(amax / (6 · global), 2^-9, 448); all-zero blocks use 1."""
    amax = blocks.abs().amax(dim=-1)
    scale = (amax / (E2M1_MAX * global_scale)).clamp(NVFP4_MIN_BLOCK_SCALE, E4M3_MAX)
    return torch.where(amax > 0, scale, torch.ones_like(scale)).to(torch.float8_e4m3fn)


def _nvfp4_divisor(block_scales: Tensor, global_scale: Tensor) -> Tensor:
    # One definition shared by quantize, dequantize and unpack, so the three agree bit for bit.
    return (block_scales.to(torch.float32) * global_scale).unsqueeze(-1)


def _nvfp4_chunk(w: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    blocks = _pad_last(w, NVFP4_BLOCK).view(w.shape[0], -1, NVFP4_BLOCK)
    block_scales = _nvfp4_block_scales(blocks, global_scale)
    return e2m1_codes(blocks / _nvfp4_divisor(block_scales, global_scale)), block_scales


def _nvfp4_qdq_chunk(w: Tensor, global_scale: Tensor) -> Tensor:
    blocks = _pad_last(w, NVFP4_BLOCK).view(w.shape[0], -1, NVFP4_BLOCK)
    divisor = _nvfp4_divisor(_nvfp4_block_scales(blocks, global_scale), global_scale)
    return (e2m1_round(blocks / divisor) * divisor).flatten(1)[:, : w.shape[1]]


def _nvfp4_dequant(codes: Tensor, block_scales: Tensor, global_scale: Tensor, k: int) -> Tensor:
    return (e2m1_decode(codes) * _nvfp4_divisor(block_scales, global_scale)).flatten(1)[:, :k]


def _resolve_global_amax(weight: Tensor, fmt: str, global_amax: float | Tensor | None) -> Tensor | None:
    if fmt != "nvfp4":
        if global_amax is not None:
            raise ValueError(f"global_amax: only nvfp4 has a per-tensor scale, not {fmt!r}")
        return None
    own_amax = weight.abs().amax().to(torch.float32)
    if global_amax is None:
        return own_amax
    shared = torch.as_tensor(global_amax, dtype=torch.float32)
    if shared.numel() != 1 or not bool(torch.isfinite(shared)) or not bool(shared >= own_amax):
        raise ValueError("global_amax: must be one finite number at least the weight's own max |w|")
    return shared.reshape(())


# ----------------------------------------------------------------------------------------- public


def quantize_dequantize(weight: Tensor, fmt: str, *, global_amax: float | Tensor | None = None) -> Tensor:
    """The weight as the serving kernels see it in ``fmt``, in the weight's own shape and dtype.

    ``weight`` is one [out_features, in_features] matrix; blocks run along in_features and a shape
    that is not a block multiple is zero-padded internally. ``global_amax`` (nvfp4 only) shares one
    per-tensor scale across matrices a serving stack fuses (q/k/v, gate/up), as ModelOpt exports them.
    """
    _check_format(fmt)
    _check_weight(weight)
    amax = _resolve_global_amax(weight, fmt, global_amax)
    if fmt == "bf16":
        return weight.to(torch.bfloat16).to(weight.dtype)
    w = weight.to(torch.float32)
    if fmt == "fp8":
        return _fp8_block_dequant(*_fp8_block_parts(w)).to(weight.dtype)
    if fmt == "fp8_channel":
        codes, scales = _fp8_channel_parts(w)
        return _fp8_dequant(codes, scales).to(weight.dtype)
    out = torch.empty_like(weight)
    global_scale = nvfp4_global_scale(amax) if amax is not None else None
    for rows in _row_chunks(*w.shape):
        if global_scale is None:
            out[rows] = _mxfp4_qdq_chunk(w[rows])
        else:
            out[rows] = _nvfp4_qdq_chunk(w[rows], global_scale)
    return out


def pack(weight: Tensor, fmt: str, *, global_amax: float | Tensor | None = None) -> dict[str, Tensor]:
    """Checkpoint tensors of one linear weight in ``fmt`` (key suffixes after ``<module>.``).

    - bf16:        ``weight`` bfloat16 [N, K]
    - fp8:         ``weight`` float8_e4m3fn [N, K], ``weight_scale_inv`` float32 [⌈N/128⌉, ⌈K/128⌉]
    - fp8_channel: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` float32 [N, 1]
    - mxfp4:       ``weight`` uint8 [N, ⌈K/32⌉·16] (two E2M1 codes a byte, even element low),
                   ``weight_scale`` uint8 E8M0 [N, ⌈K/32⌉] (Quark / OCP layout)
    - nvfp4:       ``weight`` uint8 [N, ⌈K/16⌉·8], ``weight_scale`` float8_e4m3fn [N, ⌈K/16⌉],
                   ``weight_scale_2`` float32 scalar (ModelOpt layout)
    Dequantize by multiplying (code · scale). K that is not a block multiple is zero-padded.
    """
    _check_format(fmt)
    _check_weight(weight)
    amax = _resolve_global_amax(weight, fmt, global_amax)
    if fmt == "bf16":
        return {"weight": weight.to(torch.bfloat16).contiguous()}
    w = weight.to(torch.float32)
    if fmt == "fp8":
        codes, scales = _fp8_block_parts(w)
        return {"weight": codes.contiguous(), "weight_scale_inv": scales}
    if fmt == "fp8_channel":
        codes, scales = _fp8_channel_parts(w)
        return {"weight": codes, "weight_scale": scales}
    packed: list[Tensor] = []
    block_scales: list[Tensor] = []
    global_scale = nvfp4_global_scale(amax) if amax is not None else None
    for rows in _row_chunks(*w.shape):
        if global_scale is None:
            codes, shared = _mxfp4_chunk(w[rows])
            block_scales.append((shared + E8M0_BIAS).to(torch.uint8))
        else:
            codes, chunk_scales = _nvfp4_chunk(w[rows], global_scale)
            block_scales.append(chunk_scales)
        packed.append(pack_nibbles(codes.flatten(1)))
    tensors = {"weight": torch.cat(packed), "weight_scale": torch.cat(block_scales)}
    if global_scale is not None:
        tensors["weight_scale_2"] = global_scale.reshape(())
    return tensors


_PACKED_KEYS = {
    "bf16": ("weight",),
    "fp8": ("weight", "weight_scale_inv"),
    "fp8_channel": ("weight", "weight_scale"),
    "mxfp4": ("weight", "weight_scale"),
    "nvfp4": ("weight", "weight_scale", "weight_scale_2"),
}


def packed_keys(fmt: str) -> tuple[str, ...]:
    """Key suffixes `pack` writes for ``fmt``."""
    _check_format(fmt)
    return _PACKED_KEYS[fmt]


def unpack(
    tensors: dict[str, Tensor],
    fmt: str,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Dequantize `pack`'s tensors back to a [N, K] matrix: equals ``quantize_dequantize`` exactly."""
    _check_format(fmt)
    missing = [key for key in _PACKED_KEYS[fmt] if key not in tensors]
    if missing:
        raise ValueError(
            f"tensors: {fmt} needs keys {', '.join(_PACKED_KEYS[fmt])}; missing {', '.join(missing)}"
        )
    if len(shape) != 2:
        raise ValueError(f"shape: expected [out_features, in_features], got {tuple(shape)}")
    n, k = (int(s) for s in shape)
    codes = tensors["weight"]
    if fmt == "bf16":
        return codes.reshape(n, k).to(dtype)
    if fmt == "fp8":
        return _fp8_block_dequant(codes.reshape(n, k), tensors["weight_scale_inv"].float()).to(dtype)
    if fmt == "fp8_channel":
        return _fp8_dequant(codes, tensors["weight_scale"].float().reshape(n, 1)).to(dtype)
    block = MXFP4_BLOCK if fmt == "mxfp4" else NVFP4_BLOCK
    nibbles = unpack_nibbles(codes).view(n, -1, block)
    if fmt == "mxfp4":
        shared = tensors["weight_scale"].to(torch.int32) - E8M0_BIAS
        return _mxfp4_dequant(nibbles, shared, k).to(dtype)
    global_scale = tensors["weight_scale_2"].to(torch.float32).reshape(())
    return _nvfp4_dequant(nibbles, tensors["weight_scale"], global_scale, k).to(dtype)


# ------------------------------------------------------------------------------------ FP8 KV cache


def _check_kv_scale(scale: float | Tensor) -> float | Tensor:
    if isinstance(scale, Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale: KV-cache scale is one number per layer, got shape {tuple(scale.shape)}")
        if scale.device.type != "cpu":
            return scale.to(torch.float32).reshape(())  # no host sync on an accelerator
        value = float(scale)
    else:
        value = float(scale)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"scale: KV-cache scale must be a positive finite number, got {value}")
    return scale.to(torch.float32).reshape(()) if isinstance(scale, Tensor) else value


def fp8_kv_quant_dequant(x: Tensor, scale: float | Tensor = 1.0) -> Tensor:
    """Keys or values as an FP8 E4M3 KV cache stores them: x/scale, clamp ±448, cast, times scale.

    SGLang does not clamp before its cast; its CUDA cast saturates at ±448 like torch's CPU cast in
    2.13, so the clamp changes nothing there and protects torch releases whose cast produced NaN.
    """
    s = _check_kv_scale(scale)
    return (_fp8_codes(x.to(torch.float32) / s).to(torch.float32) * s).to(x.dtype)


def kv_scale_for(x: Tensor) -> float:
    """Calibration scale amax / 448 from sample keys or values (1.0, the default, for all zeros)."""
    amax = float(x.detach().abs().amax()) if x.numel() else 0.0
    if amax != amax or amax == float("inf"):
        raise ValueError("x: contains NaN or infinity; cannot calibrate a KV-cache scale")
    return amax / E4M3_MAX if amax > 0 else 1.0


# ------------------------------------------------------------------------- which weights to quantize

_ROUTER_NAME = re.compile(r"(^|_)gate$|router")
_FUSED_GROUPS = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
}


def kept_reason(module_name: str, in_features: int, fmt: str) -> str | None:
    """Why a linear layer stays in high precision, or None when it is quantized.

    Serving stacks (SGLang, ModelOpt, the Qwen FP8 checkpoints) keep embeddings, the LM head, norms
    and the MoE router unquantized: they are small, and the router's top-k choice and the output
    logits are the most sensitive to error. FP4 kernels also need in_features to be a block multiple.
    """
    parts = module_name.split(".")
    last = parts[-1]
    if any("embed" in part for part in parts):
        return "embedding"
    if last == "lm_head":
        return "lm_head"
    if any("norm" in part for part in parts):
        return "norm"
    if _ROUTER_NAME.search(last):
        return "moe router"
    block = {"mxfp4": MXFP4_BLOCK, "nvfp4": NVFP4_BLOCK}.get(fmt)
    if block and in_features % block:
        return f"in_features {in_features} is not a multiple of the {fmt} block {block}"
    return None


def fusion_group(module_name: str) -> str | None:
    """Matrices a serving stack runs as one GEMM (q/k/v, gate/up); they share an NVFP4 global scale."""
    parent, _, last = module_name.rpartition(".")
    group = _FUSED_GROUPS.get(last)
    return f"{parent}.{group}" if group else None


def relative_error(reference: Tensor, approximation: Tensor) -> float:
    """‖approximation − reference‖_F / ‖reference‖_F, in float64."""
    ref = reference.to(torch.float64)
    norm = float(ref.norm())
    return float((approximation.to(torch.float64) - ref).norm()) / norm if norm > 0 else 0.0


@dataclass
class _Target:
    """One checkpoint matrix inside a model parameter: ``view`` is written in place."""

    name: str
    view: Tensor
    group: str | None


def _expert_targets(name: str, module: nn.Module) -> list[_Target]:
    """Per-expert checkpoint matrices of a fused experts module ([E, out, in] parameters)."""
    targets: list[_Target] = []
    for pname, param in module.named_parameters(recurse=False):
        if param.ndim != 3:
            continue
        if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
            raise ValueError(f"model: experts {name!r} use a transposed or interleaved layout, not supported")
        for expert in range(param.shape[0]):
            matrix = param.data[expert]
            if pname == "gate_up_proj":
                half = matrix.shape[0] // 2
                group = f"{name}.{expert}.gate_up"
                targets.append(_Target(f"{name}.{expert}.gate_proj", matrix[:half], group))
                targets.append(_Target(f"{name}.{expert}.up_proj", matrix[half:], group))
            else:
                targets.append(_Target(f"{name}.{expert}.{pname}", matrix, fusion_group(f"{name}.{pname}")))
    return targets


def _model_targets(model: nn.Module) -> tuple[list[_Target], dict[str, str]]:
    """Every linear weight matrix of the model, and the modules whose parameters are left alone."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    output_embeddings = get_output_embeddings() if callable(get_output_embeddings) else None
    targets: list[_Target] = []
    untouched: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if module is output_embeddings:
                untouched[name] = "lm_head"
            else:
                targets.append(_Target(name, module.weight.data, fusion_group(name)))
        elif any(p.ndim == 3 for p in module.parameters(recurse=False)):
            targets += _expert_targets(name, module)
        elif any(True for _ in module.parameters(recurse=False)):
            untouched[name] = kept_reason(name, 0, "bf16") or "not a linear layer"
    return targets, untouched


@torch.no_grad()
def quantize_model_(model: nn.Module, fmt: str) -> dict:
    """Quantize-dequantize every linear weight of a transformers causal LM in place.

    Linear layers and fused MoE expert tensors (one [out, in] matrix per expert, gate and up apart, as
    checkpoints store them) are quantized; embeddings, the LM head, norms and MoE routers are kept
    (see `kept_reason`). With nvfp4, q/k/v and gate/up share one global scale, as in ModelOpt exports.
    Returns {"format", "quantized": [names], "kept": {name: reason}, "relative_error": {name: err},
    "mean_relative_error"}, errors being Frobenius-norm ratios.
    """
    _check_format(fmt)
    targets, kept = _model_targets(model)
    chosen: list[_Target] = []
    for target in targets:
        reason = kept_reason(target.name, target.view.shape[-1], fmt)
        if reason:
            kept[target.name] = reason
        else:
            chosen.append(target)
    group_amax: dict[str, Tensor] = {}
    if fmt == "nvfp4":
        for target in chosen:
            if target.group:
                amax = target.view.abs().amax().float()
                group_amax[target.group] = torch.maximum(group_amax.get(target.group, amax), amax)
    errors: dict[str, float] = {}
    for target in chosen:
        shared = group_amax.get(target.group) if target.group else None
        quantized = quantize_dequantize(target.view, fmt, global_amax=shared)
        errors[target.name] = relative_error(target.view, quantized)
        target.view.copy_(quantized)
    return {
        "format": fmt,
        "quantized": list(errors),
        "kept": kept,
        "relative_error": errors,
        "mean_relative_error": sum(errors.values()) / len(errors) if errors else 0.0,
    }


# --------------------------------------------------------------------------------------- activations

ACTIVATION_SCHEMES: dict[str, str | None] = {
    "bf16": None,
    "fp8": "E4M3, one dynamic scale per token and 128-element group (1×128)",
    "fp8_channel": "E4M3, one dynamic scale per token",
    "mxfp4": "E2M1, one dynamic E8M0 scale per 32-element block",
    "nvfp4": "E2M1, one dynamic E4M3 scale per 16-element block under a calibrated per-tensor scale",
}
"""What a GEMM's input becomes in each weight format's serving kernels (docs/precisions.md,
"Activations"): W8A8 for fp8 and fp8_channel, W4A4 for mxfp4 and nvfp4; bf16 keeps its inputs."""

FP8_ACTIVATION_GROUP = 128


def _fp8_rows_qdq(x: Tensor, group: int | None) -> Tensor:
    """[R, K] float32 through E4M3 with one scale amax / 448 per row (or per row and group)."""
    rows, k = x.shape
    blocks = x.view(rows, 1, k) if group is None else _pad_last(x, group).view(rows, -1, group)
    scales = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=FP8_SCALE_EPS) / E4M3_MAX
    return (_fp8_codes(blocks / scales).to(torch.float32) * scales).flatten(1)[:, :k]


def _activation_rows_qdq(rows: Tensor, fmt: str, global_scale: Tensor | None) -> Tensor:
    if fmt == "fp8":
        return _fp8_rows_qdq(rows, FP8_ACTIVATION_GROUP)
    if fmt == "fp8_channel":
        return _fp8_rows_qdq(rows, None)
    if global_scale is None:
        return _mxfp4_qdq_chunk(rows)
    return _nvfp4_qdq_chunk(rows, global_scale)


def quantize_activation(x: Tensor, fmt: str, *, amax: float | Tensor | None = None) -> Tensor:
    """``x`` [..., K] as ``fmt``'s serving kernels feed it to a GEMM (see :data:`ACTIVATION_SCHEMES`),
    in its own shape and dtype; scales run along the last dim, computed from ``x`` itself.

    ``amax`` (nvfp4 only, required) is the input's calibrated max |x|, the per-tensor scale a
    ModelOpt checkpoint stores as ``input_scale`` = amax / (6 · 448); a block beyond it saturates at
    ±amax, as in the kernels. An activation is not refused for NaN or infinity (it is mid-forward):
    a token holding one comes out all NaN, which is what the GEMM makes of it anyway (its block's
    scale is NaN in the kernels), and never silently finite.
    """
    _check_format(fmt)
    if fmt == "bf16":
        return x
    if (amax is None) != (fmt != "nvfp4"):
        raise ValueError(
            f"amax: nvfp4 activations need their calibrated max |x|, other formats none (got {fmt!r})"
        )
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    global_scale = nvfp4_global_scale(amax) if amax is not None else None
    if rows.numel() <= _CHUNK_ELEMENTS:  # a decode step's rows: one piece, no copy into an output
        out = _activation_rows_qdq(rows, fmt, global_scale)
    else:
        out = torch.empty_like(rows)
        for chunk in _row_chunks(*rows.shape):
            out[chunk] = _activation_rows_qdq(rows[chunk], fmt, global_scale)
    nonfinite = ~torch.isfinite(rows.abs().amax(dim=1, keepdim=True))
    out = torch.where(nonfinite, torch.nan, out)
    return out.view(x.shape).to(x.dtype)
