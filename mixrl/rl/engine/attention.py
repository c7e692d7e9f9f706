"""The engine's attention: transformers' SDPA, without copying the keys and values per query head.

transformers' ``sdpa`` attention, given a mask (the engine always has one: left padding, cached
prefixes), repeats every key and value head for the query heads that share it (``repeat_kv``)
before each prefill's attention: for a grouped-query model that is a copy of the whole cache per
layer, at every admission, and its cost grows with the context, not with the tokens computed.  A
prefill on top of a long cached prefix pays it in full.  PyTorch's SDPA takes the grouping itself
(``enable_gqa``) and gives bit-identical results; transformers uses it only without a mask.

``mixrl_sdpa`` is transformers' ``sdpa`` with that one change for queries of more than one token.
Single-token decode steps keep transformers' path when there is padding (it packs a key-value
head's query heads as that head's queries, no copy); without padding transformers passes the
grouping to SDPA instead, which PyTorch's CPU kernel runs ~15-25 % slower, so the engine packs
there too (the same up to float rounding, ~1e-7, no longer bit for bit).
:func:`use_engine_attention` switches a model to it when it runs transformers' ``sdpa``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

ENGINE_ATTENTION = "mixrl_sdpa"


def gqa_sdpa_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' ``sdpa_attention_forward``, with grouped keys and values passed as they are."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    q_length = int(query.shape[2])
    plain = (
        kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )
    if groups > 1 and q_length == 1 and attention_mask is None and plain:
        # A decode step with no padding in the batch.  transformers then broadcasts the keys and
        # values to every query head (``enable_gqa``), which PyTorch's CPU kernel runs ~15-25 %
        # slower than the packing transformers itself uses when there is a mask: a key-value head's
        # query heads as that head's queries.  Same result up to float rounding (~1e-7).
        batch, heads, _, dim = query.shape
        packed = query.reshape(batch, heads // groups, groups, dim)
        out = torch.nn.functional.scaled_dot_product_attention(
            packed, key, value, dropout_p=dropout, scale=scaling, is_causal=False
        )
        return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None
    if groups == 1 or q_length == 1 or not plain:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    # as transformers decides: causal from the module unless told, and only without a mask
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = attention_mask is None and causal
    if causal and int(key.shape[2]) > q_length:  # transformers' slice for an empty static cache
        key, value = key[:, :, :q_length, :], value[:, :, :q_length, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ENGINE_ATTENTION, gqa_sdpa_attention_forward)
AttentionMaskInterface.register(ENGINE_ATTENTION, sdpa_mask)  # the masks of ``sdpa``, unchanged


def use_engine_attention(model: nn.Module) -> None:
    """Switch ``model`` from transformers' ``sdpa`` to :data:`ENGINE_ATTENTION` (other implementations
    are left as they are)."""
    config = getattr(model, "config", None)
    switch = getattr(model, "set_attn_implementation", None)
    if getattr(config, "_attn_implementation", None) == "sdpa" and callable(switch):
        switch(ENGINE_ATTENTION)
