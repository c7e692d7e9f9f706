"""Next-token sampling, one :class:`TokenRecord` per row (docs/architecture.md, "The token record").

The only sampler: the engine's runner and the in-process sampler (:mod:`mixrl.rl.rollout.local_sampler`)
both call :func:`sample_rows`.

For each row of a batch of next-token logits z and that row's parameters:

    log q      = log_softmax(z / T)                      the untruncated distribution (what is reported)
    order      = vocabulary sorted by log q, descending (ties: lower token id first)
    S          = the leading tokens of `order` kept by every active truncation:
                   top-k:  rank < k
                   top-p:  probability mass strictly before the token < p   (the smallest prefix
                           whose mass reaches p)
                   min-p:  q(token) >= min_p * max q
                 each rule keeps a prefix of `order`, so S is a prefix too; it always holds the top token
    sample     = inverse CDF of q renormalized on S at a uniform u in [0, 1)

Temperature 0 means greedy, as in SGLang: T is taken as 1 (so log q stays finite) and k as 1, so
greedy decoding truncates to S = {top token} (:mod:`mixrl.api.sampling` says why).
`support_size` is |S| when any truncation is active and 0 when the row samples from the whole
vocabulary (the token-record convention).  A record's candidates are the leading entries of
`order`: ``num_candidates`` of them, and at least |S| whenever the row truncates, so S is always the
leading `support_size` candidates.  With ``cover_support`` (SGLang's ``return_sampling_mask``) the
support cap applies as one more top-k, and the candidates are at least as many as the tokens
kept, truncated or not; the response reports them all (docs/engine.md, "K ≥ |S|").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mixrl.api.sampling import SamplingRule
from mixrl.api.trajectory import TokenRecord


@dataclass(frozen=True)
class RowSampling(SamplingRule):
    """One row's sampling rule and what it reports."""

    num_candidates: int = 0  # top_logprobs_num
    cover_support: bool = False  # report at least |S| candidates (return_sampling_mask)
    support_cap: int = 0  # extra top-k applied when cover_support (the sampling-mask size cap); 0 = none

    def rank_limit(self, vocab_size: int) -> int:
        """The top-k actually applied: the rule's, and the support cap when reporting the support."""
        k = super().rank_limit(vocab_size)
        if self.cover_support and self.support_cap > 0:
            k = min(k, self.support_cap)
        return k


def sort_descending(logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.sort(logprobs, dim=-1, descending=True, stable=True)``: values and token ids by
    decreasing log-prob, the lower id first on ties.

    On the CPU, as one sort of distinct integer keys (NumPy's vectorized sort): each key is the
    value mapped to an integer of the same order, then the token id, so no two keys tie and the
    order is the stable one; ~4x faster than ``torch.sort`` over a 2,048-token vocabulary, which was
    a tenth of a decode step.  Elsewhere, or with a NaN (whose place the keys do not model), it is
    ``torch.sort`` itself.
    """
    vocab = int(logprobs.shape[-1])
    if logprobs.dim() != 2 or logprobs.device.type != "cpu" or logprobs.dtype != torch.float32 or vocab < 2:
        return torch.sort(logprobs, dim=-1, descending=True, stable=True)
    # descending order of the values = ascending order of their negation; + 0.0 turns -0.0 into 0.0,
    # which sort compares equal (a tie, broken by the id)
    negated = (-logprobs.detach().numpy()) + np.float32(0.0)
    if np.isnan(negated).any():
        return torch.sort(logprobs, dim=-1, descending=True, stable=True)
    bits = negated.view(np.int32)
    ordered = bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))  # IEEE floats as integers of the same order
    shift = (vocab - 1).bit_length()
    keys = (ordered.astype(np.int64) << shift) | np.arange(vocab, dtype=np.int64)
    keys.sort(axis=-1)
    order = torch.from_numpy(keys & ((1 << shift) - 1))
    return logprobs.gather(1, order), order


def sample_rows(
    logits: Tensor, rows: list[RowSampling], uniforms: Tensor, weight_version: int
) -> list[TokenRecord]:
    """Sample one token per row of ``logits`` [B, V]; ``uniforms`` [B] are the rows' draws in [0, 1).

    ``weight_version``: the version of the weights that computed ``logits``, recorded on every token.
    """
    batch, vocab = logits.shape
    if len(rows) != batch or uniforms.shape != (batch,):
        raise ValueError(f"rows/uniforms: expected {batch} rows, got {len(rows)} and {tuple(uniforms.shape)}")
    temperature = torch.tensor([1.0 if r.greedy else r.temperature for r in rows], dtype=torch.float32)
    top_k = torch.tensor([r.rank_limit(vocab) for r in rows], dtype=torch.long)
    top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32)
    min_p = torch.tensor([r.min_p for r in rows], dtype=torch.float32)

    logprobs = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    sorted_lp, order = sort_descending(logprobs)
    sorted_p = sorted_lp.exp()
    cumulative = torch.cumsum(sorted_p, dim=-1)
    if any(r.truncates(vocab) for r in rows):
        mass_before = cumulative - sorted_p
        rank = torch.arange(vocab)
        keep = rank[None, :] < top_k[:, None]
        keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
        keep[:, 0] = True
        kept = keep.sum(dim=-1)
        kept_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        cdf = torch.cumsum(kept_p, dim=-1)
    else:
        # No row truncates: every rule above keeps every token, so S is the whole vocabulary and
        # its CDF is the cumulative mass itself (the same sums, bit for bit), computed once.
        kept = torch.full((batch,), vocab, dtype=torch.long)
        cdf = cumulative
    total = cdf[:, -1]
    position = (cdf < (uniforms.float() * total)[:, None]).sum(dim=-1)
    position = torch.minimum(position, kept - 1)
    sampled = order.gather(1, position[:, None]).squeeze(1)
    sampled_lp = sorted_lp.gather(1, position[:, None]).squeeze(1)

    kept_list = kept.tolist()
    support = [n if r.truncates(vocab) else 0 for n, r in zip(kept_list, rows, strict=True)]
    wanted = [
        max(r.num_candidates, n if r.cover_support or s else 0)
        for n, s, r in zip(kept_list, support, rows, strict=True)
    ]
    width = min(max(wanted, default=0), vocab)
    head_ids = order[:, :width].tolist()
    head_lp = sorted_lp[:, :width].tolist()
    return [
        TokenRecord(
            token_id=token,
            logprob=logprob,
            cand_ids=ids[:k],
            cand_logprobs=lps[:k],
            support_size=s,
            weight_version=weight_version,
        )
        for token, logprob, ids, lps, k, s in zip(
            sampled.tolist(), sampled_lp.tolist(), head_ids, head_lp, wanted, support, strict=True
        )
    ]
