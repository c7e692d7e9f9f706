"""The status of RLRuns and SamplerPools: what the operator (and ``mixrl run``) writes.

Every status the operator writes passes through these models (:func:`checked_status`), so a
mistyped or misplaced key fails where it is written instead of being dropped silently by the API
server's structural schema.  The CRDs' status schemas are generated from the same models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mixrl.api.base import INT32_MAX, Float, Int, Model


class PoolFigures(Model):
    """The live figures of one pool, in its SamplerPool's status and in the run's ``pools`` list."""

    traffic_share: float | None = None
    """Share of sessions routed to this pool."""
    kl: float | None = None
    """Mean sampler–trainer KL (k3) of this pool's tokens at the last step."""
    kl_fresh: float | None = None
    """The same over the pool's fresh tokens alone (staleness 0): its precision mismatch without drift."""
    health: float | None = None
    """The router's mismatch-aware health of the pool, in [floor, 1] (spec.health.routing)."""
    extreme_ratio_share: float | None = None
    """Share of this pool's tokens whose ratio is outside [0.2, 5]."""
    tokens_per_second: float | None = None
    """Completion tokens per second the router passed back from this pool (one-minute rate)."""
    serving_weight_version: int | None = None
    """The newest weight version in this pool's answers."""
    measured_capacity: float | None = None
    """The router's measured capacity per replica, in the declared units (a declared pool's once
    trusted: measured while its replicas were full)."""


class Condition(Model):
    type: str
    """Condition type: Ready, Progressing, InvalidSpec, CollapseRisk, MetricsAvailable…"""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: str = ""
    """CamelCase reason."""
    message: str = ""
    """Human-readable detail."""
    last_transition_time: str | None = None
    """RFC 3339 time of the last status change."""
    observed_generation: int | None = None
    """metadata.generation this condition was computed from."""


class PoolSummary(PoolFigures):
    name: str
    """Pool name."""
    gpu_type: str = ""
    """GPU type."""
    weight_precision: str = ""
    """Weight precision."""
    replicas: int = 0
    """Desired replicas."""
    ready_replicas: int = 0
    """Ready replicas."""
    gpu_hours: float | None = None
    """GPU-hours this pool's pods have held since the run started."""
    cost: float | None = None
    """Their price in dollars (costPerGpuHour, else the default table of mixrl.api.gpus)."""


class ConcurrencyRecommendation(Model):
    sessions: int
    """Rollout sessions, all workers together, the trainer's demand needs."""
    configured: int
    """What the run has now: ``rollout.concurrency × rollout.workers``."""
    time: str = ""
    """RFC 3339 time the autoscaler computed it."""
    message: str = ""
    """The fleet plan it came from (demand, supply, what the concurrency keeps busy)."""


class RLRunStatus(Model):
    phase: Literal["Queued", "Pending", "Running", "Succeeded", "Failed", "Invalid"] | None = None
    """Lifecycle phase; Queued: waiting for Kueue to admit the run (the Admitted condition says why
    it waits), nothing that runs is created yet."""
    observed_generation: int | None = None
    """metadata.generation the status reflects."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, Progressing, InvalidSpec, Admitted (runs with a Kueue queue), CollapseRisk, MetricsAvailable."""
    step: int | None = None
    """Policy updates done."""
    weight_version: int | None = None
    """Latest published weight version."""
    pools: list[PoolSummary] = Field(default_factory=list)
    """Per-pool summary."""
    pool_count: int | None = None
    """Number of sampler pools (for the printer column)."""
    reward: float | None = None
    """Mean training reward at the last step."""
    quarantined_batches: int | None = None
    """Batches the trainer could not train, taken back by the buffer and kept for inspection (its
    ``GET /stats`` lists them with the reason); the run went on with other groups."""
    gpu_hours: float | None = None
    """GPU-hours of the whole run so far: every pool's pods and the trainer's nodes."""
    cost: float | None = None
    """Their price in dollars."""
    cost_per_update: float | None = None
    """Dollars per trainer update: cost ÷ step."""
    trainer_gpu_hours: float | None = None
    """GPU-hours of the trainer's nodes."""
    trainer_cost: float | None = None
    """Their price in dollars (the default table of mixrl.api.gpus for the trainer's GPU type)."""
    recommended_concurrency: ConcurrencyRecommendation | None = None
    """``autoscaling.objective: trainer``: the rollout concurrency the trainer's demand needs, when the
    configured one keeps too little capacity busy (null: it suffices).  Reported, not applied: the
    workers' concurrency is fixed when they start, so set ``spec.rollout.concurrency``."""
    spend_updated_at: str | None = None
    """RFC 3339 time the spend figures were last written (an operator restart accrues from there)."""
    reason: str | None = None
    """Why the run ended: TotalStepsReached (Succeeded) or TrainerFailed (Failed)."""
    message: str | None = None
    """The end in words: the steps taken, or the trainer's last error."""


class ScaleDecision(Model):
    time: str
    """RFC 3339 time of the decision."""
    from_replicas: int
    """Replicas before."""
    to_replicas: int
    """Replicas after."""
    load: float | None = None
    """Observed load (queued + running requests)."""
    reason: str = ""
    """Why (ratio, bounds, stabilization, budget…)."""


class ScaleRecommendation(Model):
    time: Float = Field(ge=0, le=2.0**40)
    """Unix time of the recommendation."""
    replicas: Int = Field(ge=0, le=INT32_MAX)
    """The fewest replicas it allowed (a scale-down goes no lower within the window)."""
    kind: Literal["pool", "fleet"] = "pool"
    """``pool``: the pool's own recommendation; ``fleet``: the replicas the fleet step requested."""


class SamplerPoolStatus(PoolFigures):
    replicas: int = 0
    """Pods that exist (scale subresource)."""
    ready_replicas: int = 0
    """Pods that are ready to serve."""
    selector: str = ""
    """Label selector of the pool's pods (scale subresource; HPA and KEDA need it)."""
    observed_generation: int | None = None
    """metadata.generation the status reflects."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, MetricsAvailable, WrongGpuType…"""
    last_scale_decisions: list[ScaleDecision] = Field(default_factory=list)
    """The most recent scaling decisions, newest last."""
    autoscaler_window: list[ScaleRecommendation] = Field(default_factory=list)
    """The built-in autoscaler's scale-down window (written by it, read back after a restart)."""
    cold_start_seconds: float | None = None
    """The pool's cold start as learned by the built-in autoscaler: the median, over its ready
    pods, of the seconds from a pod's creation to its readiness."""
    awaiting_admission: int | None = None
    """A queued run's pool (``spec.scheduling.queue``): replicas above its starting ones that Kueue
    has not admitted yet (its ``Admitted`` condition gives Kueue's reason); absent otherwise."""


def checked_status(
    model: type[RLRunStatus] | type[SamplerPoolStatus], status: dict[str, Any]
) -> dict[str, Any]:
    """``status`` (the whole status or a merge patch of it) as it will be written, validated by its
    model: an unknown field, or a value of the wrong type, raises ``ValidationError`` here.  Keys
    keep their order and null values stay (a merge patch's null removes the field)."""
    model.model_validate(status)
    return status
