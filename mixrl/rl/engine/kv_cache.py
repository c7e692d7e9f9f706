"""The engine's KV cache: transformers cache layers, optional FP8 emulation, and batch surgery.

A running batch keeps one transformers ``Cache`` whose layers hold keys and values of shape
[batch, kv_heads, length, head_dim], left-padded: row b's real tokens occupy the last
``mask[b].sum()`` columns, and ``mask`` [batch, length] marks them.  Requests join by padding the
shorter of two caches on the left and concatenating along the batch; finished requests leave by
selecting rows, after which columns that are padding for every remaining row are trimmed.  Attention
never reads a padded column (the mask excludes it), and padded columns are zero so that a masked
weight of exactly 0 never meets a non-finite value.

FP8 KV cache (SGLang ``--kv-cache-dtype fp8_e4m3``): keys and values are quantize-dequantized with a
per-layer scalar scale *as they are written*, so attention reads exactly what an FP8 cache would
return; the new token's own key and value are written before attention reads them, as in SGLang.
Only the new tokens are converted at each step, never the whole cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from mixrl.rl.quant import fp8_kv_quant_dequant

KV_CACHE_DTYPES = ("bf16", "fp8")


class EngineKVLayer(DynamicLayer):
    """A growing cache layer; with an FP8 scale pair, keys/values are FP8-rounded on the way in."""

    def __init__(self, fp8_scales: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.fp8_scales = fp8_scales

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        if self.fp8_scales is not None:
            k_scale, v_scale = self.fp8_scales
            key_states = fp8_kv_quant_dequant(key_states, k_scale)
            value_states = fp8_kv_quant_dequant(value_states, v_scale)
        return super().update(key_states, value_states, *args, **kwargs)


def new_cache(layer_scales: Sequence[tuple[float, float] | None]) -> Cache:
    """An empty cache with one :class:`EngineKVLayer` per decoder layer (``None`` = no FP8)."""
    return Cache(layers=[EngineKVLayer(scales) for scales in layer_scales])


@dataclass
class BatchKV:
    """A left-padded batch cache and its validity mask."""

    cache: Cache
    mask: Tensor  # [batch, length] bool

    @property
    def batch_size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def used_tokens(self) -> int:
        """Real (non-padding) tokens held, over all rows."""
        return int(self.mask.sum())

    def zero_padding(self) -> None:
        """Zero keys/values in padded columns (prefill writes whatever the pad token produced)."""
        keep = self.mask[:, None, :, None]
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys * keep
                layer.values = layer.values * keep

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order), then drop columns that are padding for all of them."""
        index = torch.tensor(list(rows), dtype=torch.long)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(dim=0).long().argmax()) if mask.numel() and mask.any() else mask.shape[1]
        self.mask = mask[:, start:]
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, index)[:, :, start:]
                layer.values = layer.values.index_select(0, index)[:, :, start:]

    def append_column(self) -> Tensor:
        """Extend the mask by one real column (the token about to be fed); returns the new mask."""
        self.mask = torch.cat([self.mask, torch.ones(self.batch_size, 1, dtype=torch.bool)], dim=1)
        return self.mask

    def next_positions(self) -> Tensor:
        """Position id of each row's next token: the number of real tokens it has cached."""
        return self.mask.sum(dim=1, keepdim=True)


def _left_pad(t: Tensor, columns: int) -> Tensor:
    if columns == 0:
        return t
    pad = torch.zeros(*t.shape[:-2], columns, t.shape[-1], dtype=t.dtype)
    return torch.cat([pad, t], dim=-2)


def concat(first: BatchKV, second: BatchKV) -> BatchKV:
    """Rows of ``first`` then rows of ``second``, left-padded to a common length."""
    length = max(first.length, second.length)
    pad_a, pad_b = length - first.length, length - second.length
    mask = torch.cat(
        [
            torch.cat([torch.zeros(first.batch_size, pad_a, dtype=torch.bool), first.mask], dim=1),
            torch.cat([torch.zeros(second.batch_size, pad_b, dtype=torch.bool), second.mask], dim=1),
        ],
        dim=0,
    )
    for layer_a, layer_b in zip(first.cache.layers, second.cache.layers, strict=True):
        layer_a.keys = torch.cat([_left_pad(layer_a.keys, pad_a), _left_pad(layer_b.keys, pad_b)], dim=0)
        layer_a.values = torch.cat(
            [_left_pad(layer_a.values, pad_a), _left_pad(layer_b.values, pad_b)], dim=0
        )
    return BatchKV(cache=first.cache, mask=mask)
