"""Putting a checkpoint into the serving model at the pool's precision.

Serving stacks hold every parameter of a BF16 checkpoint in bf16, and a quantized pool additionally
replaces its linear weights by their quantized values.  Emulation does the same once, at load time:
every parameter is rounded to bf16, then `mixrl.rl.quant.quantize_model_` quantize-dequantizes the
linear weights (embeddings, LM head, norms and the MoE router stay in bf16, see `quant.kept_reason`).
The model then computes in ``compute_dtype`` (float32 by default on CPU: activations are not rounded
to bf16, only the weights are).  Nothing is re-quantized per step.

A weight update is prepared the same way, while the engine serves, by :mod:`mixrl.rl.engine.staging`.

FP8 KV-cache scales: one (k_scale, v_scale) pair per layer.  A checkpoint may carry them as tensors
named ``...layers.<i>.self_attn.k_scale`` / ``v_scale`` (also ``...k_proj.k_scale``, as ModelOpt
exports write them); otherwise they are 1.0, SGLang's default.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from mixrl.rl.quant import WEIGHT_FORMATS, quantize_model_

_KV_SCALE_KEY = re.compile(r"layers\.(\d+)\..*\b([kv])_scale$")


def is_kv_scale_key(name: str) -> bool:
    return _KV_SCALE_KEY.search(name) is not None


def kv_scales_from_tensors(tensors: dict[str, Tensor], num_layers: int) -> list[tuple[float, float]]:
    """Per-layer (k_scale, v_scale) found among ``tensors``; 1.0 where a layer has none."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    for name, value in tensors.items():
        match = _KV_SCALE_KEY.search(name)
        if match and int(match.group(1)) < num_layers:
            scale = float(value.reshape(-1)[0])
            if not scale > 0 or scale == float("inf"):
                raise ValueError(f"{name}: KV-cache scale must be a positive finite number, got {scale}")
            scales[int(match.group(1))][0 if match.group(2) == "k" else 1] = scale
    return [(k, v) for k, v in scales]


def kv_scale_tensors_in_dir(path: str | Path) -> dict[str, Tensor]:
    """The KV-scale tensors stored in a model directory's safetensors files (usually none)."""
    found: dict[str, Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if is_kv_scale_key(name):
                    found[name] = handle.get_tensor(name)
    return found


@torch.no_grad()
def apply_precision_(model: nn.Module, weight_precision: str, compute_dtype: torch.dtype) -> dict:
    """Round every parameter to bf16, quantize-dequantize the linear weights, cast to the compute dtype."""
    if weight_precision not in WEIGHT_FORMATS:
        raise ValueError(
            f"weight_precision: unknown format {weight_precision!r}; expected one of {WEIGHT_FORMATS}"
        )
    for param in model.parameters():
        param.copy_(param.to(torch.bfloat16).to(param.dtype))
    report = quantize_model_(model, weight_precision)
    model.to(compute_dtype)
    return report


def check_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Raise ValueError naming the first key that is missing, unexpected or of the wrong shape."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, first {missing[0]!r}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensors, first {unexpected[0]!r}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(expected[name].shape)}"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{name}: contains NaN or infinity")
