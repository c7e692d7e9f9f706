"""Tiny Qwen3 and Qwen3-MoE ``transformers`` models built from configs on this machine (seeded random
weights, nothing downloaded), for the folders that quantize, convert or store whole models."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

TINY_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)


def tiny_qwen3(intermediate_size: int = 128, tie_word_embeddings: bool = False) -> torch.nn.Module:
    """A dense Qwen3 in FP32, in eval mode; the same weights on every call."""
    torch.manual_seed(0)
    config = Qwen3Config(
        intermediate_size=intermediate_size, tie_word_embeddings=tie_word_embeddings, **TINY_SIZES
    )
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_qwen3_moe() -> torch.nn.Module:
    """A Qwen3-MoE (4 experts, 2 per token, every layer sparse) in FP32, in eval mode; the same
    weights on every call."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **TINY_SIZES,
    )
    return AutoModelForCausalLM.from_config(config).eval()
