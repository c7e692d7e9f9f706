"""The objective's settings (:class:`mixrl.api.corrections.CorrectionConfig`, declared in the API
that resolves them) and the range the metrics call extreme."""

from mixrl.api.corrections import CorrectionConfig, CorrectionInputError

EXTREME_RATIO_RANGE: tuple[float, float] = (0.2, 5.0)
"""A sampled token whose ratio r lies outside this range counts as "extreme" in the metrics,
whatever MIS range the run uses, so every run reports the same health signal."""

__all__ = ["EXTREME_RATIO_RANGE", "CorrectionConfig", "CorrectionInputError"]
