"""Mismatch-aware routing: a pool's health from its mismatch, and traffic share = capacity × health (pure).

A pool whose samples drift from the trainer (a bad kernel, a too-aggressive precision) feeds the
trainer tokens with a large importance ratio; down-weighting that pool before the run degrades is
cheaper than correcting it afterwards.  Each observation of a pool (once per trainer step) is
compared with two thresholds:

- **bad**: its mismatch KL (k3) or its share of tokens with an extreme ratio is above its threshold;
- **good**: both are below ``recover_fraction`` × their thresholds (the gap between the two levels
  is the hysteresis: a pool hovering near a threshold neither falls nor recovers).

At the ``degrade_after``-th bad observation in a row the pool's health is multiplied by ``step``,
and again at each further bad one, never below ``floor``, so a degraded pool keeps a trickle of
traffic and keeps being measured; at the ``recover_after``-th good one in a row it is divided by
``step``, and again at each further good one, up to 1.  An observation that is neither, or a
missing one, resets both streaks and keeps the health, so a single spike or a single quiet step
changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from mixrl.api.models import RoutingHealthSpec


@dataclass(frozen=True)
class HealthPolicy:
    # No default thresholds: what counts as a bad mismatch depends on the model and the precisions
    # (the tiny quickstart's pools start near 0.02 and settle near 0.003), so the caller chooses.
    kl_threshold: float
    """Mismatch KL (k3) above which an observation is bad."""
    extreme_share_threshold: float
    """Share of tokens with a ratio outside [0.2, 5] above which an observation is bad."""
    recover_fraction: float = 0.5
    """An observation is good when both figures are below this fraction of their thresholds."""
    degrade_after: int = 3
    """The health first falls at this bad observation in a row (3: at the third)."""
    recover_after: int = 3
    """The health first rises at this good observation in a row."""
    step: float = 0.5
    """Factor the health is multiplied by per bad observation from ``degrade_after`` on (divided by
    per good one from ``recover_after`` on)."""
    floor: float = 0.1
    """Lowest health: a degraded pool keeps this fraction of its capacity's traffic."""

    def __post_init__(self) -> None:
        problems = []
        if not self.kl_threshold > 0:
            problems.append(f"kl_threshold must be > 0, got {self.kl_threshold}")
        if not self.extreme_share_threshold > 0:
            problems.append(f"extreme_share_threshold must be > 0, got {self.extreme_share_threshold}")
        if not 0 < self.recover_fraction <= 1:
            problems.append(f"recover_fraction must be in (0, 1], got {self.recover_fraction}")
        if self.degrade_after < 1 or self.recover_after < 1:
            problems.append("degrade_after and recover_after must be at least 1")
        if not 0 < self.step < 1:
            problems.append(f"step must be in (0, 1), got {self.step}")
        if not 0 < self.floor <= 1:
            problems.append(f"floor must be in (0, 1], got {self.floor}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class Observation:
    """One pool's mismatch at one trainer step: its fresh (staleness-0) figures (:func:`mismatch_report`)."""

    kl: float
    extreme_share: float


@dataclass(frozen=True)
class PoolHealth:
    health: float = 1.0
    bad_streak: int = 0
    good_streak: int = 0


HEALTHY = PoolHealth()


def observe(state: PoolHealth, observation: Observation | None, policy: HealthPolicy) -> PoolHealth:
    """The pool's health after one more observation (None: the pool had no tokens this step)."""
    if observation is None:
        return PoolHealth(state.health)
    bad = observation.kl > policy.kl_threshold or observation.extreme_share > policy.extreme_share_threshold
    good = (
        observation.kl < policy.recover_fraction * policy.kl_threshold
        and observation.extreme_share < policy.recover_fraction * policy.extreme_share_threshold
    )
    if bad:
        streak = state.bad_streak + 1
        health = (
            max(policy.floor, state.health * policy.step) if streak >= policy.degrade_after else state.health
        )
        return PoolHealth(health, bad_streak=streak)
    if good:
        streak = state.good_streak + 1
        health = min(1.0, state.health / policy.step) if streak >= policy.recover_after else state.health
        return PoolHealth(health, good_streak=streak)
    return PoolHealth(state.health)


def observe_all(
    states: Mapping[str, PoolHealth], observations: Mapping[str, Observation], policy: HealthPolicy
) -> dict[str, PoolHealth]:
    """Every pool's health after one step; a pool of ``states`` without an observation holds."""
    pools = {*states, *observations}
    return {
        pool: observe(states.get(pool, HEALTHY), observations.get(pool), policy) for pool in sorted(pools)
    }


def health_weighted_shares(
    capacity: Mapping[str, float], health: Mapping[str, PoolHealth]
) -> dict[str, float]:
    """Traffic shares: each pool's capacity (e.g. its target share by capacity) × its health, normalised.

    A pool without a health entry counts as healthy; if no pool has capacity every share is 0.
    """
    weights = {pool: max(value, 0.0) * health.get(pool, HEALTHY).health for pool, value in capacity.items()}
    total = sum(weights.values())
    if total <= 0:
        return dict.fromkeys(capacity, 0.0)
    return {pool: weight / total for pool, weight in weights.items()}


def policy_of(spec: RoutingHealthSpec) -> HealthPolicy:
    """The policy ``spec.health.routing`` describes: the spec's fields are the policy's, one for one."""
    return HealthPolicy(**spec.model_dump())


# ----------------------------------------------------------------------------- the wire
# The trainer posts one report per step to the buffer (POST /mismatch); the router reads the latest
# from the buffer's GET /stats ("mismatch").  One path for a laptop and a cluster, no Prometheus.


class PoolMismatch(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kl: float = Field(ge=0, allow_inf_nan=False)
    """The pool's fresh (staleness-0) KL (k3) at this step."""
    extreme_share: float = Field(ge=0, le=1)
    """The share of its fresh tokens with a ratio outside [0.2, 5]."""
    tokens: int = Field(gt=0)
    """Fresh tokens the figures are measured on."""


class MismatchReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int = Field(ge=0)
    """The trainer step the figures come from."""
    pools: dict[str, PoolMismatch] = Field(default_factory=dict, max_length=4096)
    """Pools with fresh tokens at this step (a pool absent had none: its health holds)."""

    def observations(self) -> dict[str, Observation]:
        return {name: Observation(p.kl, p.extreme_share) for name, p in self.pools.items()}


def mismatch_report(step: int, per_pool: Mapping[str, Mapping[str, float]]) -> MismatchReport:
    """The report of one trainer step from its per-pool figures (``kl_k3_fresh``,
    ``extreme_ratio_fresh``, ``fresh_tokens``: mixrl.rl.trainer.torch_backend); pools without fresh
    tokens are left out."""
    pools = {
        name: PoolMismatch(
            kl=max(float(stats["kl_k3_fresh"]), 0.0),
            extreme_share=min(max(float(stats["extreme_ratio_fresh"]), 0.0), 1.0),
            tokens=int(stats["fresh_tokens"]),
        )
        for name, stats in per_pool.items()
        if stats.get("fresh_tokens") and "kl_k3_fresh" in stats
    }
    return MismatchReport(step=step, pools=pools)
