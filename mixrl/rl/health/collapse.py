"""The three signs of collapse, judged from the trainer's per-step records (pure; docs/health.md).

The records are the lines of ``metrics.jsonl`` (mixrl.rl.trainer.main.step_record): the run's
``reward``, ``kl_k3`` and ``format_error_endings``, and ``pools.<name>.kl_k3`` per pool.  Each sign
is judged on a smoothed figure so that noise raises nothing:

- **KL growing** (per pool and for the run): the median KL of the last ``window`` steps is at least
  ``klGrowth`` × the baseline, the median of the first ``baselineSteps`` steps with data, and above
  ``klFloor``.  Judged once ``baselineSteps + window`` steps have data, so the two never overlap.
- **Reward falling** (the run): the reward smoothed by a trailing ``rewardWindow``-step mean is
  ``rewardDrop`` or more below the best smoothed value so far (only when that best is positive: a
  fraction of a non-positive best means nothing).  A mean, not a median: a step's reward is bounded
  and its noise is wide, where a mean's lows and highs stay closer together than a median's.
- **Format errors** (the run): the mean share of episodes ending on repeated format errors over the
  last ``window`` steps is above ``formatErrorShare``.

The KL is the trainer's k3 over every trained token (``kl_k3``), so a pool's figure includes the
drift of stale tokens as well as its precision mismatch.  The trainer also logs the KL of the fresh
(staleness-0) tokens alone (``kl_k3_fresh``); the signs are not judged on it (they keep the
all-token KL the chart's alerts judge too, and a pool has no fresh figure in a step without fresh
tokens): mismatch-aware routing (:mod:`mixrl.rl.health.routing`) reads it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

from mixrl.api.models import CollapseSpec

KL_GROWING = "kl_growing"
REWARD_FALLING = "reward_falling"
FORMAT_ERRORS = "format_errors"
SIGNS = (KL_GROWING, REWARD_FALLING, FORMAT_ERRORS)

RUN = "run"
"""Scope of a run-wide figure (a pool's figures are scoped by the pool's name)."""
KL_KEY = "kl_k3"
REWARD_KEY = "reward"
FORMAT_ERROR_KEY = "format_error_endings"

Record = Mapping[str, Any]
Point = tuple[int, float]  # (step, value)


@dataclass(frozen=True)
class Sign:
    """One sign judged on one series: raised or not, with the figures it was judged on."""

    name: str
    scope: str
    raised: bool
    step: int
    """The last step of the window judged."""
    value: float
    """The smoothed current figure: median KL, trailing-mean reward, mean format-error share."""
    reference: float
    """What it is compared with: the KL baseline, the best smoothed reward, the allowed share."""
    threshold: float
    """The level that raises the sign: klGrowth × baseline, (1 − rewardDrop) × best, the share."""

    def describe(self) -> str:
        """One line with the figures, e.g. ``KL of pool mxfp4 0.0061 >= 3x its baseline 0.0018``."""
        where = "the run" if self.scope == RUN else f"pool {self.scope}"
        verdict = "RAISED" if self.raised else "ok"
        if self.name == KL_GROWING:
            relation = ">=" if self.raised else "<"
            ratio = self.value / self.reference if self.reference > 0 else math.inf
            text = (
                f"KL (k3) of {where} {self.value:.4g} {relation} {self.threshold:.4g} "
                f"(baseline {self.reference:.4g}, now {ratio:.2f}x)"
            )
        elif self.name == REWARD_FALLING:
            relation = "<" if self.raised else ">="
            text = f"reward {self.value:.4g} {relation} {self.threshold:.4g} (best {self.reference:.4g})"
        else:
            relation = ">" if self.raised else "<="
            text = f"episodes ending on format errors {self.value:.1%} {relation} {self.threshold:.1%}"
        return f"{self.name} [{verdict}] {text}, judged at step {self.step}"

    def short(self) -> str:
        """A few words for a progress line, e.g. ``kl_growing(mxfp4 4.1x)``."""
        if self.name == KL_GROWING:
            ratio = self.value / self.reference if self.reference > 0 else math.inf
            return f"{self.name}({self.scope} {ratio:.1f}x)"
        if self.name == REWARD_FALLING:
            drop = 1 - self.value / self.reference if self.reference > 0 else 0.0
            return f"{self.name}(-{drop:.0%} from best {self.reference:.3g})"
        return f"{self.name}({self.value:.0%} of episodes)"


@dataclass(frozen=True)
class Assessment:
    """Every sign that could be judged (a series with too few steps is not judged yet)."""

    signs: tuple[Sign, ...]

    @property
    def raised(self) -> tuple[Sign, ...]:
        return tuple(sign for sign in self.signs if sign.raised)

    @property
    def complete(self) -> bool:
        """Every run-wide sign was judged: the run's KL, the reward and the format errors (each once
        its series has enough steps, so ``max(baselineSteps + window, rewardWindow)`` steps with every
        figure).  Only then does "nothing raised" mean no sign of collapse."""
        return {sign.name for sign in self.signs if sign.scope == RUN} >= set(SIGNS)


def _figure(value: Any) -> float | None:
    """A finite number of a record, or None (a missing key, a string, a bool, NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _step(record: Record) -> int | None:
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def run_series(records: Iterable[Record], key: str) -> list[Point]:
    """(step, value) of a run-wide figure, in record order, skipping records without it."""
    points = []
    for record in records:
        step, value = _step(record), _figure(record.get(key))
        if step is not None and value is not None:
            points.append((step, value))
    return points


def pool_series(records: Iterable[Record], key: str) -> dict[str, list[Point]]:
    """(step, value) of a per-pool figure, per pool, skipping steps where the pool had none."""
    out: dict[str, list[Point]] = {}
    for record in records:
        step, pools = _step(record), record.get("pools")
        if step is None or not isinstance(pools, Mapping):
            continue
        for pool, stats in pools.items():
            value = _figure(stats.get(key)) if isinstance(stats, Mapping) else None
            if value is not None:
                out.setdefault(str(pool), []).append((step, value))
    return out


def kl_sign(points: Sequence[Point], spec: CollapseSpec, scope: str) -> Sign | None:
    if len(points) < spec.baseline_steps + spec.window:
        return None
    values = [value for _, value in points]
    baseline = median(values[: spec.baseline_steps])
    recent = median(values[-spec.window :])
    threshold = spec.kl_growth * baseline
    raised = recent >= threshold and recent > spec.kl_floor
    return Sign(KL_GROWING, scope, raised, points[-1][0], recent, baseline, threshold)


def smoothed(values: Sequence[float], window: int) -> list[float]:
    """Trailing means of ``window`` values (one per position from ``window - 1`` on)."""
    return [sum(values[end - window : end]) / window for end in range(window, len(values) + 1)]


def reward_sign(points: Sequence[Point], spec: CollapseSpec) -> Sign | None:
    if len(points) < spec.reward_window:
        return None
    smooth = smoothed([value for _, value in points], spec.reward_window)
    best, current = max(smooth), smooth[-1]
    threshold = (1 - spec.reward_drop) * best
    raised = best > 0 and current < threshold
    return Sign(REWARD_FALLING, RUN, raised, points[-1][0], current, best, threshold)


def format_error_sign(points: Sequence[Point], spec: CollapseSpec) -> Sign | None:
    if len(points) < spec.window:
        return None
    recent = [value for _, value in points[-spec.window :]]
    share = sum(recent) / len(recent)
    threshold = spec.format_error_share
    return Sign(FORMAT_ERRORS, RUN, share > threshold, points[-1][0], share, threshold, threshold)


def assess(records: Sequence[Record], spec: CollapseSpec | None = None) -> Assessment:
    """Judge every sign on the records so far (the whole log: the KL baseline is its first steps)."""
    spec = spec or CollapseSpec()
    kl = {RUN: run_series(records, KL_KEY), **pool_series(records, KL_KEY)}
    signs = [kl_sign(points, spec, scope) for scope, points in kl.items()]
    signs.append(reward_sign(run_series(records, REWARD_KEY), spec))
    signs.append(format_error_sign(run_series(records, FORMAT_ERROR_KEY), spec))
    return Assessment(tuple(sign for sign in signs if sign is not None))


def report_lines(assessment: Assessment, spec: CollapseSpec, source: str) -> list[str]:
    """The report's "Run health" section (Markdown): every sign judged, raised ones first."""
    lines = [
        "## Run health",
        "",
        f"Signs of collapse (docs/health.md), thresholds from {source}: KL ≥ {spec.kl_growth:g}× its "
        f"baseline (median of the first {spec.baseline_steps} steps, above {spec.kl_floor:g}), reward "
        f"{spec.reward_drop:.0%} below its best (mean of {spec.reward_window} steps), format-error endings "
        f"above {spec.format_error_share:.0%}; KL and format errors judged on the last {spec.window} steps.",
        "",
    ]
    if not assessment.signs:
        return [*lines, "Too few steps to judge any sign.", ""]
    ordered = sorted(assessment.signs, key=lambda sign: not sign.raised)
    lines += [f"- {'**RAISED** ' if sign.raised else ''}{sign.describe()}" for sign in ordered]
    if not assessment.raised:
        lines += ["", "No sign of collapse."]
    return [*lines, ""]
