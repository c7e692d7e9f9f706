"""GRPO group advantages (docs/corrections.md, "GRPO advantage")."""

from __future__ import annotations

import torch
from torch import Tensor

from mixrl.rl.corrections.config import CorrectionInputError


def grpo_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Each sample's reward minus its group's mean, optionally divided by the group's std + eps.

    ``rewards`` is flat [G · group_size], laid out group after group (the samples of one prompt
    are adjacent).  The std is the unbiased sample std (as TRL and verl use); a group whose rewards
    are all equal gets advantage 0.  Returns fp32 [G · group_size].
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        desc = list(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise CorrectionInputError(f"rewards must be a 1-D tensor, got {desc}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise CorrectionInputError(f"group_size must be a positive integer, got {group_size!r}")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise CorrectionInputError(
            f"rewards has {rewards.numel()} entries, not a positive multiple of group_size {group_size}"
        )
    if normalize_std and group_size < 2:
        raise CorrectionInputError("normalize_std needs group_size >= 2 (a group of one has no std)")
    if not (eps > 0):
        raise CorrectionInputError(f"eps must be positive, got {eps}")
    grouped = rewards.float().view(-1, group_size)
    if not bool(torch.isfinite(grouped).all()):
        raise CorrectionInputError("rewards contains NaN or infinite values")
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    # All equal: exactly 0.  The float32 mean of equal fractional rewards (7/10) is off by an ulp,
    # and the std of that error is of its size: dividing made it a 3–6 % advantage of one sign.
    equal = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    centered = torch.where(equal, torch.zeros_like(centered), centered)
    if normalize_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def token_advantages(advantages: Tensor, tokens_per_sample: Tensor) -> Tensor:
    """Broadcast per-sample advantages over each sample's tokens: [S] × counts [S] → [Σ counts]."""
    if advantages.shape != tokens_per_sample.shape or advantages.dim() != 1:
        raise CorrectionInputError(
            f"tokens_per_sample must match advantages' shape {list(advantages.shape)}, "
            f"got {list(tokens_per_sample.shape)}"
        )
    if bool((tokens_per_sample < 0).any()):
        raise CorrectionInputError("tokens_per_sample must be non-negative")
    return advantages.repeat_interleave(tokens_per_sample)
