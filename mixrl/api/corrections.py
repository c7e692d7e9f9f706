"""Which corrections the objective applies (docs/corrections.md): the one settings type.

The spec's ``algorithm.corrections`` and ``algorithm.topP.maskReplay`` (:mod:`mixrl.api.models`) are
resolved into a :class:`CorrectionConfig` (:func:`mixrl.api.resolve.resolve`), which the resolved
run carries to the trainer and :mod:`mixrl.rl.corrections` takes as it is."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Self

PAPER_MIS_RANGE: tuple[float, float] = (0.2, 5.0)
"""The MIS range ``[lo, hi]`` of the paper's runs: the default of ``algorithm.corrections.mis``."""


class CorrectionInputError(ValueError):
    """A bad argument to the objective; the message is one line naming the argument and the reason."""


@dataclass(frozen=True)
class CorrectionConfig:
    """The off-policy corrections of the token objective.

    - ``mis``: masked importance sampling range ``(lo, hi)``: weight ``r·1[lo ≤ r ≤ hi]``; None = off.
    - ``tis``: truncated importance sampling cap C: weight ``min(r, C)``; None = off.
      MIS and TIS are alternatives: setting both is an error.
    - ``score_centering``: subtract ``E_{b~μ}[w(b) ∇log π(b)]`` from every token's update.
    - ``topp_replay``: train on p renormalized on the sampler's support S (logits outside S get no
      gradient at that position) for tokens sampled from a support.

    With neither MIS nor TIS the weight is 1 (GRPO); :meth:`grpo` turns everything off.
    """

    mis: tuple[float, float] | None = PAPER_MIS_RANGE
    tis: float | None = None
    score_centering: bool = True
    topp_replay: bool = True

    def __post_init__(self) -> None:
        if self.mis is not None:
            if len(self.mis) != 2:
                raise CorrectionInputError(f"mis must be a pair (lo, hi), got {self.mis!r}")
            lo, hi = (float(x) for x in self.mis)
            if not (0.0 < lo < 1.0 < hi < math.inf):
                raise CorrectionInputError(f"mis range must satisfy 0 < lo < 1 < hi, got ({lo}, {hi})")
            object.__setattr__(self, "mis", (lo, hi))
        if self.tis is not None:
            if not (0.0 < float(self.tis) < math.inf):
                raise CorrectionInputError(f"tis cap must be a positive finite number, got {self.tis!r}")
            object.__setattr__(self, "tis", float(self.tis))
        if self.mis is not None and self.tis is not None:
            raise CorrectionInputError("mis and tis are alternative weights: set at most one of them")

    @classmethod
    def grpo(cls) -> Self:
        """Plain GRPO: weight 1, no centering, no replay (π = p)."""
        return cls(mis=None, tis=None, score_centering=False, topp_replay=False)
