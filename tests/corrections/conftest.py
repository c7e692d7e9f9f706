"""Tests of the corrected policy objective (mixrl.rl.corrections).

Real: every function under test runs exactly as a trainer calls it — the autograd functions, the
chunked recomputation, the validation, and real ``torch.distributed`` collectives for the
tensor-parallel seam.

Stand-ins: the trainer's logits / hidden states and the sampler's records are synthetic random
tensors (no model, no engine); tensor parallelism is two CPU processes on the gloo backend standing
in for a Megatron tensor-parallel group on NCCL (the same all-reduce calls).  The expected values
come from exact enumeration over small vocabularies and from the dense float64 reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
from torch import Tensor

from mixrl.rl.corrections import LossTokens


@dataclass(frozen=True)
class Batch:
    """One batch of trainer logits and sampler records, laid out as the objective takes them."""

    logits: Tensor
    tokens: Tensor
    advantages: Tensor
    sampler_logprobs: Tensor
    cand_ids: Tensor
    cand_logprobs: Tensor
    support_size: Tensor
    loss_mask: Tensor | None = None

    def records(self) -> LossTokens:
        """The tokens' record, the argument that follows ``logits``."""
        return LossTokens(
            tokens=self.tokens,
            advantages=self.advantages,
            sampler_logprobs=self.sampler_logprobs,
            cand_ids=self.cand_ids,
            cand_logprobs=self.cand_logprobs,
            support_size=self.support_size,
        )

    def with_(self, **changes: object) -> Batch:
        return replace(self, **changes)


def random_batch(
    n: int,
    vocab: int,
    k: int,
    *,
    seed: int,
    dtype: torch.dtype = torch.float64,
    support_prob: float = 0.5,
    pad_prob: float = 0.3,
    mask_prob: float = 0.0,
    logit_scale: float = 2.0,
    mismatch: float = 0.7,
) -> Batch:
    """Trainer logits z, a sampler q = softmax(z + mismatch·noise), its top-k record, and tokens
    sampled from q (renormalized on the support when there is one)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * logit_scale
    log_q = torch.log_softmax(z + mismatch * torch.randn(n, vocab, generator=g, dtype=torch.float64), dim=-1)
    cand_logprobs, cand_ids = log_q.topk(k, dim=-1)
    support = torch.zeros(n, dtype=torch.long)
    tokens = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        kept = k
        if k and torch.rand((), generator=g) < pad_prob:
            kept = int(torch.randint(0, k + 1, (), generator=g))
            cand_ids[i, kept:] = -1
            cand_logprobs[i, kept:] = float("-inf")
        if kept and torch.rand((), generator=g) < support_prob:
            support[i] = int(torch.randint(1, kept + 1, (), generator=g))
            probs = cand_logprobs[i, : support[i]].softmax(0)
            tokens[i] = cand_ids[i, torch.multinomial(probs, 1, generator=g)]
        else:
            tokens[i] = torch.multinomial(log_q[i].exp(), 1, generator=g)
    mask = None
    if mask_prob > 0:
        mask = (torch.rand(n, generator=g) >= mask_prob).long()
    return Batch(
        logits=z.to(dtype),
        tokens=tokens,
        advantages=torch.randn(n, generator=g, dtype=torch.float64).to(dtype),
        sampler_logprobs=log_q.gather(1, tokens[:, None]).squeeze(1).to(dtype),
        cand_ids=cand_ids,
        cand_logprobs=cand_logprobs.to(dtype),
        support_size=support,
        loss_mask=mask,
    )


@pytest.fixture(scope="session")
def make_batch() -> Callable[..., Batch]:
    return random_batch
