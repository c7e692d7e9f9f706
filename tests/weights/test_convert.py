"""Per-precision conversion: the checkpoint SGLang would load holds exactly the emulated numbers."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mixrl.rl import activation_quant, quant
from mixrl.rl.checkpoint_formats import serving_layout
from mixrl.rl.weights import MANIFEST, WeightStore, WeightStoreError, load_checkpoint_dir, load_dequantized

from .conftest import assert_same_parameters, tiny_qwen3, tiny_qwen3_moe

MODELS = {"dense": tiny_qwen3, "moe": tiny_qwen3_moe}


def _publish(store: WeightStore, kind: str) -> torch.nn.Module:
    model = MODELS[kind]()
    store.publish(1, model.state_dict(), config=model.config.to_dict())
    return model


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("fmt", quant.WEIGHT_FORMATS)
def test_converted_checkpoint_equals_the_engine_emulation(store: WeightStore, kind: str, fmt: str) -> None:
    model = _publish(store, kind)
    emulated = copy.deepcopy(model)
    quant.quantize_model_(emulated, fmt)
    expected = serving_layout(emulated.state_dict())
    got = load_dequantized(store.convert(1, fmt))
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert got[key].dtype == torch.bfloat16 and torch.equal(got[key], tensor), key


def test_moe_checkpoint_uses_per_expert_keys_and_packed_suffixes(store: WeightStore) -> None:
    _publish(store, "moe")
    fp8, _ = load_checkpoint_dir(store.convert(1, "fp8"))
    expert = "model.layers.1.mlp.experts.3"
    assert fp8[f"{expert}.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8[f"{expert}.gate_proj.weight_scale_inv"].shape == (1, 1)
    assert fp8["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # router kept
    assert not any(key.endswith("gate_up_proj") for key in fp8)
    nvfp4, manifest = load_checkpoint_dir(store.convert(1, "nvfp4"))
    for suffix, dtype in [("weight", torch.uint8), ("weight_scale", torch.float8_e4m3fn)]:
        assert nvfp4[f"{expert}.down_proj.{suffix}"].dtype == dtype
    # gate and up of one expert share the global scale, as SGLang's fused w13 kernel needs
    assert torch.equal(nvfp4[f"{expert}.gate_proj.weight_scale_2"], nvfp4[f"{expert}.up_proj.weight_scale_2"])
    # one calibrated input scale per experts module and projection (SGLang's fused MoE takes one)
    assert (
        nvfp4[f"{expert}.up_proj.input_scale"] == nvfp4["model.layers.1.mlp.experts.0.gate_proj.input_scale"]
    )
    assert nvfp4[f"{expert}.up_proj.input_scale"] != nvfp4[f"{expert}.down_proj.input_scale"]
    assert manifest["quantization"]["input_scale"].startswith("calibrated: ")
    assert manifest["quantization"]["kept"]["model.layers.0.mlp.gate"] == "moe router"
    assert manifest["quantization"]["modules"][f"{expert}.down_proj"] == [64, 32]


def test_configs_follow_the_serving_formats(store: WeightStore) -> None:
    _publish(store, "dense")
    fp8 = json.loads((Path(store.convert(1, "fp8")) / "config.json").read_text())
    assert fp8["model_type"] == "qwen3"
    assert fp8["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "ignored_layers": ["lm_head", "model.embed_tokens"],
    }
    nvfp4_dir = Path(store.convert(1, "nvfp4"))
    hf_quant = json.loads((nvfp4_dir / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "NVFP4" and hf_quant["group_size"] == 16
    assert "lm_head" in hf_quant["exclude_modules"] and "kv_cache_quant_algo" in hf_quant
    channel = json.loads((Path(store.convert(1, "fp8_channel")) / "config.json").read_text())
    assert channel["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    mx = json.loads((Path(store.convert(1, "mxfp4")) / "quantization_config.json").read_text())
    assert mx["global_quant_config"]["weight"]["scale_format"] == "e8m0"


def test_convert_is_idempotent(store: WeightStore) -> None:
    _publish(store, "dense")
    path = Path(store.convert(1, "nvfp4"))
    before = (path / MANIFEST).stat().st_mtime_ns, (path / MANIFEST).read_bytes()
    assert Path(store.convert(1, "nvfp4")) == path
    assert ((path / MANIFEST).stat().st_mtime_ns, (path / MANIFEST).read_bytes()) == before
    assert store.versions() == [1]  # conversions live inside their version, not beside it


def test_bf16_conversion(store: WeightStore) -> None:
    _publish(store, "dense")
    assert store.convert(1, "bf16") == store.path(1)  # already a bf16 checkpoint in serving layout
    moe = tiny_qwen3_moe()
    store.publish(2, moe.state_dict(), config=moe.config.to_dict())
    path = store.convert(2, "bf16")
    assert path.endswith("v00000002/bf16")  # fused experts were split for SGLang
    loaded = AutoModelForCausalLM.from_pretrained(path)  # transformers fuses them back
    assert_same_parameters(moe, loaded)


def test_convert_refuses_bad_sources(store: WeightStore) -> None:
    with pytest.raises(WeightStoreError, match="not a checkpoint directory"):
        store.convert(4, "fp8")
    with pytest.raises(ValueError, match="precision: unknown 'int8'"):
        store.convert(1, "int8")
    _publish(store, "dense")
    shard = Path(store.path(1)) / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    with pytest.raises(WeightStoreError, match="sha256 does not match"):
        store.convert(1, "fp8")
    assert not (Path(store.path(1)) / "fp8").exists()


@pytest.mark.parametrize("kind", MODELS)
def test_nvfp4_input_scales_are_the_engines_calibration(store: WeightStore, kind: str) -> None:
    model = _publish(store, kind)
    served = copy.deepcopy(model).float()  # the engine computes in float32 on a CPU
    inputs = activation_quant.install_(served, "nvfp4", quant.quantize_model_(served, "nvfp4")["quantized"])
    assert inputs is not None
    amax = inputs.calibrate(served)
    tensors, _ = load_checkpoint_dir(store.convert(1, "nvfp4"))
    scales = {
        key.removesuffix(".input_scale"): t for key, t in tensors.items() if key.endswith(".input_scale")
    }
    assert scales and all(t.dtype == torch.float32 and t.dim() == 0 for t in scales.values())
    for module, scale in scales.items():
        expected = quant.nvfp4_global_scale(amax[activation_quant.checkpoint_input_name(module)])
        # float rounding differs between the two models' kernels: scales agree to a few 1e-4
        assert float(scale) == pytest.approx(float(expected), rel=1e-3), module
        assert float(scale) != 1.0


def test_without_a_config_the_input_scales_stay_the_default_and_say_so(store: WeightStore) -> None:
    store.publish(1, tiny_qwen3().state_dict())  # no config.json: nothing to build the model from
    tensors, manifest = load_checkpoint_dir(store.convert(1, "nvfp4"))
    assert {float(t) for key, t in tensors.items() if key.endswith(".input_scale")} == {1.0}
    assert manifest["quantization"]["input_scale"] == "uncalibrated default 1.0"
