"""A plain, dense implementation of docs/corrections.md, for checking the fast path and as the naive
baseline of ``bench/corrections.py``.

It materializes every distribution as a full [N, V] tensor and lets autograd differentiate the
surrogate, so it reads line by line against the design and costs many [N, V] buffers.  It runs in
the dtype of ``logits`` (the tests use float64) and does not check its inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mixrl.rl.corrections.config import CorrectionConfig
from mixrl.rl.corrections.tokens import LossTokens


def _on_vocab(ids: Tensor, values: Tensor, keep: Tensor, vocab: int, fill: float) -> Tensor:
    """[N, V] tensor holding ``values`` at ``ids`` where ``keep``, ``fill`` elsewhere."""
    out = torch.full((ids.shape[0], vocab), fill, dtype=values.dtype, device=values.device)
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    out[rows[keep], ids[keep]] = values[keep]
    return out


def reference_token_policy_loss(
    logits: Tensor,
    records: LossTokens,
    config: CorrectionConfig,
    loss_mask: Tensor | None = None,
) -> Tensor:
    """The loss of :func:`~mixrl.rl.corrections.token_policy_loss`, computed densely."""
    tokens, advantages, sampler_logprobs = records.tokens, records.advantages, records.sampler_logprobs
    cand_ids, cand_logprobs, support_size = records.cand_ids, records.cand_logprobs, records.support_size
    z = logits
    n, vocab = z.shape
    k = cand_ids.shape[1]
    dt = z.dtype
    a = tokens.long()[:, None]
    valid = cand_ids >= 0
    in_s = (torch.arange(k, device=z.device) < support_size[:, None]) & valid
    has_s = (support_size > 0)[:, None]
    lq = cand_logprobs.to(dt)

    # Trainer distribution p, and the sampler's record spread over the vocabulary.
    log_p = torch.log_softmax(z, dim=-1)
    in_c_vocab = _on_vocab(cand_ids, torch.ones_like(lq), valid, vocab, 0.0) > 0
    in_s_vocab = _on_vocab(cand_ids, torch.ones_like(lq), in_s, vocab, 0.0) > 0
    log_q_vocab = _on_vocab(cand_ids, lq, valid, vocab, float("-inf"))

    # μ: q renormalized on S; or (whole vocabulary) q on C and p(1 − Q_C)/(1 − P_C) outside C.
    log_q_s = torch.logsumexp(lq.masked_fill(~in_s, float("-inf")), dim=1, keepdim=True)
    mu_support = torch.where(in_s_vocab, (log_q_vocab - log_q_s).exp(), 0.0)
    q_out = 1.0 - lq.masked_fill(~valid, float("-inf")).exp().sum(dim=1, keepdim=True)
    p = log_p.exp()
    p_out = torch.where(in_c_vocab, 0.0, p).sum(dim=1, keepdim=True)
    mu_whole = torch.where(in_c_vocab, log_q_vocab.exp(), p * q_out.clamp(min=0.0) / p_out)
    mu = torch.where(has_s, mu_support, mu_whole).detach()

    # π: p, or p renormalized on S under mask replay.
    replay = has_s & config.topp_replay
    log_pi = torch.where(replay, torch.log_softmax(z.masked_fill(~in_s_vocab, float("-inf")), dim=-1), log_p)
    pi = log_pi.exp()

    # Weights: the sampled token uses its recorded log q(a); the centering term uses μ(b).
    log_mu_a = sampler_logprobs.to(dt)[:, None] - torch.where(has_s, log_q_s, 0.0)
    r_a = (log_pi.gather(1, a) - log_mu_a).exp().detach()
    r = (pi / mu).detach()

    def weight(ratio: Tensor) -> Tensor:
        if config.mis is not None:
            lo, hi = config.mis
            return torch.where((ratio >= lo) & (ratio <= hi), ratio, 0.0)
        if config.tis is not None:
            return ratio.clamp(max=config.tis)
        return torch.ones_like(ratio)

    w_a = weight(r_a)
    sampled_term = w_a * log_pi.gather(1, a)
    if config.score_centering:
        support = torch.where(has_s, in_s_vocab, torch.ones_like(in_s_vocab))
        if config.mis is not None:
            lo, hi = config.mis
            c = torch.where((r >= lo) & (r <= hi), pi, 0.0)  # μ(b) w(b) = π(b) 1[lo ≤ r(b) ≤ hi]
        elif config.tis is not None:
            c = torch.minimum(pi, config.tis * mu)
        else:
            c = mu
        c = torch.where(support, c, 0.0).detach()
        centering = torch.where(c > 0, c * log_pi, 0.0).sum(dim=1, keepdim=True)
    else:
        centering = torch.zeros_like(sampled_term)
    surrogate = advantages.to(dt)[:, None] * (sampled_term - centering)
    mask = torch.ones(n, dtype=dt, device=z.device) if loss_mask is None else loss_mask.to(dt)
    return -(surrogate.squeeze(1) * mask).sum() / mask.sum().clamp(min=1.0)
