"""The engine's KV cache: transformers cache layers, optional FP8 emulation, and batch surgery.

A running batch keeps one transformers ``Cache`` whose layers hold keys and values of shape
[batch, kv_heads, length, head_dim], left-padded: row b's real tokens occupy the last
``mask[b].sum()`` columns, and ``mask`` [batch, length] marks them.  (A row prefilled on top of a
cached prefix may have padding between the prefix and its new tokens; see :func:`prefilled_batch`.
Nothing relies on a row's real columns being contiguous: positions count real tokens, attention
reads the mask.)  Requests join by padding the
shorter of two caches on the left and concatenating along the batch; finished requests leave by
selecting rows, after which columns that are padding for every remaining row are trimmed.  Attention
never reads a padded column (the mask excludes it), and padded columns are zero so that a masked
weight of exactly 0 never meets a non-finite value.

FP8 KV cache (SGLang ``--kv-cache-dtype fp8_e4m3``): keys and values are quantize-dequantized with a
per-layer scalar scale *as they are written*, so attention reads exactly what an FP8 cache would
return; the new token's own key and value are written before attention reads them, as in SGLang.
Only the new tokens are converted at each step, never the whole cache.

Prefix cache (:class:`PrefixCache`): the keys and values of finished sequences, kept under a token
budget with LRU eviction, so that a request starting with a held sequence's ids (an agent session's
next turn) computes only its new tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import cast

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from mixrl.rl.quant import fp8_kv_quant_dequant

KV_CACHE_DTYPES = ("bf16", "fp8")


class EngineKVLayer(DynamicLayer):
    """A growing cache layer; with an FP8 scale pair, keys/values are FP8-rounded on the way in.

    Keys and values live in buffers with room to grow (doubling), and ``keys``/``values`` are views
    of their filled part: a decode step writes one column in place instead of copying the whole
    cache as transformers' ``DynamicLayer`` does with ``torch.cat`` (a cost that grows with the
    context, every step).  Assigning ``keys``/``values`` (batch surgery below) replaces the buffer.
    """

    def __init__(self, fp8_scales: tuple[float, float] | None = None) -> None:
        self._key_buffer: Tensor | None = None
        self._value_buffer: Tensor | None = None
        # filled columns of each buffer: one length each, since surgery assigns keys before values
        self._key_length = self._value_length = 0
        super().__init__()
        self.fp8_scales = fp8_scales

    @staticmethod
    def _filled(buffer: Tensor | None, length: int) -> Tensor | None:
        return buffer if buffer is None or buffer.dim() < 2 else buffer[..., :length, :]

    @staticmethod
    def _columns(tensor: Tensor | None) -> int:
        return int(tensor.shape[-2]) if tensor is not None and tensor.dim() >= 2 else 0

    @property
    def keys(self) -> Tensor | None:
        return self._filled(self._key_buffer, self._key_length)

    @keys.setter
    def keys(self, tensor: Tensor | None) -> None:
        self._key_buffer, self._key_length = tensor, self._columns(tensor)

    @property
    def values(self) -> Tensor | None:
        return self._filled(self._value_buffer, self._value_length)

    @values.setter
    def values(self, tensor: Tensor | None) -> None:
        self._value_buffer, self._value_length = tensor, self._columns(tensor)

    def adopt(self, keys: Tensor, values: Tensor, filled: int) -> None:
        """Hold ``keys``/``values`` as buffers whose first ``filled`` columns are real (the rest is
        room to grow into without a copy)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._key_buffer, self._value_buffer = keys, values
        self._key_length = self._value_length = filled

    def filled(self) -> tuple[Tensor, Tensor] | None:
        """The keys and values held, or None while the layer holds no column."""
        keys, values = self.keys, self.values
        if not self.is_initialized or keys is None or values is None or not keys.numel():
            return None
        return keys, values

    def held(self) -> tuple[Tensor, Tensor]:
        """The keys and values of a layer that a prefill has written (an error otherwise)."""
        keys, values = self.keys, self.values
        if keys is None or values is None:
            raise RuntimeError("the cache layer holds no keys and values yet: prefill writes them first")
        return keys, values

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        if self.fp8_scales is not None:
            k_scale, v_scale = self.fp8_scales
            key_states = fp8_kv_quant_dequant(key_states, k_scale)
            value_states = fp8_kv_quant_dequant(value_states, v_scale)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._key_buffer, self._value_buffer
        assert keys is not None and values is not None
        start = self._key_length
        if keys.dim() < 2 or start == 0:
            self.keys, self.values = key_states, value_states
            return key_states, value_states
        assert self._value_length == start, "keys and values must hold the same columns"
        end = start + int(key_states.shape[-2])
        if end > keys.shape[-2]:
            room = max(end, 2 * start)
            keys, values = _grown(keys, start, room), _grown(values, start, room)
            self._key_buffer, self._value_buffer = keys, values
        keys[..., start:end, :] = key_states
        values[..., start:end, :] = value_states
        self._key_length = self._value_length = end
        return keys[..., :end, :], values[..., :end, :]


def _grown(buffer: Tensor, filled: int, room: int) -> Tensor:
    """A copy of ``buffer``'s first ``filled`` columns with room for ``room`` columns in all."""
    # empty, not zeros: the room beyond ``filled`` is always written before anything reads it
    grown = torch.empty(*buffer.shape[:-2], room, buffer.shape[-1], dtype=buffer.dtype)
    grown[..., :filled, :] = buffer[..., :filled, :]
    return grown


def new_cache(layer_scales: Sequence[tuple[float, float] | None]) -> Cache:
    """An empty cache with one :class:`EngineKVLayer` per decoder layer (``None`` = no FP8)."""
    return Cache(layers=[EngineKVLayer(scales) for scales in layer_scales])


@dataclass
class BatchKV:
    """A left-padded batch cache and its validity mask."""

    cache: Cache
    mask: Tensor  # [batch, length] bool

    @property
    def layers(self) -> list[EngineKVLayer]:
        """The cache's layers, each an :class:`EngineKVLayer` (:func:`new_cache` makes no other)."""
        return cast(list[EngineKVLayer], self.cache.layers)

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
        """Zero keys/values in padded columns (prefill writes whatever the pad token produced).

        In place: the layers keep their buffers (and the room to grow in them), and a batch without
        padding costs nothing; a copy here would be a pass over the whole cache at every admission.
        """
        pad = ~self.mask
        if not bool(pad.any()):
            return
        pad = pad[:, None, :, None]
        with torch.inference_mode():  # the prefill's tensors are inference tensors: written in that mode
            for layer in self.layers:
                if (held := layer.filled()) is not None:
                    keys, values = held
                    keys.masked_fill_(pad, 0.0)
                    values.masked_fill_(pad, 0.0)

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order), then drop columns that are padding for all of them."""
        index = torch.tensor(list(rows), dtype=torch.long)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(dim=0).long().argmax()) if mask.numel() and mask.any() else mask.shape[1]
        self.mask = mask[:, start:]
        for layer in self.layers:
            if (held := layer.filled()) is not None:
                keys, values = held
                layer.keys = keys.index_select(0, index)[:, :, start:]
                layer.values = values.index_select(0, index)[:, :, start:]

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
    for layer_a, layer_b in zip(first.layers, second.layers, strict=True):
        (keys_a, values_a), (keys_b, values_b) = layer_a.held(), layer_b.held()
        layer_a.keys = torch.cat([_left_pad(keys_a, pad_a), _left_pad(keys_b, pad_b)], dim=0)
        layer_a.values = torch.cat([_left_pad(values_a, pad_a), _left_pad(values_b, pad_b)], dim=0)
    return BatchKV(cache=first.cache, mask=mask)


# ---------------------------------------------------------------------------------------------------
# The prefix cache

LayerKV = list[tuple[Tensor, Tensor]]
"""One sequence's keys and values: per decoder layer a pair of [kv_heads, length, head_dim]."""


@dataclass
class _Entry:
    tokens: Tensor  # [length] int64: the ids whose keys and values ``kv`` holds, in order
    kv: LayerKV

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


class PrefixCache:
    """Keys and values of finished sequences, reused by later requests that start with the same ids.

    Why whole sequences rather than a radix tree of shared segments: a hit must become one dense
    row of the left-padded batch cache anyway, so a tree would concatenate its segments at every
    lookup; matching a prompt against every held sequence gives the same hit length as a radix tree
    (its longest match *is* the longest common prefix over the sequences it holds), and the
    workload it is for — an agent session whose next turn extends its previous one — keeps one
    entry per session, because an entry that is a prefix of a newer one is dropped when the newer
    one arrives.  The price is memory: ``G`` samples of one prompt hold ``G`` copies of that prompt's
    keys and values, bounded like everything else by the budget.

    The budget is in tokens (one token = every layer's key and value for it); the least recently
    used entries are evicted first, and an entry larger than the whole budget is not kept.  The
    cache knows nothing of weight versions: its owner (the runner) clears it whenever the weights
    change and never inserts keys and values computed under older weights.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_key = 0
        self.held_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.held_tokens = 0

    def match(self, prompt: Sequence[int]) -> tuple[int, LayerKV]:
        """The longest cached prefix of ``prompt`` that leaves at least one token to compute.

        Returns its length and its keys and values (views of the entry's; ``(0, [])`` on a miss);
        the entry becomes the most recently used.
        """
        limit = len(prompt) - 1
        if limit < 1 or not self._entries:
            return 0, []
        query = torch.tensor(list(prompt[:limit]), dtype=torch.long)
        best_key, best = None, 0
        for key, entry in self._entries.items():
            n = _common_prefix(query, entry.tokens)
            if n > best:
                best_key, best = key, n
        if best_key is None:
            return 0, []
        self._entries.move_to_end(best_key)
        kv = self._entries[best_key].kv
        return best, [(k[:, :best], v[:, :best]) for k, v in kv]

    def insert(self, tokens: Sequence[int], kv: LayerKV) -> None:
        """Hold ``kv`` (the keys and values of ``tokens``, in order), evicting least recently used entries."""
        ids = torch.tensor(list(tokens), dtype=torch.long)
        length = int(ids.shape[0])
        if length == 0 or length > self.max_tokens:
            return
        if kv and int(kv[0][0].shape[1]) != length:
            raise ValueError(f"kv: holds {int(kv[0][0].shape[1])} tokens for {length} ids")
        for key, entry in list(self._entries.items()):
            n = _common_prefix(ids, entry.tokens)
            if n == entry.length:  # the new sequence extends (or repeats) this one: it supersedes it
                self._remove(key)
            elif n == length:  # already held inside a longer entry
                self._entries.move_to_end(key)
                return
        self._entries[self._next_key] = _Entry(tokens=ids, kv=kv)
        self._next_key += 1
        self.held_tokens += length
        while self.held_tokens > self.max_tokens:
            self._remove(next(iter(self._entries)))

    def _remove(self, key: int) -> None:
        self.held_tokens -= self._entries.pop(key).length


SHARED_PREFIX_MIN_TOKENS = 32
"""Prompts admitted together that share at least this many tokens beyond what the cache gives them
have the shared part computed once (:func:`shared_prefixes`); SGLang's radix cache uses the same
threshold for its in-batch prefix caching."""


def shared_prefixes(
    prompts: Sequence[Sequence[int]], hits: Sequence[int], min_tokens: int = SHARED_PREFIX_MIN_TOKENS
) -> list[tuple[int, ...]]:
    """Prefixes that two or more of ``prompts`` share, beyond their cache hits ``hits``, shortest first.

    Prompts admitted together (the samples of one prompt, episodes with one system prompt) would
    otherwise each compute their common part: computed once and put in the prefix cache first, it is
    a hit for all of them.  The longest common prefix of two prompts is that of two neighbours in
    sorted order, so only neighbours are compared; a prefix stops one token short of the shorter
    prompt, since every prompt computes its last token for its logits.  A prefix counts when it
    reaches at least ``min_tokens`` beyond the longer of the two hits (a row whose hit already
    covers it would make it a hit for the other row too).
    """
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    found: set[tuple[int, ...]] = set()
    for a, b in pairwise(order):
        first, second = prompts[a], prompts[b]
        limit = min(len(first), len(second)) - 1
        n = next((i for i in range(limit) if first[i] != second[i]), max(limit, 0))
        if n >= max(hits[a], hits[b]) + min_tokens:
            found.add(tuple(first[:n]))
    return sorted(found, key=len)


def _common_prefix(a: Tensor, b: Tensor) -> int:
    n = min(int(a.shape[0]), int(b.shape[0]))
    if n == 0:
        return 0
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0, 0]) if differ.numel() else n


def prefilled_batch(
    prefixes: Sequence[tuple[int, LayerKV]],
    layer_scales: Sequence[tuple[float, float] | None],
    room: int = 0,
) -> tuple[BatchKV, int]:
    """A batch cache holding each row's cached prefix, right-aligned in its first columns.

    Returns the cache (its mask covers only the prefix columns) and the prefix width P.  The rows'
    new tokens are fed after these columns, right-aligned too, so a row whose new part is shorter
    than the longest one has padding between its prefix and its new tokens: the mask marks it, the
    positions count only real tokens, and attention never reads it.  ``room``: columns to allocate
    in all (at least P), so that the new tokens are written in place instead of into a grown copy.
    """
    width = max(n for n, _ in prefixes)
    columns = max(width, room)
    cache = new_cache(layer_scales)
    mask = torch.zeros(len(prefixes), width, dtype=torch.bool)
    for row, (n, _) in enumerate(prefixes):
        mask[row, width - n :] = True
    template = next(kv for n, kv in prefixes if n)
    for i, layer in enumerate(cache.layers):
        k0, v0 = template[i]
        # Only the first ``width`` columns are read before being written: the padding among them
        # is zeroed, the prefixes copied, and the room after them left as allocated.
        keys = torch.empty(len(prefixes), k0.shape[0], columns, k0.shape[2], dtype=k0.dtype)
        values = torch.empty(len(prefixes), v0.shape[0], columns, v0.shape[2], dtype=v0.dtype)
        for row, (n, kv) in enumerate(prefixes):
            keys[row, :, : width - n] = 0.0
            values[row, :, : width - n] = 0.0
            if n:
                keys[row, :, width - n : width] = kv[i][0]
                values[row, :, width - n : width] = kv[i][1]
        assert isinstance(layer, EngineKVLayer)  # new_cache makes only these
        layer.adopt(keys, values, width)
    return BatchKV(cache=cache, mask=mask), width


def row_kv(kv: BatchKV, row: int) -> LayerKV:
    """Row ``row``'s real keys and values, in order, copied out of the batch (for the prefix cache)."""
    real = kv.mask[row]
    count = int(real.sum())
    start = int(real.shape[0]) - count
    held = [layer.held() for layer in kv.layers]
    if bool(real[start:].all()):
        # the usual case, real columns after the row's padding: one copy of a slice (boolean
        # indexing below gathers column by column, ~4x slower, at every finished sequence)
        return [(keys[row, :, start:].clone(), values[row, :, start:].clone()) for keys, values in held]
    # copies either way, so the entry does not pin the batch's tensors
    return [(keys[row][:, real], values[row][:, real]) for keys, values in held]
