"""Tiny causal language models built locally, for tests, benchmarks and the embedded local runtime.

Nothing here downloads anything: a tiny Qwen3 (dense) or Qwen3-MoE config is created in code,
its weights are initialized from a seed, and the result is written as an ordinary Hugging Face
model directory (``config.json``, ``model.safetensors``, ``generation_config.json``) that
``AutoModelForCausalLM.from_pretrained`` loads like any hub checkpoint.  No tokenizer is written:
the engine is token-in/token-out, and the RL loop brings its own local tokenizer.

Weights use the usual initializer range (0.02) except the LM head, drawn with a larger standard
deviation (``lm_head_std``, 0.4 by default) so that a random tiny model predicts peaked next-token
distributions like a trained one (about 2.8 nats of entropy over 512 tokens, instead of an almost
uniform 6.2): greedy decoding is then not a coin toss between near-ties, top-p supports are a few
dozen tokens, and a quantized pool moves the distribution by a realistic amount (per-token KL to
bf16 of a few 1e-3 for FP8, about 0.1 for FP4 formats) rather than by a chaotic one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3MoeConfig,
)

from mixrl.api.tiny import TINY_KINDS

MODEL_KINDS = TINY_KINDS

_COMMON_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": None,
    "eos_token_id": None,
}

_KIND_TINY: dict[str, dict[str, Any]] = {
    "qwen3": {"intermediate_size": 128},
    "qwen3_moe": {
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
    },
}

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}


def tiny_config(kind: str = "qwen3", vocab_size: int = 512, **overrides: Any) -> PretrainedConfig:
    """A tiny Qwen3 or Qwen3-MoE config (2 layers, hidden 64, 4 heads, 2 KV heads); fast on a CPU.

    ``overrides`` replace any config field, e.g. ``hidden_size=256, num_hidden_layers=4``.
    """
    if kind not in _CONFIG_CLASSES:
        raise ValueError(f"kind: unknown model kind {kind!r}; expected one of {', '.join(MODEL_KINDS)}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size: must be at least 2, got {vocab_size}")
    fields = {**_COMMON_TINY, **_KIND_TINY[kind], "vocab_size": vocab_size, **overrides}
    if (
        fields["hidden_size"] != fields["num_attention_heads"] * fields["head_dim"]
        and "head_dim" not in overrides
    ):
        # keep head_dim consistent when only hidden_size / num_attention_heads were overridden
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return _CONFIG_CLASSES[kind](**fields)


def create_tiny_checkpoint(
    path: str | os.PathLike[str],
    kind: str = "qwen3",
    vocab_size: int = 512,
    seed: int = 0,
    lm_head_std: float = 0.4,
    **overrides: Any,
) -> str:
    """Write a randomly initialized tiny model to ``path`` as a Hugging Face model directory.

    The weights depend only on (kind, vocab_size, overrides, seed, lm_head_std): the global torch
    RNG is neither read nor advanced.  Returns ``str(path)``.
    """
    if not lm_head_std > 0:
        raise ValueError(f"lm_head_std: must be positive, got {lm_head_std}")
    config = tiny_config(kind, vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0.0, lm_head_std)
    model.generation_config = GenerationConfig(
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
    )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def load_model(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a causal LM from a local directory for inference (eval mode, no gradients)."""
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, local_files_only=True
    )
    model.eval()
    model.requires_grad_(False)
    return model
