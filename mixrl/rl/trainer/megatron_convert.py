"""Hugging Face Qwen3 (dense and MoE) <-> Megatron-core ``GPTModel`` weights, and their parallel shards.

megatron-bridge is the maintained converter, but its releases import Transformer Engine at module
load and pin ``transformers<5`` (docs/api.md, "Trainer backends"), so neither installs
beside this project's transformers nor imports on a CPU.  This module is the small, pure piece the
backend needs instead, for the architectures mixrl trains: Qwen3 dense and Qwen3-MoE, with Megatron's
*local* layer spec (:func:`local_layer_spec_kwargs`: separate RMSNorm modules, no TE fusion, one
``SequentialMLP`` of experts).

Layout facts it encodes (Megatron-core 0.16):
- ``linear_qkv`` holds, per query group, that group's query heads, then its key head, then its
  value head: ``[groups, (heads/groups + 2) * head_dim, hidden]`` flattened on dim 0.  Tensor
  parallelism splits it on dim 0, which hands each rank whole groups.
- ``linear_fc1`` is ``[gate; up]``; each tensor-parallel rank holds ``[gate_r; up_r]``.
- ``linear_proj`` and ``linear_fc2`` are split on dim 1 (row parallel); the embedding and the output
  layer on dim 0 (vocabulary parallel); norms and the MoE router are replicated.
- MoE experts are ``mlp.experts.local_experts.{j}``, ``j`` local to the expert-parallel rank (global
  expert ``ep_rank * experts / ep + j``); each is split like a dense MLP across the expert
  tensor-parallel ranks (Megatron's default: the tensor-parallel size).

Everything here is a pure function of state dicts: no process group, no Megatron import.
"""

from __future__ import annotations

import re
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
    "mlp.router.weight": None,
}
_LOCAL_EXPERT = re.compile(r"^(?P<head>.*\.mlp\.experts\.local_experts\.)(?P<index>\d+)(?P<tail>\..*)$")

# Per-layer names: Hugging Face suffix -> Megatron suffix (the one-to-one tensors).
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
_TOP_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


def tied(hf_config: Any) -> bool:
    """Whether the LM head is the embedding (small Qwen3 models): Megatron then has no
    ``output_layer.weight`` and its output layer uses the embedding's vocabulary shard."""
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def _top_renames(hf_config: Any) -> dict[str, str]:
    return {hf: mc for hf, mc in _TOP_RENAMES.items() if not (tied(hf_config) and hf == "lm_head.weight")}


def is_moe(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) == "qwen3_moe"


def check_supported(hf_config: Any) -> None:
    """Refuse, in one line naming the field, a Hugging Face config this converter cannot map."""
    if getattr(hf_config, "model_type", None) not in ("qwen3", "qwen3_moe"):
        raise ValueError(
            f"model_type: the megatron conversion maps Qwen3 dense and MoE models (qwen3, qwen3_moe), "
            f"got {getattr(hf_config, 'model_type', None)!r}"
        )
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("attention_bias: Qwen3 has no attention biases; this config asks for them")
    if is_moe(hf_config) and (hf_config.decoder_sparse_step != 1 or list(hf_config.mlp_only_layers or [])):
        raise ValueError(
            "decoder_sparse_step: the megatron conversion maps MoE models whose every layer is an MoE "
            "layer (decoder_sparse_step 1, no mlp_only_layers)"
        )


def local_layer_spec_kwargs(hf_config: Any) -> dict[str, Any]:
    """The arguments of megatron-core's ``get_gpt_layer_local_spec`` for this model."""
    check_supported(hf_config)
    kwargs: dict[str, Any] = {"qk_layernorm": True, "normalization": "RMSNorm"}
    if is_moe(hf_config):
        kwargs.update(num_experts=hf_config.num_experts, moe_grouped_gemm=False)
    return kwargs


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
        **(_moe_config_kwargs(hf_config) if is_moe(hf_config) else {}),
    }


def _moe_config_kwargs(hf_config: Any) -> dict[str, Any]:
    return {
        "num_moe_experts": hf_config.num_experts,
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_router_score_function": "softmax",
        # Qwen3-MoE takes the softmax over all experts, then the top k, renormalized when
        # norm_topk_prob; Megatron's top k then softmax over them is that renormalized form, and
        # its pre-softmax the other.
        "moe_router_pre_softmax": not hf_config.norm_topk_prob,
        "moe_grouped_gemm": False,
        # The all-to-all dispatcher makes a CUDA stream when built; all-gather builds on a CPU too.
        "moe_token_dispatcher_type": "allgather",
        # A load-balancing loss is the trainer's choice, not the checkpoint's.
        "moe_router_load_balancing_type": "none",
    }


def gpt_model_kwargs(hf_config: Any) -> dict[str, Any]:
    """``GPTModel``'s own arguments (besides config and layer spec) for a Qwen3 dense model."""
    check_supported(hf_config)
    return {
        "vocab_size": hf_config.vocab_size,
        "max_sequence_length": hf_config.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": rope_theta(hf_config),
        "share_embeddings_and_output_weights": tied(hf_config),
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
    out: StateDict = {mc: hf_state[hf] for hf, mc in _top_renames(hf_config).items()}
    for layer in range(hf_config.num_hidden_layers):
        hf_prefix, mc_prefix = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf, mc in _LAYER_RENAMES.items():
            out[mc_prefix + mc] = hf_state[hf_prefix + hf]
        q = hf_state[hf_prefix + "self_attn.q_proj.weight"].reshape(groups, per_group * head_dim, hidden)
        k = hf_state[hf_prefix + "self_attn.k_proj.weight"].reshape(groups, head_dim, hidden)
        v = hf_state[hf_prefix + "self_attn.v_proj.weight"].reshape(groups, head_dim, hidden)
        out[mc_prefix + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, hidden)
        if is_moe(hf_config):
            out[mc_prefix + "mlp.router.weight"] = hf_state[hf_prefix + "mlp.gate.weight"]
            gate_up = hf_state[
                hf_prefix + "mlp.experts.gate_up_proj"
            ]  # [experts, 2 * ffn, hidden]: [gate; up]
            down = hf_state[hf_prefix + "mlp.experts.down_proj"]  # [experts, hidden, ffn]
            for expert in range(hf_config.num_experts):
                expert_prefix = f"{mc_prefix}mlp.experts.local_experts.{expert}."
                out[expert_prefix + "linear_fc1.weight"] = gate_up[expert]
                out[expert_prefix + "linear_fc2.weight"] = down[expert]
        else:
            out[mc_prefix + "mlp.linear_fc1.weight"] = torch.cat(
                [hf_state[hf_prefix + "mlp.gate_proj.weight"], hf_state[hf_prefix + "mlp.up_proj.weight"]]
            )
            out[mc_prefix + "mlp.linear_fc2.weight"] = hf_state[hf_prefix + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(mc_state: Mapping[str, Tensor], hf_config: Any) -> StateDict:
    """The Hugging Face Qwen3 state dict of a whole (unsharded) Megatron ``GPTModel`` state dict."""
    check_supported(hf_config)
    groups, per_group, head_dim, hidden = _qkv_shape(hf_config)
    out: StateDict = {hf: mc_state[mc] for hf, mc in _top_renames(hf_config).items()}
    if tied(hf_config):  # Hugging Face's state dict names the shared tensor twice
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
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
        if is_moe(hf_config):
            out[hf_prefix + "mlp.gate.weight"] = mc_state[mc_prefix + "mlp.router.weight"]
            experts = [f"{mc_prefix}mlp.experts.local_experts.{e}." for e in range(hf_config.num_experts)]
            out[hf_prefix + "mlp.experts.gate_up_proj"] = torch.stack(
                [mc_state[e + "linear_fc1.weight"] for e in experts]
            )
            out[hf_prefix + "mlp.experts.down_proj"] = torch.stack(
                [mc_state[e + "linear_fc2.weight"] for e in experts]
            )
        else:
            gate, up = mc_state[mc_prefix + "mlp.linear_fc1.weight"].chunk(2)
            out[hf_prefix + "mlp.gate_proj.weight"] = gate
            out[hf_prefix + "mlp.up_proj.weight"] = up
            out[hf_prefix + "mlp.down_proj.weight"] = mc_state[mc_prefix + "mlp.linear_fc2.weight"]
    return out


def _split_kind(name: str) -> str | None:
    expert = _LOCAL_EXPERT.match(name)
    suffix_of = f"mlp.{expert['tail'][1:]}" if expert else name
    for suffix, kind in _TP_SPLIT.items():
        if suffix_of.endswith(suffix):
            return kind
    raise KeyError(f"{name}: not a tensor of the Qwen3 GPTModel this converter maps")


def _tp_part(name: str, tensor: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    kind = _split_kind(name)
    if kind is None:
        return tensor
    if kind == _GATED:
        gate, up = tensor.chunk(2)
        if gate.shape[0] % tp_size:
            raise ValueError(f"{name}: each half of dim 0 ({gate.shape[0]}) does not split into {tp_size}")
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
    dim = 0 if kind == _COLUMN else 1
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"{name}: dim {dim} of size {tensor.shape[dim]} does not split into {tp_size}")
    return tensor.chunk(tp_size, dim=dim)[tp_rank]


def _tp_join(name: str, parts: Sequence[Tensor]) -> Tensor:
    kind = _split_kind(name)
    if kind is None:
        return parts[0]
    if kind == _GATED:
        halves = [part.chunk(2) for part in parts]
        return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
    return torch.cat(list(parts), dim=0 if kind == _COLUMN else 1)


def _num_experts(mc_state: Mapping[str, Tensor]) -> int:
    indices = {int(m["index"]) for m in map(_LOCAL_EXPERT.match, mc_state) if m}
    return max(indices) + 1 if indices else 0


def parallel_shard(
    mc_state: Mapping[str, Tensor], tp_rank: int, tp_size: int, ep_rank: int = 0, ep_size: int = 1
) -> StateDict:
    """The part of a whole Megatron state dict that the rank at (tensor-parallel ``tp_rank``,
    expert-parallel ``ep_rank``) holds: its experts, renumbered locally, and its tensor-parallel
    slice of everything."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: must be in [0, {tp_size}), got {tp_rank}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank: must be in [0, {ep_size}), got {ep_rank}")
    experts = _num_experts(mc_state)
    if experts % ep_size:
        raise ValueError(f"ep_size: {experts} experts do not split into {ep_size} expert-parallel ranks")
    local = experts // ep_size if experts else 0
    out: StateDict = {}
    for name, tensor in mc_state.items():
        expert = _LOCAL_EXPERT.match(name)
        if expert:
            index = int(expert["index"]) - ep_rank * local
            if not 0 <= index < local:
                continue
            name = f"{expert['head']}{index}{expert['tail']}"
        out[name] = _tp_part(name, tensor, tp_rank, tp_size)
    return out


def parallel_unshard(shards: Mapping[tuple[int, int], Mapping[str, Tensor]]) -> StateDict:
    """The whole Megatron state dict from every rank's part, keyed by (ep_rank, tp_rank)."""
    ep_size = 1 + max(ep for ep, _ in shards)
    tp_size = 1 + max(tp for _, tp in shards)
    missing = {(ep, tp) for ep in range(ep_size) for tp in range(tp_size)} - set(shards)
    if missing:
        raise ValueError(f"shards: no part for (ep_rank, tp_rank) {sorted(missing)}")
    out: StateDict = {}
    for ep in range(ep_size):
        local = _num_experts(shards[(ep, 0)])
        for name in shards[(ep, 0)]:
            whole = _tp_join(name, [shards[(ep, tp)][name] for tp in range(tp_size)])
            expert = _LOCAL_EXPERT.match(name)
            if expert:
                out[f"{expert['head']}{ep * local + int(expert['index'])}{expert['tail']}"] = whole
            elif ep == 0:
                out[name] = whole
    return out


_LAYER = re.compile(r"^decoder\.layers\.(?P<index>\d+)\.(?P<tail>.*)$")
_FIRST_STAGE = ("embedding.",)
_LAST_STAGE = ("decoder.final_layernorm.", "output_layer.")


def pipeline_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The global indices of the decoder layers pipeline stage ``pp_rank`` holds (Megatron's even
    split: every stage the same number of layers)."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank: must be in [0, {pp_size}), got {pp_rank}")
    if num_layers % pp_size:
        raise ValueError(f"pp_size: {num_layers} layers do not split evenly into {pp_size} pipeline stages")
    per_stage = num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def pipeline_shard(mc_state: Mapping[str, Tensor], hf_config: Any, pp_rank: int, pp_size: int) -> StateDict:
    """The part of a whole Megatron state dict that pipeline stage ``pp_rank`` holds: its layers,
    numbered from 0 as the stage's ``GPTModel`` numbers them, the embedding on the first stage, the
    final norm and the output layer on the last.  A tied model's last stage (of several) has an
    output layer of its own, which Megatron keeps equal to the first stage's embedding: it gets the
    embedding's weight."""
    layers = pipeline_layers(hf_config.num_hidden_layers, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: StateDict = {}
    for name, tensor in mc_state.items():
        layer = _LAYER.match(name)
        if layer:
            index = int(layer["index"])
            if index in layers:
                out[f"decoder.layers.{index - layers.start}.{layer['tail']}"] = tensor
        elif (name.startswith(_FIRST_STAGE) and first) or (name.startswith(_LAST_STAGE) and last):
            out[name] = tensor
    if tied(hf_config) and pp_size > 1 and last:
        out["output_layer.weight"] = mc_state["embedding.word_embeddings.weight"]
    return out


def pipeline_unshard(stages: Mapping[int, Mapping[str, Tensor]], hf_config: Any) -> StateDict:
    """The whole Megatron state dict from every pipeline stage's part, keyed by ``pp_rank``."""
    pp_size = len(stages)
    if set(stages) != set(range(pp_size)):
        raise ValueError(f"stages: expected pipeline ranks 0..{pp_size - 1}, got {sorted(stages)}")
    out: StateDict = {}
    for pp_rank in range(pp_size):
        start = pipeline_layers(hf_config.num_hidden_layers, pp_rank, pp_size).start
        for name, tensor in stages[pp_rank].items():
            layer = _LAYER.match(name)
            if layer:
                out[f"decoder.layers.{start + int(layer['index'])}.{layer['tail']}"] = tensor
            elif not (name == "output_layer.weight" and tied(hf_config)):
                out[name] = tensor
    return out
