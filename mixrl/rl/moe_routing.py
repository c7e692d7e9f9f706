"""MoE routing mismatch: which tokens a sampler routes to other experts than its trainer does.

In a mixture of experts each side picks each token's top-k experts from its own router logits, and
without routing replay a sampler whose numbers differ (quantized weights and inputs, other kernels)
sends some tokens to other experts than the trainer that scores them: one of the paper's main
mismatch sources.  :func:`routed_experts` records every router's choice during a forward pass;
:func:`routing_disagreement` compares two models' choices on the same tokens.

Pure torch: the models come in built (the local report builds them from a run directory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


def _is_router(module: nn.Module) -> bool:
    """A top-k router: transformers' MoE routers return (logits, scores, indices)."""
    return type(module).__name__.endswith("TopKRouter")


@torch.no_grad()
def routed_experts(model: nn.Module, ids: Tensor, **forward: object) -> Tensor:
    """Each router's top-k expert ids for every token of ``ids`` [B, T], sorted within a token:
    [layers, B·T, k].  ``forward`` goes to the model's call (a cache, a mask)."""
    chosen: list[Tensor] = []

    def record(_module: nn.Module, _args: object, output: tuple[Tensor, Tensor, Tensor]) -> None:
        chosen.append(output[2].sort(dim=-1).values)

    hooks = [m.register_forward_hook(record) for m in model.modules() if _is_router(m)]
    if not hooks:
        raise ValueError("model: no top-k MoE router found (a dense model routes nothing)")
    try:
        model(input_ids=ids, **forward)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(chosen)


@dataclass(frozen=True)
class RoutingDisagreement:
    tokens: int
    """Tokens compared."""
    any_layer: float
    """Share of tokens whose top-k set differs in at least one layer."""
    per_layer: list[float]
    """Per layer, the share of tokens whose top-k set differs there."""


def routing_disagreement(
    sampler: Tensor, trainer: Tensor, selected: Tensor | None = None
) -> RoutingDisagreement:
    """Compare two :func:`routed_experts` results of the same tokens; ``selected`` [B·T] (bool)
    keeps only some tokens (the sampled ones), all by default."""
    if sampler.shape != trainer.shape:
        raise ValueError(f"routing: shapes differ, {tuple(sampler.shape)} against {tuple(trainer.shape)}")
    differs = (sampler != trainer).any(dim=-1)  # [layers, tokens]
    if selected is not None:
        differs = differs[:, selected]
    tokens = int(differs.shape[1])
    if tokens == 0:
        return RoutingDisagreement(0, 0.0, [0.0] * int(differs.shape[0]))
    return RoutingDisagreement(
        tokens,
        float(differs.any(dim=0).float().mean()),
        [float(share) for share in differs.float().mean(dim=1)],
    )
