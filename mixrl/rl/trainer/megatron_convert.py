"""Hugging Face Qwen3 (dense) <-> Megatron-core ``GPTModel`` weights, and their tensor-parallel shards.

megatron-bridge is the maintained converter, but its releases import Transformer Engine at module
load and pin ``transformers<5`` (docs/api.md, "Trainer backends"), so neither installs
beside this project's transformers nor imports on a CPU.  This module is the small, pure piece the
backend needs instead, for the architecture mixrl trains: Qwen3 dense, with Megatron's *local* layer
spec (``get_gpt_layer_local_spec(qk_layernorm=True)``: separate RMSNorm modules, no TE fusion).

Layout facts it encodes (Megatron-core 0.16):
- ``linear_qkv`` holds, per query group, that group's query heads, then its key head, then its
  value head: ``[groups, (heads/groups + 2) * head_dim, hidden]`` flattened on dim 0.  Tensor
  parallelism splits it on dim 0, which hands each rank whole groups.
- ``linear_fc1`` is ``[gate; up]``; each tensor-parallel rank holds ``[gate_r; up_r]``.
- ``linear_proj`` and ``linear_fc2`` are split on dim 1 (row parallel); the embedding and the output
  layer on dim 0 (vocabulary parallel); norms are replicated.

Everything here is a pure function of state dicts: no process group, no Megatron import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

StateDict = dict[str, Tensor]

# Megatron name suffix -> how tensor parallelism splits it (None: replicated).
_COLUMN = "column"  # dim 0
_ROW = "row"  # dim 1
_GATED = "gated"  # dim 0, gate and up halves split separately
_TP_SPLIT: dict[str, str | None] = {
    "embedding.word_embeddings.weight": _COLUMN,
    "output_layer.weight": _COLUMN,
    "decoder.final_layernorm.weight": None,
    "input_layernorm.weight": None,
    "self_attention.linear_qkv.weight": _COLUMN,
    "self_attention.q_layernorm.weight": None,
    "self_attention.k_layernorm.weight": None,
    "self_attention.linear_proj.weight": _ROW,
    "pre_mlp_layernorm.weight": None,
    "mlp.linear_fc1.weight": _GATED,
    "mlp.linear_fc2.weight": _ROW,
}

# Per-layer names: Hugging Face suffix -> Megatron suffix (the one-to-one tensors).
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_TOP_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


def check_supported(hf_config: Any) -> None:
    """Refuse, in one line naming the field, a Hugging Face config this converter cannot map."""
    if getattr(hf_config, "model_type", None) != "qwen3":
        raise ValueError(
            f"model_type: the megatron conversion maps Qwen3 dense models (model_type qwen3), "
            f"got {getattr(hf_config, 'model_type', None)!r}"
        )
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings: the megatron conversion needs an untied lm_head")
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("attention_bias: Qwen3 has no attention biases; this config asks for them")


def transformer_config_kwargs(hf_config: Any) -> dict[str, Any]:
    """The ``TransformerConfig`` fields that make Megatron's ``GPTModel`` compute a Qwen3 dense model.

    Fusions that need CUDA kernels (TE, Apex) are off, so the same config builds on a CPU.
    """
    check_supported(hf_config)
    return {
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "num_attention_heads": hf_config.num_attention_heads,
        "num_query_groups": hf_config.num_key_value_heads,
        "kv_channels": hf_config.head_dim,
        "ffn_hidden_size": hf_config.intermediate_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "masked_softmax_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
    }


def gpt_model_kwargs(hf_config: Any) -> dict[str, Any]:
    """``GPTModel``'s own arguments (besides config and layer spec) for a Qwen3 dense model."""
    check_supported(hf_config)
    return {
        "vocab_size": hf_config.vocab_size,
        "max_sequence_length": hf_config.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": rope_theta(hf_config),
        "share_embeddings_and_output_weights": False,
    }


def rope_theta(hf_config: Any) -> int:
    """RoPE's base: ``rope_parameters["rope_theta"]`` in transformers 5, ``rope_theta`` before."""
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    if parameters.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_parameters.rope_type: only default RoPE maps to Megatron, got {parameters['rope_type']!r}"
        )
    return int(parameters.get("rope_theta", getattr(hf_config, "rope_theta", 10000)))


def _qkv_shape(hf_config: Any) -> tuple[int, int, int, int]:
    groups = hf_config.num_key_value_heads
    return groups, hf_config.num_attention_heads // groups, hf_config.head_dim, hf_config.hidden_size


def hf_to_megatron(hf_state: Mapping[str, Tensor], hf_config: Any) -> StateDict:
    """The whole (unsharded) Megatron ``GPTModel`` state dict of a Hugging Face Qwen3 state dict."""
    check_supported(hf_config)
    groups, per_group, head_dim, hidden = _qkv_shape(hf_config)
    out: StateDict = {mc: hf_state[hf] for hf, mc in _TOP_RENAMES.items()}
    for layer in range(hf_config.num_hidden_layers):
        hf_prefix, mc_prefix = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf, mc in _LAYER_RENAMES.items():
            out[mc_prefix + mc] = hf_state[hf_prefix + hf]
        q = hf_state[hf_prefix + "self_attn.q_proj.weight"].reshape(groups, per_group * head_dim, hidden)
        k = hf_state[hf_prefix + "self_attn.k_proj.weight"].reshape(groups, head_dim, hidden)
        v = hf_state[hf_prefix + "self_attn.v_proj.weight"].reshape(groups, head_dim, hidden)
        out[mc_prefix + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, hidden)
        out[mc_prefix + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_state[hf_prefix + "mlp.gate_proj.weight"], hf_state[hf_prefix + "mlp.up_proj.weight"]]
        )
    return out


def megatron_to_hf(mc_state: Mapping[str, Tensor], hf_config: Any) -> StateDict:
    """The Hugging Face Qwen3 state dict of a whole (unsharded) Megatron ``GPTModel`` state dict."""
    check_supported(hf_config)
    groups, per_group, head_dim, hidden = _qkv_shape(hf_config)
    out: StateDict = {hf: mc_state[mc] for hf, mc in _TOP_RENAMES.items()}
    for layer in range(hf_config.num_hidden_layers):
        hf_prefix, mc_prefix = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf, mc in _LAYER_RENAMES.items():
            out[hf_prefix + hf] = mc_state[mc_prefix + mc]
        qkv = mc_state[mc_prefix + "self_attention.linear_qkv.weight"].reshape(
            groups, (per_group + 2) * head_dim, hidden
        )
        q, k, v = qkv.split([per_group * head_dim, head_dim, head_dim], dim=1)
        out[hf_prefix + "self_attn.q_proj.weight"] = q.reshape(-1, hidden)
        out[hf_prefix + "self_attn.k_proj.weight"] = k.reshape(-1, hidden)
        out[hf_prefix + "self_attn.v_proj.weight"] = v.reshape(-1, hidden)
        gate, up = mc_state[mc_prefix + "mlp.linear_fc1.weight"].chunk(2)
        out[hf_prefix + "mlp.gate_proj.weight"] = gate
        out[hf_prefix + "mlp.up_proj.weight"] = up
    return out


def _split_kind(name: str) -> str | None:
    for suffix, kind in _TP_SPLIT.items():
        if name.endswith(suffix):
            return kind
    raise KeyError(f"{name}: not a tensor of the Qwen3 GPTModel this converter maps")


def tp_shard(mc_state: Mapping[str, Tensor], tp_rank: int, tp_size: int) -> StateDict:
    """Tensor-parallel rank ``tp_rank``'s part of a whole Megatron state dict (what its model holds)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: must be in [0, {tp_size}), got {tp_rank}")
    out: StateDict = {}
    for name, tensor in mc_state.items():
        kind = _split_kind(name)
        if kind is None:
            out[name] = tensor
        elif kind == _GATED:
            gate, up = tensor.chunk(2)
            out[name] = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
        else:
            dim = 0 if kind == _COLUMN else 1
            if tensor.shape[dim] % tp_size:
                raise ValueError(
                    f"{name}: dim {dim} of size {tensor.shape[dim]} does not split into {tp_size}"
                )
            out[name] = tensor.chunk(tp_size, dim=dim)[tp_rank]
    return out


def tp_unshard(shards: Sequence[Mapping[str, Tensor]]) -> StateDict:
    """The whole Megatron state dict from every tensor-parallel rank's part, in rank order."""
    out: StateDict = {}
    for name in shards[0]:
        parts = [shard[name] for shard in shards]
        kind = _split_kind(name)
        if kind is None:
            out[name] = parts[0]
        elif kind == _GATED:
            halves = [part.chunk(2) for part in parts]
            out[name] = torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
        else:
            out[name] = torch.cat(parts, dim=0 if kind == _COLUMN else 1)
    return out
