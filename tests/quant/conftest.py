"""Precision-emulation tests: mixrl/rl/quant.py.

Everything here is real: the quantizers, torch's float8 casts, and `transformers` Qwen3 / Qwen3-MoE
models built from tiny configs on this machine (random weights, nothing downloaded). The expected
numbers come from hand-worked cases and from plain float64 references in reference.py that
enumerate the format's code points; no GPU or serving kernel runs here, so "what the kernel sees"
is checked against the published recipes (docs/precisions.md), not against SGLang itself.
"""

from __future__ import annotations

import pytest
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


def tiny_qwen3(intermediate_size: int = 128) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(intermediate_size=intermediate_size, tie_word_embeddings=False, **TINY_SIZES)
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_qwen3_moe() -> torch.nn.Module:
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


@pytest.fixture
def gaussian_weight() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(512, 1024, generator=generator) * 0.02
