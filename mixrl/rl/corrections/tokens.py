"""The token record as tensors: what the objective takes, from the trainer's batch to the loss.

One :class:`LossTokens` holds, for N tokens in a fixed order, what each token's sampler recorded
(the token record of docs/architecture.md) and its advantage.  :func:`~mixrl.rl.corrections.
token_policy_loss`, :func:`~mixrl.rl.corrections.chunked_token_policy_loss`, the dense reference and
both trainer backends take it as it is; the objective's checks (:func:`~mixrl.rl.corrections.
objective.prepare_batch`) hand on the same type, converted to the dtypes it computes in.  The
trainer's batch extends it with where each token sits (:class:`mixrl.rl.trainer.batch.BatchTokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Self

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossTokens:
    """One entry per loss token: the sampled id, its advantage and the sampler's record of it."""

    tokens: Tensor
    """[N] int64: the sampled ids a."""
    advantages: Tensor
    """[N] float: the advantage A of each token (e.g. :func:`grpo_advantages`, broadcast)."""
    sampler_logprobs: Tensor
    """[N] float: log q(a) under the sampler's untruncated distribution after temperature (SGLang's
    ``output_token_logprobs``)."""
    cand_ids: Tensor
    """[N, K] int64: the sampler's top-K ids in descending probability, padded with -1."""
    cand_logprobs: Tensor
    """[N, K] float: their log q (same distribution), padded with -inf."""
    support_size: Tensor
    """[N] int64: how many leading candidates formed the sampling support S (top-p ∩ top-k);
    0 = sampled from the whole vocabulary."""

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def valid(self) -> Tensor:
        """[N, K] bool: the slot holds a candidate (not padding)."""
        return self.cand_ids >= 0

    @property
    def in_support(self) -> Tensor:
        """[N, K] bool: the slot's candidate belongs to the sampling support S."""
        k = torch.arange(self.cand_ids.shape[1], device=self.cand_ids.device)
        return k < self.support_size[:, None]

    def take(self, keep: Tensor | slice) -> Self:
        """The tokens ``keep`` (a [N] bool mask, an index tensor or a slice) selects, every field alike."""
        return type(self)(**{f.name: getattr(self, f.name)[keep] for f in fields(self)})

    def to(self, device: torch.device | str) -> Self:
        return type(self)(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def record(self) -> LossTokens:
        """Only the fields of this class (a subclass's placement dropped)."""
        return LossTokens(**{f.name: getattr(self, f.name) for f in fields(LossTokens)})
