"""The public objective: :func:`token_policy_loss` on given logits, and
:func:`chunked_token_policy_loss` from hidden states and the LM head without ever holding the
[N, V] logits of the whole batch.

Both are custom autograd functions around the same per-block math (:mod:`.objective`): the forward
keeps only O(K) numbers per position, and the backward recomputes each block's logits and writes
the closed-form gradient, so the peak memory is one block of logits, not several [N, V] tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mixrl.rl.corrections.config import CorrectionConfig, CorrectionInputError
from mixrl.rl.corrections.diagnostics import PolicyLossMetrics, build_metrics
from mixrl.rl.corrections.objective import (
    CorrectedTerms,
    PreparedBatch,
    compute_dtype,
    corrected_terms,
    extreme_ratio,
    logit_gradient,
    prepare_batch,
    vocab_sums,
)
from mixrl.rl.corrections.tokens import LossTokens
from mixrl.rl.corrections.vocab import VocabShard, global_vocab_size

_WORK_ELEMENTS = 1 << 24
"""token_policy_loss processes its given logits this many fp32 elements (64 MiB) at a time."""


def _blocks(num_rows: int, block: int) -> Iterator[slice]:
    for r0 in range(0, num_rows, block):
        yield slice(r0, min(r0 + block, num_rows))


def _concat(parts: list[CorrectedTerms], like: Tensor, k: int) -> CorrectedTerms:
    fields = CorrectedTerms.__dataclass_fields__
    if not parts:  # every token is masked out
        return CorrectedTerms(
            **{name: like.new_zeros((0, k) if name == "sparse" else (0,)) for name in fields}
        )
    return CorrectedTerms(**{name: torch.cat([getattr(p, name) for p in parts]) for name in fields})


def _scaled(terms: CorrectedTerms, g: Tensor) -> CorrectedTerms:
    """The gradient coefficients multiplied by the upstream gradient of the loss."""
    return replace(terms, dense=terms.dense * g, sparse=terms.sparse * g, token=terms.token * g)


class _LogitsObjective(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        batch: PreparedBatch,
        config: CorrectionConfig,
        shard: VocabShard,
        out: list[CorrectedTerms],
    ) -> Tensor:
        rows = batch.rows
        block = max(1, _WORK_ELEMENTS // max(logits.shape[1], 1))
        parts = []
        for sl in _blocks(rows.num_rows, block):
            u = _logit_rows(logits, batch.loss_rows, sl)
            block_rows = rows.take(sl)
            parts.append(
                corrected_terms(vocab_sums(u, block_rows, shard), block_rows, config, batch.denominator)
            )
        terms = _concat(parts, rows.advantages, rows.cand_ids.shape[1])
        out.append(terms)
        ctx.save_for_backward(logits)
        ctx.batch, ctx.terms, ctx.shard, ctx.block = batch, terms, shard, block
        return terms.loss.sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        (logits,) = ctx.saved_tensors
        batch, shard = ctx.batch, ctx.shard
        terms = _scaled(ctx.terms, grad_loss)
        grad = torch.zeros_like(logits) if batch.loss_rows is not None else torch.empty_like(logits)
        for sl in _blocks(batch.rows.num_rows, ctx.block):
            z = _logit_rows(logits, batch.loss_rows, sl)
            g = logit_gradient(z, _take(terms, sl), batch.rows.take(sl), shard).to(logits.dtype)
            if batch.loss_rows is None:
                grad[sl] = g
            else:
                grad.index_copy_(0, batch.loss_rows[sl], g)
        return grad, None, None, None, None


def _logit_rows(logits: Tensor, loss_rows: Tensor | None, sl: slice) -> Tensor:
    """A private copy, in the compute dtype, of the given logits' rows ``sl`` (of the loss rows)."""
    dtype = compute_dtype(logits.dtype)
    if loss_rows is None:
        # Contiguous whatever the logits' strides (a transposed view): the passes view it flat.
        return logits[sl].to(dtype, copy=True, memory_format=torch.contiguous_format)
    return logits.index_select(0, loss_rows[sl]).to(dtype)


def _take(terms: CorrectedTerms, sl: slice) -> CorrectedTerms:
    return CorrectedTerms(**{name: getattr(terms, name)[sl] for name in CorrectedTerms.__dataclass_fields__})


class _ChunkedObjective(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        batch: PreparedBatch,
        config: CorrectionConfig,
        shard: VocabShard,
        chunk_size: int,
        temperature: float,
        out: list[CorrectedTerms],
    ) -> Tensor:
        h = hidden if batch.loss_rows is None else hidden.index_select(0, batch.loss_rows)
        if temperature != 1.0:
            h = h / temperature
        parts = []
        for sl in _blocks(batch.rows.num_rows, chunk_size):
            u = (h[sl] @ weight.T).to(compute_dtype(h.dtype))  # a fresh buffer: vocab_sums may overwrite it
            block_rows = batch.rows.take(sl)
            parts.append(
                corrected_terms(vocab_sums(u, block_rows, shard), block_rows, config, batch.denominator)
            )
        terms = _concat(parts, batch.rows.advantages, batch.rows.cand_ids.shape[1])
        out.append(terms)
        ctx.save_for_backward(h, weight)
        ctx.batch, ctx.terms, ctx.shard = batch, terms, shard
        ctx.chunk_size, ctx.temperature, ctx.hidden_shape = chunk_size, temperature, hidden.shape
        return terms.loss.sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        h, weight = ctx.saved_tensors
        batch, shard = ctx.batch, ctx.shard
        terms = _scaled(ctx.terms, grad_loss)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cd = compute_dtype(h.dtype)
        grad_h = torch.zeros(h.shape, dtype=cd, device=h.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=cd, device=weight.device) if want_w else None
        for sl in _blocks(batch.rows.num_rows, ctx.chunk_size):
            z = (h[sl] @ weight.T).to(cd)
            g = logit_gradient(z, _take(terms, sl), batch.rows.take(sl), shard)
            if grad_h is not None:
                grad_h[sl] = g.to(weight.dtype) @ weight
            if grad_w is not None:
                grad_w.addmm_(g.T, h[sl].to(cd))
        grad_hidden = None
        if grad_h is not None:
            grad_h = grad_h / ctx.temperature
            if batch.loss_rows is None:
                grad_hidden = grad_h.to(h.dtype)
            else:
                grad_hidden = torch.zeros(ctx.hidden_shape, dtype=h.dtype, device=h.device)
                grad_hidden.index_copy_(0, batch.loss_rows, grad_h.to(h.dtype))
        grad_weight = grad_w.to(weight.dtype) if grad_w is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _metrics(terms: CorrectedTerms, config: CorrectionConfig, batch: PreparedBatch) -> PolicyLossMetrics:
    lr = terms.log_ratio
    r = lr.exp()
    mis_masked = (terms.weight == 0).float() if config.mis is not None else torch.zeros_like(lr)
    per_row = {
        "log_ratio": lr,
        "abs_log_ratio": lr.abs(),
        "k1": -lr,
        "k3": (r - 1.0) - lr,
        "extreme_ratio": extreme_ratio(lr),
        "mis_masked": mis_masked,
        "weight": terms.weight,
        "entropy": terms.entropy,
    }
    return build_metrics(per_row, batch.loss_rows, batch.num_tokens)


def _check_common(config: object, vocab_group: object, vocab_start: int) -> None:
    if not isinstance(config, CorrectionConfig):
        raise CorrectionInputError(f"config must be a CorrectionConfig, got {type(config).__name__}")
    if vocab_group is None and vocab_start != 0:
        raise CorrectionInputError(f"vocab_start must be 0 without a vocab_group, got {vocab_start}")
    if vocab_group is not None and not dist.is_initialized():
        raise CorrectionInputError("vocab_group given but torch.distributed is not initialized")


def _float_matrix(name: str, x: object, rows: int | None = None) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
        desc = f"{list(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise CorrectionInputError(f"{name} must be a 2-D floating-point tensor, got {desc}")
    if rows is not None and x.shape[0] != rows:
        raise CorrectionInputError(f"{name} must have {rows} rows, got {x.shape[0]}")
    return x


def _batch_of(
    rows: Tensor,
    shard: VocabShard,
    tokens: LossTokens,
    loss_mask: Tensor | None,
    num_loss_tokens: float | None,
) -> PreparedBatch:
    """The checked batch of ``rows`` (the logits, or the hidden states they come from): one row
    per token, computed on their device in the dtype their dtype calls for."""
    vocab_size = global_vocab_size(shard, rows.device)
    dtype = compute_dtype(rows.dtype)
    return prepare_batch(rows.shape[0], vocab_size, tokens, loss_mask, num_loss_tokens, dtype)


def token_policy_loss(
    logits: Tensor,
    tokens: LossTokens,
    config: CorrectionConfig,
    loss_mask: Tensor | None = None,
    *,
    num_loss_tokens: float | None = None,
    vocab_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> tuple[Tensor, PolicyLossMetrics]:
    """The corrected policy loss of docs/corrections.md on the trainer's logits.

    Args:
        logits: [N, V] trainer logits at the N generated positions, already divided by the sampling
            temperature; any float dtype (computed in fp32 inside; the gradient has logits' dtype).
            Under tensor parallelism: this rank's [N, V_shard] slice, see ``vocab_group``.
        tokens: the N tokens' record (:class:`LossTokens`): sampled ids, advantages, the sampler's
            log q(a), its top-K candidates and their log q, and the size of its sampling support.
        config: which corrections to apply (:class:`CorrectionConfig`).
        loss_mask: [N] optional 0/1; 0 positions (tool output) contribute nothing, are not counted
            and are not checked.
        num_loss_tokens: divide by this count instead of this batch's number of loss tokens (for
            gradient accumulation over micro-batches).
        vocab_group: tensor-parallel process group across which the vocabulary is sharded; every
            vocabulary reduction is then all-reduced over it.  Every rank gets the same loss.
        vocab_start: first global token id of this rank's shard.

    Returns:
        ``(loss, metrics)``: loss = −Σ surrogate / number of loss tokens (MIS-masked tokens
        counted), a scalar fp32 tensor; metrics: :class:`PolicyLossMetrics` (keys in
        :data:`METRIC_KEYS`).

    Raises:
        CorrectionInputError (a ValueError): one line naming the bad argument and the reason.
    """
    _check_common(config, vocab_group, vocab_start)
    logits = _float_matrix("logits", logits)
    shard = VocabShard(start=vocab_start, size=logits.shape[1], group=vocab_group)
    batch = _batch_of(logits, shard, tokens, loss_mask, num_loss_tokens)
    out: list[CorrectedTerms] = []
    # torch.autograd.Function.apply is unannotated
    loss: torch.Tensor = _LogitsObjective.apply(logits, batch, config, shard, out)  # type: ignore[no-untyped-call]
    return loss, _metrics(out[0], config, batch)


def chunked_token_policy_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    tokens: LossTokens,
    config: CorrectionConfig,
    loss_mask: Tensor | None = None,
    chunk_size: int = 1024,
    *,
    temperature: float = 1.0,
    num_loss_tokens: float | None = None,
    vocab_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> tuple[Tensor, PolicyLossMetrics]:
    """:func:`token_policy_loss` with logits = hidden @ lm_head_weightᵀ / temperature, computed
    ``chunk_size`` positions at a time in the forward and again in the backward, so no more than
    one chunk's logits ever exist.  Gradients flow to ``hidden`` and ``lm_head_weight``.

    Args:
        hidden: [N, H] final hidden states at the N generated positions.
        lm_head_weight: [V, H] output embedding (under tensor parallelism this rank's
            [V_shard, H] rows, starting at global id ``vocab_start``).
        chunk_size: positions per chunk; memory is about chunk_size × V × 4 bytes.
        temperature: the sampling temperature the logits are divided by.
        The other arguments are those of :func:`token_policy_loss`.

    The matmul runs in the inputs' dtype (as the trainer's own LM head would); everything after it
    in fp32.  Under tensor parallelism the returned gradient w.r.t. ``hidden`` is this shard's
    contribution: sum it across ``vocab_group`` (Megatron's ``copy_to_tensor_model_parallel_region``
    in front of the output layer does exactly that).
    """
    _check_common(config, vocab_group, vocab_start)
    hidden = _float_matrix("hidden", hidden)
    lm_head_weight = _float_matrix("lm_head_weight", lm_head_weight)
    if lm_head_weight.shape[1] != hidden.shape[1]:
        raise CorrectionInputError(
            f"lm_head_weight must be [V, H] with H = {hidden.shape[1]} (hidden's width), "
            f"got {list(lm_head_weight.shape)}"
        )
    if lm_head_weight.dtype != hidden.dtype:
        raise CorrectionInputError(
            f"lm_head_weight dtype {lm_head_weight.dtype} differs from hidden's {hidden.dtype}"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise CorrectionInputError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if not (isinstance(temperature, int | float) and 0.0 < temperature < float("inf")):
        raise CorrectionInputError(f"temperature must be a positive finite number, got {temperature!r}")
    shard = VocabShard(start=vocab_start, size=lm_head_weight.shape[0], group=vocab_group)
    batch = _batch_of(hidden, shard, tokens, loss_mask, num_loss_tokens)
    out: list[CorrectedTerms] = []
    # torch.autograd.Function.apply is unannotated
    loss: torch.Tensor = _ChunkedObjective.apply(  # type: ignore[no-untyped-call]
        hidden, lm_head_weight, batch, config, shard, chunk_size, float(temperature), out
    )
    return loss, _metrics(out[0], config, batch)


__all__ = ["chunked_token_policy_loss", "token_policy_loss"]
