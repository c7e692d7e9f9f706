"""Next-token sampling with everything the trainer needs recorded (DESIGN.md §4.2).

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

Temperature 0 means greedy, as in SGLang: T is taken as 1 (so log q stays finite) and k as 1.
`support_size` is |S| when any truncation is active and 0 when the row samples from the whole
vocabulary (the token-record convention).  The candidates a row reports are the leading entries of
`order`; with ``cover_support`` they are at least |S| long, so S is always the leading
`support_size` candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

GREEDY_EPS = 1e-6
"""Temperatures below this are greedy decoding."""


@dataclass(frozen=True)
class RowSampling:
    """One row's sampling rule and what it reports."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    min_p: float = 0.0
    num_candidates: int = 0  # top_logprobs_num
    cover_support: bool = False  # report at least |S| candidates (return_sampling_mask)
    support_cap: int = 0  # extra top-k applied when cover_support (the sampling-mask size cap); 0 = none

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def effective_top_k(self, vocab_size: int) -> int:
        """The top-k actually applied: 1 when greedy, the support cap when reporting the support."""
        k = vocab_size if self.top_k < 0 else min(self.top_k, vocab_size)
        if self.greedy:
            k = 1
        if self.cover_support and self.support_cap > 0:
            k = min(k, self.support_cap)
        return k

    def truncates(self, vocab_size: int) -> bool:
        """Whether any rule can remove tokens, i.e. whether the row samples from a support S."""
        return self.effective_top_k(vocab_size) < vocab_size or self.top_p < 1.0 or self.min_p > 0.0


@dataclass
class StepSample:
    """The sampling outcome of one batch step; per-row Python values, ready for the response."""

    token_ids: list[int]
    logprobs: list[float]  # log q(sampled token), untruncated
    sampling_logprobs: list[float]  # log q(sampled token) renormalized on S
    support_sizes: list[int]  # |S|, 0 when the row is not truncated
    cand_ids: list[list[int]]
    cand_logprobs: list[list[float]]


def sample_rows(logits: Tensor, rows: list[RowSampling], uniforms: Tensor) -> StepSample:
    """Sample one token per row of ``logits`` [B, V]; ``uniforms`` [B] are the rows' draws in [0, 1)."""
    batch, vocab = logits.shape
    if len(rows) != batch or uniforms.shape != (batch,):
        raise ValueError(f"rows/uniforms: expected {batch} rows, got {len(rows)} and {tuple(uniforms.shape)}")
    temperature = torch.tensor([1.0 if r.greedy else r.temperature for r in rows], dtype=torch.float32)
    top_k = torch.tensor([r.effective_top_k(vocab) for r in rows], dtype=torch.long)
    top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32)
    min_p = torch.tensor([r.min_p for r in rows], dtype=torch.float32)

    logprobs = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    sorted_p = sorted_lp.exp()
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    rank = torch.arange(vocab)
    keep = rank[None, :] < top_k[:, None]
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    keep[:, 0] = True
    support = keep.sum(dim=-1)

    kept_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    cdf = torch.cumsum(kept_p, dim=-1)
    total = cdf[:, -1]
    position = (cdf < (uniforms.float() * total)[:, None]).sum(dim=-1)
    position = torch.minimum(position, support - 1)
    sampled = order.gather(1, position[:, None]).squeeze(1)
    sampled_lp = sorted_lp.gather(1, position[:, None]).squeeze(1)
    renormalized_lp = sampled_lp - total.log()

    truncated = [r.truncates(vocab) for r in rows]
    support_list = support.tolist()
    wanted = [max(r.num_candidates, support_list[i] if r.cover_support else 0) for i, r in enumerate(rows)]
    width = min(max(wanted, default=0), vocab)
    head_ids = order[:, :width].tolist()
    head_lp = sorted_lp[:, :width].tolist()
    return StepSample(
        token_ids=sampled.tolist(),
        logprobs=sampled_lp.tolist(),
        sampling_logprobs=renormalized_lp.tolist(),
        support_sizes=[s if t else 0 for s, t in zip(support_list, truncated, strict=True)],
        cand_ids=[ids[:k] for ids, k in zip(head_ids, wanted, strict=True)],
        cand_logprobs=[lps[:k] for lps, k in zip(head_lp, wanted, strict=True)],
    )
