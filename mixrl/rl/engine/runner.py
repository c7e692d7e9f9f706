"""The model runner: prefill, incremental decode and continuous batching, synchronously.

A :class:`Sequence` is one request's generation state.  :meth:`ModelRunner.add` prefills newly
admitted sequences together (left-padded), samples their first token and merges them into the
running batch; :meth:`ModelRunner.step` feeds every running sequence its last token and samples the
next one; finished sequences leave the batch immediately.  So requests that arrive while others
decode join at the next step, and a batch never waits for its slowest member.

Position ids are per row (the number of real tokens before the fed one) and the attention mask
excludes padding, so a row's result does not depend on what else is in the batch, up to float
rounding in batched matrix products.

With ``use_kv_cache=False`` every step recomputes the whole sequences instead (the baseline of the
cached/uncached benchmark, and an independent path for tests).

With a prefix cache (``prefix_cache_tokens`` > 0, :class:`~mixrl.rl.engine.kv_cache.PrefixCache`),
a finished sequence leaves its keys and values behind, and an admitted prompt that starts with a
held sequence's ids is prefilled on top of them: only its new tokens are computed, and
``Sequence.cached_tokens`` says how many were reused (SGLang's ``meta_info.cached_tokens``).  Keys
and values are tagged with the weights that computed them: setting ``weight_version`` or
``kv_scales`` (what every weight update does) empties the cache, and a sequence whose prefill ran
under older weights is not cached when it finishes, so keys and values of one version are never
reused under another.

The runner switches its model to the engine's attention (:mod:`mixrl.rl.engine.attention`:
transformers' SDPA without copying the keys and values per query head; bit-identical except an
unpadded decode step, equal to ~1e-7), and runs
decode steps of a dense Qwen3 through :func:`~mixrl.rl.engine.decode.decode_step` (the same
computation, bit-identical, without transformers' per-step Python).

This module does no I/O and knows nothing of HTTP; the scheduler calls it from a worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mixrl.api.trajectory import TokenRecord
from mixrl.rl.engine.attention import use_engine_attention
from mixrl.rl.engine.decode import decode_step, supports_decode_step
from mixrl.rl.engine.kv_cache import (
    BatchKV,
    LayerKV,
    PrefixCache,
    concat,
    new_cache,
    prefilled_batch,
    row_kv,
    shared_prefixes,
)
from mixrl.rl.engine.sampling import RowSampling, sample_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MAX_SHARED_PREFIX_PASSES = 4
"""At most this many extra forward passes per admission compute prefixes that its prompts share."""


@dataclass
class Sequence:
    """One request's generation state."""

    rid: str
    prompt_ids: list[int]
    sampling: RowSampling
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    tokens: list[TokenRecord] = field(default_factory=list)
    finish_reason: dict | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    cached_tokens: int = 0
    """Prompt tokens whose keys and values came from the prefix cache (SGLang's ``cached_tokens``)."""
    weights_epoch: int = -1
    """The runner's weights epoch when this sequence was prefilled (its cache is of those weights)."""
    stop_check: Callable[[list[int]], str | None] | None = None
    """The stop string the output ids end in, if any (the service's stop strings; needs a tokenizer)."""

    @property
    def output_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def abort(self, message: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = {"type": "abort", "message": message}


@dataclass
class _Running:
    seqs: list[Sequence]
    kv: BatchKV | None  # None when decoding without a KV cache
    pending: Tensor  # [B] the last sampled token of each row, not yet fed to the model


class ModelRunner:
    """Owns the model and the running batch; every method runs on one thread at a time."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        weight_version: int,
        context_length: int,
        kv_scales: Seq[tuple[float, float] | None],
        pad_token_id: int = 0,
        use_kv_cache: bool = True,
        seed: int = 0,
        prefix_cache_tokens: int = 0,
        attention_backend: str = "sdpa",
    ) -> None:
        self.model = model
        # SDPA without a copy of the keys and values per query head, or a serving kernel's order
        use_engine_attention(model, attention_backend)
        # Decode steps without transformers' per-step Python where the model allows it (decode.py)
        self._lean_decode = supports_decode_step(model)
        self.weights_epoch = 0
        self.prefix_cache = (
            PrefixCache(prefix_cache_tokens) if use_kv_cache and prefix_cache_tokens > 0 else None
        )
        self.weight_version = weight_version
        self.context_length = context_length
        self.kv_scales = list(kv_scales)
        self.pad_token_id = pad_token_id
        self.use_kv_cache = use_kv_cache
        self.default_generator = torch.Generator().manual_seed(seed)
        self._running: _Running | None = None
        self.tokens_generated = 0  # over the runner's lifetime
        # Over the runner's lifetime, for the engine's metrics: prompt tokens prefilled, and how many
        # of them the prefix cache supplied (cache hit rate = cached / prompt).
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])

    # ------------------------------------------------------------------ state
    @property
    def weight_version(self) -> int:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        # Set by every weight update (and relabel): the held keys and values may be of other weights.
        self._weight_version = version
        self.weights_changed()

    @property
    def kv_scales(self) -> list[tuple[float, float] | None]:
        return self._kv_scales

    @kv_scales.setter
    def kv_scales(self, scales: Seq[tuple[float, float] | None]) -> None:
        self._kv_scales = list(scales)
        self.weights_changed()

    def weights_changed(self) -> None:
        """Forget every cached prefix; sequences prefilled before now will not be cached."""
        self.weights_epoch += 1
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def flush_prefix_cache(self) -> None:
        """SGLang's ``/flush_cache``: drop every cached prefix (running sequences are untouched)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @property
    def running(self) -> list[Sequence]:
        return list(self._running.seqs) if self._running else []

    def kv_used_tokens(self) -> int:
        """Real tokens held in the running batch's KV cache (0 without a cache)."""
        return self._running.kv.used_tokens() if self._running and self._running.kv else 0

    def prefix_cache_tokens(self) -> int:
        """Tokens held by the prefix cache (0 without one)."""
        return self.prefix_cache.held_tokens if self.prefix_cache is not None else 0

    # ------------------------------------------------------------------ batch changes
    def add(self, seqs: list[Sequence]) -> list[Sequence]:
        """Prefill ``seqs``, sample their first token, join the batch; returns those already finished."""
        for seq in seqs:
            if seq.max_new_tokens <= 0:
                seq.finish_reason = {"type": "length", "length": 0}
        finished = [s.finished for s in seqs]  # one snapshot, as in _drop_finished
        live = [s for s, f in zip(seqs, finished, strict=True) if not f]
        done = [s for s, f in zip(seqs, finished, strict=True) if f]
        if not live:
            return done
        if self.use_kv_cache:
            kv, logits = self._prefill(live)
        else:
            ids, mask = self._left_padded([s.prompt_ids for s in live])
            kv = None
            logits = self._forward(ids, mask, None)
        pending = self._sample_into(live, logits)
        new = _Running(seqs=live, kv=kv, pending=pending)
        self._running = new if self._running is None else self._merge(self._running, new)
        return done + self._drop_finished()

    def step(self) -> list[Sequence]:
        """One decode step for every running sequence; returns the sequences that finished."""
        run = self._running
        if run is None:
            return []
        if run.kv is not None:
            positions = run.kv.next_positions()
            mask = run.kv.append_column()
            if self._lean_decode:
                logits = decode_step(self.model, run.pending[:, None], mask, positions, run.kv.cache)
            else:
                logits = self._forward(run.pending[:, None], mask, run.kv, positions=positions)
        else:
            ids, mask = self._left_padded([s.prompt_ids + s.output_ids for s in run.seqs])
            logits = self._forward(ids, mask, None)
        run.pending = self._sample_into(run.seqs, logits)
        return self._drop_finished()

    def abort(self, rids: set[str] | None, message: str) -> list[Sequence]:
        """Abort running sequences (all when ``rids`` is None); returns them."""
        for seq in self.running:
            if rids is None or seq.rid in rids:
                seq.abort(message)
        return self._drop_finished()

    def reset(self, message: str) -> list[Sequence]:
        """Abort every running sequence and forget the batch (after a failed step); returns them."""
        seqs = self.running
        for seq in seqs:
            seq.abort(message)
        self._running = None
        return seqs

    def drop_finished(self) -> list[Sequence]:
        """Remove sequences already marked finished (e.g. aborted from outside); returns them."""
        return self._drop_finished()

    # ------------------------------------------------------------------ internals
    def _prefill(self, seqs: list[Sequence]) -> tuple[BatchKV, Tensor]:
        """Prefill ``seqs`` into a new batch cache, on top of their cached prefixes where there are any."""
        prompts = [s.prompt_ids for s in seqs]
        shared = self._share_prefixes(prompts) if self.prefix_cache is not None and len(seqs) > 1 else []
        hits = [self.prefix_cache.match(p) if self.prefix_cache else (0, []) for p in prompts]
        # A prefix computed for the batch just now is charged to the first row that reuses it, as
        # SGLang's in-batch prefix caching has one request compute it and the others hit it: the
        # cached counts (and the hit rate) count only what the batch did not compute.
        charged = [0] * len(seqs)
        for prefix, computed in shared:
            for row, (prompt, (n, _)) in enumerate(zip(prompts, hits, strict=True)):
                if n >= len(prefix) and tuple(prompt[: len(prefix)]) == prefix:
                    charged[row] += computed
                    break
        for seq, (n, _), charge in zip(seqs, hits, charged, strict=True):
            seq.cached_tokens = max(n - charge, 0)
            seq.weights_epoch = self.weights_epoch
            self.prompt_tokens_total += len(seq.prompt_ids)
            self.cached_tokens_total += seq.cached_tokens
        new_parts = [p[n:] for p, (n, _) in zip(prompts, hits, strict=True)]
        return self._prefill_rows(new_parts, hits, decode_room=max(s.max_new_tokens for s in seqs))

    def _share_prefixes(self, prompts: list[list[int]]) -> list[tuple[tuple[int, ...], int]]:
        """Compute the prefixes that several of ``prompts`` share (:func:`shared_prefixes`) once each,
        into the prefix cache; returns each with the number of tokens computed for it.

        A prefix that extends another one is computed in a later pass, on top of it (the samples of
        two prompts under one system prompt: the system prompt, then each prompt's own part).
        """
        cache = self.prefix_cache
        assert cache is not None
        pending = shared_prefixes(prompts, [cache.match(p)[0] for p in prompts])
        done: list[tuple[tuple[int, ...], int]] = []
        for _ in range(MAX_SHARED_PREFIX_PASSES):
            if not pending:
                break
            ready = [p for p in pending if not any(len(q) < len(p) and p[: len(q)] == q for q in pending)]
            hits = [cache.match(p) for p in ready]
            kv, _ = self._prefill_rows([list(p[n:]) for p, (n, _) in zip(ready, hits, strict=True)], hits)
            for row, (prefix, (n, _)) in enumerate(zip(ready, hits, strict=True)):
                cache.insert(prefix, row_kv(kv, row))
                done.append((prefix, len(prefix) - n))
            pending = [p for p in pending if p not in ready]
        return done

    def _prefill_rows(
        self, new_parts: list[list[int]], hits: list[tuple[int, LayerKV]], decode_room: int = 0
    ) -> tuple[BatchKV, Tensor]:
        """Prefill each row's ``new_parts`` on top of its cached prefix (``hits``: length and keys and
        values); ``decode_room``: columns to allocate beyond them for the decode steps to come."""
        ids, new_mask = self._left_padded(new_parts)
        if not any(n for n, _ in hits):
            kv = BatchKV(cache=new_cache(self.kv_scales), mask=new_mask)
            logits = self._forward(ids, new_mask, kv)
        else:
            # Room for the new tokens and the decode steps to come, written in place rather than
            # into a grown copy; at most twice the filled width, what the first growth would take.
            filled = max(n for n, _ in hits) + ids.shape[1]
            kv, width = prefilled_batch(hits, self.kv_scales, room=filled + min(decode_room, filled))
            kv.mask = torch.cat([kv.mask, new_mask], dim=1)
            positions = (kv.mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, width:]
            logits = self._forward(ids, kv.mask, kv, positions=positions)
        kv.zero_padding()
        return kv, logits

    def _cache_finished(self, run: _Running, rows: list[int]) -> None:
        """Hand the keys and values of finished rows to the prefix cache (those of current weights)."""
        if self.prefix_cache is None or run.kv is None:
            return
        for row in rows:
            seq = run.seqs[row]
            if seq.weights_epoch != self.weights_epoch:
                continue  # (partly) computed by weights that are no longer served
            kv = row_kv(run.kv, row)
            fed = (seq.prompt_ids + seq.output_ids)[: int(kv[0][0].shape[1])] if kv else []
            self.prefix_cache.insert(fed, kv)

    def _left_padded(self, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = True
        return ids, mask

    @torch.inference_mode()
    def _forward(
        self, ids: Tensor, mask: Tensor, kv: BatchKV | None, positions: Tensor | None = None
    ) -> Tensor:
        if positions is None:
            positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=kv.cache if kv is not None else None,
            use_cache=kv is not None,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float()

    def _sample_into(self, seqs: list[Sequence], logits: Tensor) -> Tensor:
        uniforms = torch.zeros(len(seqs), dtype=torch.float32)
        for i, seq in enumerate(seqs):
            if not seq.sampling.greedy:
                uniforms[i] = torch.rand((), generator=seq.generator or self.default_generator)
        records = sample_rows(logits, [s.sampling for s in seqs], uniforms, self.weight_version)
        now = time.perf_counter()
        self.tokens_generated += len(seqs)
        for seq, record in zip(seqs, records, strict=True):
            seq.tokens.append(record)
            seq.first_token_time = seq.first_token_time or now
            seq.last_token_time = now
            self._check_finished(seq)
        return torch.tensor([r.token_id for r in records], dtype=torch.long)

    def _check_finished(self, seq: Sequence) -> None:
        if seq.finish_reason is not None:
            # Aborted from the event loop while this step ran on the model thread: /abort_request
            # has counted it aborted, and so it ends (with this step's token, which is genuine).
            return
        last = seq.tokens[-1].token_id
        if last in seq.stop_token_ids:
            seq.finish_reason = {"type": "stop", "matched": last}
        elif seq.stop_check is not None and (matched := seq.stop_check(seq.output_ids)) is not None:
            seq.finish_reason = {"type": "stop", "matched": matched}
        elif (
            len(seq.tokens) >= seq.max_new_tokens
            or len(seq.prompt_ids) + len(seq.tokens) >= self.context_length
        ):
            seq.finish_reason = {"type": "length", "length": len(seq.tokens)}

    def _merge(self, old: _Running, new: _Running) -> _Running:
        kv = concat(old.kv, new.kv) if old.kv is not None and new.kv is not None else None
        return _Running(seqs=old.seqs + new.seqs, kv=kv, pending=torch.cat([old.pending, new.pending]))

    def _drop_finished(self) -> list[Sequence]:
        run = self._running
        if run is None:
            return []
        # one snapshot: abort() may mark a sequence from another thread while this runs
        finished = [s.finished for s in run.seqs]
        if not any(finished):
            return []
        done = [s for s, f in zip(run.seqs, finished, strict=True) if f]
        keep = [i for i, f in enumerate(finished) if not f]
        self._cache_finished(run, [i for i, f in enumerate(finished) if f])
        if not keep:
            self._running = None
            return done
        if run.kv is not None:
            run.kv.select(keep)
        run.seqs = [run.seqs[i] for i in keep]
        run.pending = run.pending[keep]
        return done
