"""Per-precision checkpoint layouts for serving stacks: tensors in, tensors and JSON configs out.

`convert_state_dict` turns a trainer's BF16 state dict into the tensors of one pool precision,
using quant.py's packed forms, so the numbers in the file are exactly the ones the torch engine
emulates (`quant.quantize_model_`). The layout is the one of the original Hugging Face checkpoints
that SGLang reads: fused transformers≥5 MoE expert tensors are split into per-expert
``experts.{e}.gate_proj / up_proj / down_proj`` matrices. docs/precisions.md lists, per precision,
the config written and what could not be verified without a GPU. Pure: no file I/O here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mixrl import __version__
from mixrl.rl import quant
from mixrl.rl.activation_quant import checkpoint_input_name

# transformers ≥ 5 stores a Qwen-MoE layer's experts as [E, 2·I, H] (gate rows, then up rows) and [E, H, I].
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
# ModelOpt NVFP4 needs an activation scale per linear; without a calibration (no config.json, or a
# model too large to run on the converter's CPU) it is 1.0, which keeps per-16-block activation
# scales in E4M3 range for |x| ≤ 6·448 (docs/precisions.md).
UNCALIBRATED_INPUT_SCALE = 1.0


def serving_layout(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The state dict with fused expert tensors split into per-expert ``.weight`` matrices."""
    out: dict[str, Tensor] = {}
    for key, tensor in tensors.items():
        match = _FUSED_EXPERTS.match(key)
        if not match or tensor.ndim != 3:
            out[key] = tensor
            continue
        prefix = match.group("prefix")
        for expert in range(tensor.shape[0]):
            if match.group("proj") == "gate_up_proj":
                half = tensor.shape[1] // 2
                out[f"{prefix}.{expert}.gate_proj.weight"] = tensor[expert, :half].clone()
                out[f"{prefix}.{expert}.up_proj.weight"] = tensor[expert, half:].clone()
            else:
                out[f"{prefix}.{expert}.down_proj.weight"] = tensor[expert].clone()
    return out


def is_serving_bf16(tensors: Mapping[str, Tensor]) -> bool:
    """True when the state dict already is a BF16 checkpoint in the serving layout."""
    floats_bf16 = all(t.dtype == torch.bfloat16 for t in tensors.values() if t.is_floating_point())
    return floats_bf16 and not any(_FUSED_EXPERTS.match(k) and t.ndim == 3 for k, t in tensors.items())


def _linear_module(key: str, tensor: Tensor) -> str | None:
    """The module name of a linear layer's weight (2-D floating ``<module>.weight``), else None."""
    if key.endswith(".weight") and tensor.ndim == 2 and tensor.is_floating_point():
        return key.removesuffix(".weight")
    return None


@dataclass
class Converted:
    """One precision's checkpoint: its tensors and which linear layers were quantized or kept."""

    fmt: str
    tensors: dict[str, Tensor] = field(default_factory=dict)
    quantized: dict[str, list[int]] = field(default_factory=dict)  # module -> [out, in]
    kept: dict[str, str] = field(default_factory=dict)  # module -> reason

    input_scale: str = ""
    """nvfp4: how the ``input_scale`` tensors were set (calibrated, or the uncalibrated default)."""

    def note(self) -> dict[str, Any]:
        """What a loader needs to dequantize the file (stored in the manifest)."""
        note: dict[str, Any] = {"format": self.fmt, "modules": self.quantized, "kept": self.kept}
        if self.fmt == "nvfp4":
            note["input_scale"] = self.input_scale
        return note


def convert_state_dict(
    tensors: Mapping[str, Tensor],
    fmt: str,
    on_progress: Callable[[int, int], None] | None = None,
    input_amax: Mapping[str, Tensor] | None = None,
    calibration: str = "",
) -> Converted:
    """Quantize every linear weight that serving stacks quantize; cast everything else to BF16.

    nvfp4 also writes each quantized module's ``input_scale``: amax / (6 · 448) of its input from
    ``input_amax`` (:func:`~mixrl.rl.activation_quant.calibrate_checkpoint`, keyed as
    :func:`~mixrl.rl.activation_quant.checkpoint_input_name` says; ``calibration`` describes how it
    was calibrated), else the uncalibrated default 1.0."""
    if fmt not in quant.WEIGHT_FORMATS:
        raise ValueError(
            f"fmt: unknown weight format {fmt!r}; expected one of {', '.join(quant.WEIGHT_FORMATS)}"
        )
    layout = serving_layout(tensors)
    converted = Converted(fmt)
    if fmt == "nvfp4":
        converted.input_scale = (
            f"calibrated: {calibration}" if input_amax else f"uncalibrated default {UNCALIBRATED_INPUT_SCALE}"
        )
    chosen: dict[str, Tensor] = {}
    for key, tensor in layout.items():
        module = _linear_module(key, tensor)
        reason = quant.kept_reason(module, tensor.shape[-1], fmt) if module else "not a linear weight"
        if module and (reason or fmt == "bf16"):
            converted.kept[module] = reason or "bf16"
        if module and not reason and fmt != "bf16":
            chosen[module] = tensor
        else:
            converted.tensors[key] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    group_amax: dict[str, Tensor] = {}
    if fmt == "nvfp4":
        for module, tensor in chosen.items():
            group = quant.fusion_group(module)
            if group:
                amax = tensor.abs().amax().float()
                group_amax[group] = torch.maximum(group_amax.get(group, amax), amax)
    for done, (module, tensor) in enumerate(chosen.items(), start=1):
        group = quant.fusion_group(module)
        shared = group_amax.get(group) if group else None
        for suffix, packed in quant.pack(tensor, fmt, global_amax=shared).items():
            converted.tensors[f"{module}.{suffix}"] = packed
        if fmt == "nvfp4":
            calibrated = input_amax.get(checkpoint_input_name(module)) if input_amax else None
            scale = (
                quant.nvfp4_global_scale(calibrated)
                if calibrated is not None
                else torch.tensor(UNCALIBRATED_INPUT_SCALE)
            )
            converted.tensors[f"{module}.input_scale"] = scale.to(torch.float32).reshape(())
        converted.quantized[module] = list(tensor.shape)
        if on_progress:
            on_progress(done, len(chosen))
    if fmt == "bf16":
        converted.kept.clear()  # nothing is quantized, so nothing is "kept" either
    return converted


def dequantize_checkpoint(tensors: Mapping[str, Tensor], note: Mapping[str, Any]) -> dict[str, Tensor]:
    """BF16 serving-layout state dict of a converted checkpoint (the inverse of `convert_state_dict`)."""
    fmt = note["format"]
    out = dict(tensors)
    for module, shape in note["modules"].items():
        packed = {suffix: out.pop(f"{module}.{suffix}") for suffix in quant.packed_keys(fmt)}
        out.pop(f"{module}.input_scale", None)
        out[f"{module}.weight"] = quant.unpack(packed, fmt, tuple(shape), dtype=torch.bfloat16)
    return out


# ------------------------------------------------------------------------------------------- configs


def _excluded(converted: Converted) -> list[str]:
    return sorted(converted.kept)


def quantization_config(converted: Converted) -> dict[str, Any] | None:
    """The ``quantization_config`` entry of config.json for this precision (None for bf16)."""
    excluded = _excluded(converted)
    if converted.fmt == "fp8":  # the Qwen3-*-FP8 / DeepSeek-V3 block format, SGLang `fp8`
        config: dict[str, Any] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [quant.FP8_TILE, quant.FP8_TILE],
        }
        return config | ({"ignored_layers": excluded} if excluded else {})
    if (
        converted.fmt == "fp8_channel"
    ):  # compressed-tensors "FP8-dynamic": per-channel weights, per-token acts
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "channel",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "symmetric": True,
                        "dynamic": True,
                    },
                }
            },
            "ignore": excluded,
        }
    if converted.fmt == "nvfp4":  # NVIDIA ModelOpt unified checkpoint, SGLang `modelopt_fp4`
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": quant.NVFP4_BLOCK,
            "kv_cache_quant_algo": None,
            "exclude_modules": excluded,
        }
    if converted.fmt == "mxfp4":  # AMD Quark OCP-MX layout (weight + E8M0 weight_scale), SGLang `quark`
        spec = {"dtype": "fp4", "qscheme": "per_group", "group_size": quant.MXFP4_BLOCK, "ch_axis": -1}
        spec |= {"scale_format": "e8m0", "round_method": "half_even", "symmetric": None}
        return {
            "quant_method": "quark",
            "global_quant_config": {
                "weight": spec | {"is_dynamic": False},
                "input_tensors": spec | {"is_dynamic": True},
                "output_tensors": None,
                "bias": None,
            },
            "exclude": excluded,
            "layer_quant_config": {},
            "kv_cache_quant_config": {},
            "export": {"weight_format": "real_quantized", "pack_method": "reorder", "kv_cache_group": []},
        }
    return None


def config_files(converted: Converted, config: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """JSON files to write beside the tensors: config.json (when the source had one), the
    quantization config on its own, and ModelOpt's hf_quant_config.json for nvfp4."""
    qconfig = quantization_config(converted)
    files: dict[str, dict[str, Any]] = {}
    if config is not None:
        files["config.json"] = dict(config) | ({"quantization_config": qconfig} if qconfig else {})
    if qconfig:
        files["quantization_config.json"] = qconfig
    if converted.fmt == "nvfp4":
        files["hf_quant_config.json"] = {
            "producer": {"name": "mixrl", "version": __version__},
            "quantization": {k: v for k, v in qconfig.items() if k != "quant_method"} if qconfig else {},
        }
    return files
