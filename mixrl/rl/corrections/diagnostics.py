"""Per-token mismatch diagnostics returned with the loss (docs/corrections.md, "Diagnostics")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

METRIC_KEYS: tuple[str, ...] = (
    "log_ratio",
    "abs_log_ratio",
    "k1",
    "k3",
    "extreme_ratio",
    "mis_masked",
    "weight",
    "entropy",
)
"""Keys of :attr:`PolicyLossMetrics.per_token` and :attr:`PolicyLossMetrics.mean`:

- ``log_ratio``: log r(a) = log π(a) − log μ(a) of the sampled token;
- ``abs_log_ratio``: |log r(a)|;
- ``k1``: −log r(a), the k1 estimate of KL(μ‖π) (sampler–trainer KL);
- ``k3``: (r − 1) − log r, the k3 estimate of the same KL (non-negative, lower variance);
- ``extreme_ratio``: 1 where r(a) is outside [0.2, 5] — always this range, whatever the MIS range;
- ``mis_masked``: 1 where MIS dropped the token (r outside the MIS range); 0 when MIS is off;
- ``weight``: the importance weight w(a) the token was trained with;
- ``entropy``: the trainer's entropy H(p) at the position (full vocabulary, after temperature).
"""


@dataclass(frozen=True)
class PolicyLossMetrics:
    """Diagnostics of one call: per-token tensors and their means over the loss tokens.

    ``per_token[key]`` is a detached fp32 tensor [N] over the whole batch; positions with
    ``loss_mask`` 0 hold 0 and are excluded by ``mask``.  ``mean[key]`` averages over loss tokens
    (0.0 when there are none).  Use :meth:`group_means` to aggregate per sampler pool.
    """

    per_token: dict[str, Tensor]
    mask: Tensor  # [N] bool: the loss tokens
    mean: dict[str, float]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.mask.sum())

    def group_means(self, group: Tensor, num_groups: int) -> tuple[dict[str, Tensor], Tensor]:
        """Means over the loss tokens of each group (e.g. ``group[i]`` = pool index of token i).

        Returns ``({key: [num_groups] means}, [num_groups] loss-token counts)``; a group without
        loss tokens has mean 0.
        """
        weights = self.mask.float()
        counts = torch.zeros(num_groups, dtype=torch.float32, device=self.mask.device)
        counts.index_add_(0, group, weights)
        means = {}
        for key, values in self.per_token.items():
            totals = torch.zeros(num_groups, dtype=torch.float32, device=values.device)
            totals.index_add_(0, group, values * weights)
            means[key] = totals / counts.clamp(min=1.0)
        return means, counts


def build_metrics(
    per_loss_row: dict[str, Tensor], loss_rows: Tensor | None, num_tokens: int
) -> PolicyLossMetrics:
    """Spread per-loss-row values over the whole batch (0 elsewhere) and take their means."""
    device = next(iter(per_loss_row.values())).device
    if loss_rows is None:
        mask = torch.ones(num_tokens, dtype=torch.bool, device=device)
        per_token = {k: v.detach().float() for k, v in per_loss_row.items()}
    else:
        mask = torch.zeros(num_tokens, dtype=torch.bool, device=device)
        mask[loss_rows] = True
        per_token = {}
        for key, values in per_loss_row.items():
            full = torch.zeros(num_tokens, dtype=torch.float32, device=device)
            full[loss_rows] = values.detach().float()
            per_token[key] = full
    count = int(mask.sum())
    mean = {k: (float(v.sum()) / count if count else 0.0) for k, v in per_token.items()}
    return PolicyLossMetrics(per_token=per_token, mask=mask, mean=mean)
