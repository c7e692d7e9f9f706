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


SPLIT_KV_ATTENTION = "mixrl_split_kv"
SPLIT_KV_CHUNK = 64
"""Keys per split of the split-KV attention (FlashInfer's and FlashAttention's decode kernels split
the keys into blocks of 64-256 and work on each block apart)."""

ATTENTION_BACKENDS = {"sdpa": ENGINE_ATTENTION, "split_kv": SPLIT_KV_ATTENTION}
"""``--attention-backend``: ``sdpa`` computes attention in the trainer's order (PyTorch's SDPA, as
transformers runs it); ``split_kv`` in a serving kernel's (:func:`split_kv_attention_forward`)."""


def split_kv_attention_forward(
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
    """Attention as a serving kernel orders it (flash-decoding): the keys in splits of
    :data:`SPLIT_KV_CHUNK`, each split's scores (float32 accumulation) through its own softmax
    numerator with its own running max, the probabilities rounded to the value dtype before their
    product with the values (as FlashAttention feeds P to its second GEMM), and the splits merged
    by their log-sum-exp.  The same attention as SDPA's up to that order and rounding, which is the
    difference a serving kernel makes.  ``attention_mask``: True where a query may attend (SDPA's
    boolean masks); None: causal over the last keys."""
    if dropout or kwargs.get("softcap") is not None or kwargs.get("output_attentions", False):
        raise ValueError("split_kv attention: dropout, softcap and attention outputs are not supported")
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = int(key.shape[1]), int(key.shape[2])
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    if attention_mask is None:  # causal, the queries being the last q_len positions
        rows = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
        attention_mask = (torch.arange(k_len, device=query.device)[None, :] <= rows)[None, None]
    if attention_mask.dtype != torch.bool:
        raise ValueError("split_kv attention: expected a boolean mask")
    splits = -(-k_len // SPLIT_KV_CHUNK)
    pad = splits * SPLIT_KV_CHUNK - k_len
    keys = nn.functional.pad(key, (0, 0, 0, pad)).view(batch, kv_heads, 1, splits, SPLIT_KV_CHUNK, dim)
    values = nn.functional.pad(value, (0, 0, 0, pad)).view(batch, kv_heads, 1, splits, SPLIT_KV_CHUNK, dim)
    mask = nn.functional.pad(attention_mask.expand(batch, -1, q_len, k_len), (0, pad), value=False)
    # a key-value head's query heads as that head's queries: [B, Hkv, G, Q, D]
    grouped = query.view(batch, kv_heads, groups, q_len, dim)
    scores = torch.einsum("bhgqd,bhxskd->bhgqsk", grouped.float(), keys.float()) * scale
    mask = mask.view(batch, mask.shape[1], 1, q_len, splits, SPLIT_KV_CHUNK)
    scores = scores.masked_fill(~mask, float("-inf"))
    split_max = scores.amax(dim=-1, keepdim=True)
    split_max = torch.where(torch.isinf(split_max), torch.finfo(torch.float32).min, split_max)
    numerators = torch.exp(scores - split_max)
    sums = numerators.sum(dim=-1)  # [B, Hkv, G, Q, S]
    partial = torch.einsum("bhgqsk,bhxskd->bhgqsd", numerators.to(value.dtype).float(), values.float())
    top = split_max.squeeze(-1).amax(dim=-1, keepdim=True)
    weights = torch.exp(split_max.squeeze(-1) - top)  # each split's share of the merged max
    total = (sums * weights).sum(dim=-1)[..., None]
    # a query that may attend to nothing (a left-padding position) gets zeros, not 0/0: NaN there
    # would reach the other rows through 0 · NaN in the next layer's product with its values
    out = (partial * weights[..., None]).sum(dim=-2) / torch.where(total > 0, total, 1.0)
    out = out.reshape(batch, heads, q_len, dim).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ENGINE_ATTENTION, gqa_sdpa_attention_forward)
AttentionMaskInterface.register(ENGINE_ATTENTION, sdpa_mask)  # the masks of ``sdpa``, unchanged
AttentionInterface.register(SPLIT_KV_ATTENTION, split_kv_attention_forward)
AttentionMaskInterface.register(SPLIT_KV_ATTENTION, sdpa_mask)


def use_engine_attention(model: nn.Module, backend: str = "sdpa") -> None:
    """Switch ``model`` from transformers' ``sdpa`` to the engine's attention for ``backend`` (see
    :data:`ATTENTION_BACKENDS`; other implementations are left as they are)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend: must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}"
        )
    config = getattr(model, "config", None)
    switch = getattr(model, "set_attn_implementation", None)
    if getattr(config, "_attn_implementation", None) in ("sdpa", *ATTENTION_BACKENDS.values()) and callable(
        switch
    ):
        switch(ATTENTION_BACKENDS[backend])
