"""The corrected policy objective (docs/corrections.md): GRPO advantages, MIS/TIS weights, score
centering, top-p mask replay and the sampler–trainer mismatch metrics.  Pure torch, no I/O.

For a framework author::

    from mixrl.rl.corrections import CorrectionConfig, LossTokens, token_policy_loss
    tokens = LossTokens(tokens=ids, advantages=adv, sampler_logprobs=sampler_lp, cand_ids=cand_ids,
                        cand_logprobs=cand_lp, support_size=support_size)
    loss, metrics = token_policy_loss(logits / T, tokens, CorrectionConfig(), loss_mask)

:func:`chunked_token_policy_loss` takes hidden states and the LM head instead of logits and never
holds the whole batch's logits.  See docs/corrections.md.
"""

from mixrl.rl.corrections.advantages import grpo_advantages, token_advantages
from mixrl.rl.corrections.config import EXTREME_RATIO_RANGE, CorrectionConfig, CorrectionInputError
from mixrl.rl.corrections.diagnostics import METRIC_KEYS, PolicyLossMetrics
from mixrl.rl.corrections.loss import chunked_token_policy_loss, token_policy_loss
from mixrl.rl.corrections.reference import reference_token_policy_loss
from mixrl.rl.corrections.tokens import LossTokens
from mixrl.rl.corrections.vocab import VocabShard

__all__ = [
    "EXTREME_RATIO_RANGE",
    "METRIC_KEYS",
    "CorrectionConfig",
    "CorrectionInputError",
    "LossTokens",
    "PolicyLossMetrics",
    "VocabShard",
    "chunked_token_policy_loss",
    "grpo_advantages",
    "reference_token_policy_loss",
    "token_advantages",
    "token_policy_loss",
]
