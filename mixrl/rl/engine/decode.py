"""One decode step of a dense Qwen3 model without transformers' per-step Python.

A decode step of 8 rows at ~1,000 tokens of context through the benchmark's 4-layer, 4 M-parameter
model (``bench/engine.py --only prefix-cache``) takes ~10 ms on one CPU core, and going through
``model(...)`` cost 1-2 ms of that in Python that computes nothing: the
decorators on every forward (kwarg deprecation, output capturing, config defaults), building the
4-D mask from the 2-D one, the output dataclasses, config attribute lookups, and one
``nn.Module.__call__`` per linear layer.  :func:`decode_step` makes the same calls on the same
modules and weights in the same order — the norms, the rotary embedding, the cache update and the
attention function are transformers' own, the linear layers their own ``forward`` (without
``nn.Module.__call__``; an :class:`~mixrl.rl.activation_quant.InputQuantLinear` quantizes its
input there) — so its logits are bit-identical to ``model(...)``'s
(``tests/engine/test_decode.py``).  It reads every weight from its module at each call and keeps
none across steps, so a weight update, which gives the same parameters new tensors
(``param.data``, :meth:`~mixrl.rl.engine.staging.StagedWeights.swap_into`) between two steps,
applies from the next step.

Only what it was written against is taken (:func:`supports_decode_step`): ``Qwen3ForCausalLM`` with
every layer of full attention, transformers' SDPA or the engine's (:mod:`~mixrl.rl.engine.attention`)
and plain or input-quantizing linear layers; anything else (the MoE model, another architecture) keeps ``model(...)``.
Prefills keep ``model(...)`` too: a few calls per admission, whose Python cost is negligible next
to their compute.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3ForCausalLM,
    Qwen3MLP,
    apply_rotary_pos_emb,
)

from mixrl.rl.activation_quant import InputQuantLinear
from mixrl.rl.engine.attention import ENGINE_ATTENTION, SPLIT_KV_ATTENTION

_ATTENTION = ("sdpa", ENGINE_ATTENTION, SPLIT_KV_ATTENTION)
_LINEARS = (nn.Linear, InputQuantLinear)


def supports_decode_step(module: nn.Module) -> bool:
    """Whether :func:`decode_step` computes exactly what ``model(...)`` does for ``module``."""
    model: Any = module  # transformers' submodules are untyped attributes
    if type(model) is not Qwen3ForCausalLM or model.training:
        return False
    config = model.config
    if config._attn_implementation not in _ATTENTION:
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return False
    inner = model.model
    if type(model.lm_head) is not nn.Linear or len(inner.layers) != config.num_hidden_layers:
        return False
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (
            type(layer) is not Qwen3DecoderLayer
            or type(attn) is not Qwen3Attention
            or type(mlp) is not Qwen3MLP
        ):
            return False
        linears = (
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
        )
        if any(type(linear) not in _LINEARS for linear in linears):
            return False
    return True


@torch.inference_mode()
def decode_step(module: nn.Module, ids: Tensor, mask: Tensor, positions: Tensor, cache: Cache) -> Tensor:
    """``model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
    logits_to_keep=1).logits[:, -1].float()`` for one token per row (``ids`` [B, 1]; ``mask`` [B, L]
    covers the cache and the fed token), for a model :func:`supports_decode_step` accepts."""
    model: Any = module  # transformers' submodules are untyped attributes
    inner = model.model
    batch = int(ids.shape[0])
    # [B, hidden]: one token per row, so the linear layers get 2-D inputs (what a 3-D one is folded
    # into anyway, minus the folding: the same products)
    hidden = inner.embed_tokens(ids[:, 0])
    cos, sin = inner.rotary_emb(hidden, positions)
    # What transformers' create_causal_mask gives SDPA for a single query token: no mask when no
    # column is padding (the query may attend to every key), else the padding mask per row.
    attention_mask = None if bool(mask.all()) else mask[:, None, None, :]
    attend = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    for index, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        shape = (batch, 1, -1, attn.head_dim)
        residual = hidden
        hidden = layer.input_layernorm(hidden)
        query = attn.q_norm(attn.q_proj.forward(hidden).view(shape)).transpose(1, 2)
        key = attn.k_norm(attn.k_proj.forward(hidden).view(shape)).transpose(1, 2)
        value = attn.v_proj.forward(hidden).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        key, value = cache.update(key, value, index)
        out, _ = attend(
            attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling, sliding_window=None
        )
        out = out.reshape(batch, -1)
        hidden = residual + attn.o_proj.forward(out)
        residual = hidden
        hidden = layer.post_attention_layernorm(hidden)
        gate = mlp.act_fn(mlp.gate_proj.forward(hidden))
        hidden = mlp.down_proj.forward(gate * mlp.up_proj.forward(hidden))
        hidden = residual + hidden
    hidden = inner.norm(hidden)
    return model.lm_head.forward(hidden).float()
