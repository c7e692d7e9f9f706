"""Status composition: observed children -> the RLRun's and SamplerPools' status (pure).

Conventions (Kubernetes API conventions, as controllers in core do it): every condition carries
``observedGeneration``; ``lastTransitionTime`` changes only when the status value flips; ``Ready``
is composed from sub-conditions, one per component; a reconcile that observes nothing new produces
exactly the previous status, so the handler writes nothing.  Fields owned by other writers (the
trainer's step and reward, metric conditions such as CollapseRisk, per-pool KL) are carried over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mixrl.api.kube_types import ConditionValue, Obj
from mixrl.operator.builders.kueue import Elastic
from mixrl.operator.kube.conditions import make_condition, merge_conditions

READY = "Ready"
PROGRESSING = "Progressing"
INVALID_SPEC = "InvalidSpec"
POLICY_VIOLATION = "PolicyViolation"
"""True while the cluster's policy refuses what the run asks for (mixrl.operator.install.cluster_policy); there only
then, so runs the policy allows carry no condition about a policy they never met."""
AUTOSCALER_READY = "AutoscalerReady"
ADMITTED = "Admitted"
"""Runs with a Kueue queue (spec.scheduling.queue, or the operator's default): whether Kueue admitted
the run's Workload, and while it has not, Kueue's reason.  There only on such runs."""
"""Whether whoever the spec names to scale the pools can do it (the built-in loop, KEDA, nobody)."""
COMPONENT_CONDITIONS = ("TrainerReady", "BufferReady", "RouterReady", "RolloutReady", "SamplersReady")
OWN_RUN_CONDITIONS = (READY, PROGRESSING, INVALID_SPEC, POLICY_VIOLATION, *COMPONENT_CONDITIONS)


class Reason:
    """Fixed reasons, for conditions and events alike (alerts and tests match on them)."""

    READY = "Ready"
    ALL_READY = "AllComponentsReady"
    NOT_READY = "ReplicasNotReady"
    ROLLING_OUT = "RollingOut"
    SCALED_TO_ZERO = "ScaledToZero"
    MISSING = "WorkloadMissing"
    RECONCILED = "Reconciled"
    VALID = "Valid"
    INVALID_SPEC = "InvalidSpec"
    POLICY_VIOLATION = "PolicyViolation"
    # Events only
    APPLIED = "Applied"
    POOL_ADDED = "PoolAdded"
    POOL_REMOVED = "PoolRemoved"
    SCALED = "Scaled"
    APPLY_FAILED = "ApplyFailed"
    """Progressing: a child could not be written; the reconcile is retried (with backoff)."""
    IMMUTABLE_FIELD_CHANGED = "ImmutableFieldChanged"
    """Progressing (False): the spec asks for a change Kubernetes cannot make in place and the
    operator will not make by recreating (a claim that would shrink); the message says what to do."""
    NAME_TAKEN = "NameTaken"
    """Progressing (False): a child's name is taken by an object another owner controls (another
    run's child: names are ``<run>-<component>`` and ``<run>-<pool>``); it is left alone."""
    RECREATING = "Recreating"
    """Progressing: an object whose immutable fields changed was deleted and waits to be recreated."""
    RECREATED = "Recreated"
    """Event: an object was deleted to be created again with new immutable fields."""
    # AutoscalerReady
    BUILTIN_AUTOSCALER = "BuiltinAutoscaler"
    KEDA_SCALED_OBJECT = "KedaScaledObject"
    KEDA_NOT_INSTALLED = "KedaNotInstalled"
    KEDA_OFF = "KedaOff"
    """False: the run's engine is keda, and this operator runs with ``--keda off``."""
    BUILTIN_AUTOSCALER_OFF = "BuiltinAutoscalerOff"
    """False: the run's engine is builtin, and this operator runs with ``--no-builtin-autoscaler``."""
    AUTOSCALING_DISABLED = "AutoscalingDisabled"
    # Admitted (and the Queued / Admitted events)
    QUEUED = "Queued"
    """Kueue has not admitted the run's Workload (or evicted it): nothing of the run runs."""
    ADMITTED = "Admitted"
    KUEUE_NOT_INSTALLED = "KueueNotInstalled"
    PRIORITY_CLASS_MISSING = "PriorityClassMissing"
    """With ``--kueue-workload-priority``: the run's pods name a PriorityClass the cluster does not
    have, so its Workload cannot take that class's priority (Admitted False; Progressing False for a
    pool's extra replica)."""


@dataclass(frozen=True)
class WorkloadState:
    """What a Deployment's or StatefulSet's status says, reduced to what conditions need."""

    desired: int
    ready: int
    updated: int
    current: bool
    """The workload's controller has seen its latest spec (status.observedGeneration)."""

    @classmethod
    def of(cls, live: Obj | None) -> WorkloadState | None:
        if live is None:
            return None
        spec, status = live.get("spec", {}), live.get("status") or {}
        generation = live.get("metadata", {}).get("generation")
        observed = status.get("observedGeneration")
        return cls(
            desired=int(spec.get("replicas", 1)),
            ready=int(status.get("readyReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
            current=generation is None or (observed is not None and observed >= generation),
        )

    @property
    def rolling_out(self) -> bool:
        return not self.current or self.updated < self.desired


@dataclass(frozen=True)
class PoolState:
    name: str
    gpu_type: str
    weight_precision: str
    desired: int
    ready: int
    rolling_out: bool = False
    """The pool's Deployment has not caught up with its spec yet."""


class Problem(Protocol):
    """One child the last reconcile could not make match (mixrl.operator.controller.apply.Failure)."""

    @property
    def object(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def retry(self) -> bool: ...
    @property
    def waiting(self) -> bool: ...
    @property
    def reason(self) -> str: ...


MESSAGE_LIMIT = 1000


def problems_value(problems: Sequence[Problem]) -> ConditionValue | None:
    """Progressing when some children could not be applied (None when all were).

    A change that needs the user (``retry`` False) makes Progressing False — the run cannot get
    there by itself, as a Deployment past its progress deadline — and is named first; failures that
    are retried keep it True (ApplyFailed), and so does a recreation in progress (Recreating)."""
    if not problems:
        return None
    ordered = sorted(problems, key=lambda p: (p.retry, p.waiting))
    message = "; ".join(f"{p.object}: {p.message}" for p in ordered)[:MESSAGE_LIMIT]
    if not ordered[0].retry:
        return "False", ordered[0].reason, message
    if all(p.waiting for p in problems):
        return "True", Reason.RECREATING, message
    return "True", Reason.APPLY_FAILED, message


def condition_value(state: WorkloadState | None) -> ConditionValue:
    """(status, reason, message) of one component's readiness."""
    if state is None:
        return "False", Reason.MISSING, "not created yet"
    if state.desired == 0:
        return "True", Reason.SCALED_TO_ZERO, "scaled to zero"
    if state.ready >= state.desired and not state.rolling_out:
        return "True", Reason.READY, f"{state.ready}/{state.desired} ready"
    if state.rolling_out:
        return "False", Reason.ROLLING_OUT, f"{state.updated}/{state.desired} updated, {state.ready} ready"
    return "False", Reason.NOT_READY, f"{state.ready}/{state.desired} ready"


def samplers_value(pools: list[PoolState]) -> ConditionValue:
    """Ready when every pool that should serve has a ready replica (pools scaled to zero are fine)."""
    waiting = [p.name for p in pools if p.desired > 0 and p.ready == 0]
    if waiting:
        return "False", Reason.NOT_READY, f"no ready replica in {', '.join(waiting)}"
    if not any(p.ready for p in pools):
        return "False", Reason.SCALED_TO_ZERO, "every pool is scaled to zero"
    serving = sum(1 for p in pools if p.ready)
    return "True", Reason.READY, f"{serving}/{len(pools)} pools serving"


def autoscaler_value(
    engine: str,
    keda_served: bool,
    scaled_object: str | None = None,
    *,
    keda_off: bool = False,
    builtin_loop: bool = True,
) -> ConditionValue:
    """(status, reason, message) of AutoscalerReady for ``autoscaling.engine``; ``scaled_object``
    names the pool's ScaledObject (None on the run, which has one per pool); ``keda_off``: the
    operator was told ``--keda off``; ``builtin_loop``: it runs its built-in autoscaler."""
    if engine == "builtin" and not builtin_loop:
        return (
            "False",
            Reason.BUILTIN_AUTOSCALER_OFF,
            "autoscaling.engine is builtin, but this operator runs without its built-in autoscaler "
            "(--no-builtin-autoscaler): replicas stay where they are",
        )
    if engine == "builtin":
        return "True", Reason.BUILTIN_AUTOSCALER, "the operator scales the pools from Prometheus"
    if engine == "keda" and keda_off:
        return (
            "False",
            Reason.KEDA_OFF,
            "autoscaling.engine is keda, but this operator applies no ScaledObjects (--keda off): "
            "replicas stay where they are",
        )
    if engine == "keda" and keda_served:
        target = f"ScaledObject {scaled_object}" if scaled_object else "one ScaledObject per SamplerPool"
        return "True", Reason.KEDA_SCALED_OBJECT, f"KEDA scales through {target}"
    if engine == "keda":
        return (
            "False",
            Reason.KEDA_NOT_INSTALLED,
            "autoscaling.engine is keda, but the cluster does not serve keda.sh/v1alpha1 scaledobjects: "
            "install KEDA or set autoscaling.engine to builtin; until then replicas stay where they are",
        )
    return (
        "True",
        Reason.AUTOSCALING_DISABLED,
        "autoscaling.engine is none: replicas change only by kubectl scale",
    )


def pool_summaries(previous: list[Obj], pools: list[PoolState]) -> list[Obj]:
    """Replica counts from the pools; traffic share, KL and ratio health kept from their writers."""
    before = {p.get("name"): p for p in previous}
    out = []
    for pool in pools:
        summary = {k: v for k, v in before.get(pool.name, {}).items() if v is not None}
        summary.update(
            name=pool.name,
            gpuType=pool.gpu_type,
            weightPrecision=pool.weight_precision,
            replicas=pool.desired,
            readyReplicas=pool.ready,
        )
        out.append(summary)
    return out


def run_status(
    previous: Obj,
    generation: int | None,
    components: dict[str, WorkloadState | None],
    pools: list[PoolState],
    now: str,
    autoscaler: ConditionValue | None = None,
    problems: Sequence[Problem] = (),
    admission: ConditionValue | None = None,
    keep_admitted: bool = False,
) -> Obj:
    """The RLRun's status after a reconcile.

    ``components`` maps TrainerReady, BufferReady, RouterReady, RolloutReady to their workload;
    ``autoscaler`` is the AutoscalerReady value (:func:`autoscaler_value`), informational: pools
    that cannot scale still serve, so it is not part of Ready; ``problems``: children that could
    not be applied, which Progressing reports (:func:`problems_value`); ``admission``: the
    Admitted value of a run Kueue admits (None: no queue), and while it is not True the run is
    Queued and not Ready, whatever its components say; ``keep_admitted``: the run left its queue
    but its Workload could not be deleted, so the Admitted condition before stays (the marker the
    next reconcile deletes the Workload by).
    Everything is derived from observed state, so reconciling twice yields the same status."""
    old = without_policy_violation(previous)
    if admission is None and not keep_admitted:  # a run that leaves its queue drops the condition
        old = [c for c in old if c.get("type") != ADMITTED]
    subs = [
        make_condition(kind, condition_value(state), generation, now, old)
        for kind, state in components.items()
    ]
    subs.append(make_condition("SamplersReady", samplers_value(pools), generation, now, old))
    failing = [c for c in subs if c["status"] != "True"]
    ready_value: ConditionValue
    if failing:
        ready_value = (
            "False",
            failing[0]["reason"],
            "; ".join(f"{c['type']}: {c['message']}" for c in failing),
        )
    else:
        ready_value = ("True", Reason.ALL_READY, "trainer, buffer, router, rollout and samplers are ready")
    queued = admission is not None and admission[0] != "True"
    if queued:
        assert admission is not None
        ready_value = ("False", Reason.QUEUED, admission[2])
    rolling = [
        kind.removesuffix("Ready") for kind, state in components.items() if state and state.rolling_out
    ]
    rolling += [f"pool {pool.name}" for pool in pools if pool.rolling_out]
    failed = problems_value(problems)
    progressing: ConditionValue
    if failed is not None:
        progressing = failed
    elif rolling:
        progressing = ("True", Reason.ROLLING_OUT, f"rolling out: {', '.join(rolling)}")
    else:
        progressing = ("False", Reason.RECONCILED, "every object matches the spec")
    ours = [
        make_condition(READY, ready_value, generation, now, old),
        make_condition(PROGRESSING, progressing, generation, now, old),
        make_condition(INVALID_SPEC, ("False", Reason.VALID, ""), generation, now, old),
        *subs,
    ]
    if autoscaler is not None:
        ours.append(make_condition(AUTOSCALER_READY, autoscaler, generation, now, old))
    if admission is not None:
        ours.append(make_condition(ADMITTED, admission, generation, now, old))
    phase = previous.get("phase")
    if phase not in FINAL_PHASES:
        if queued:
            phase = "Queued"
        else:
            phase = "Running" if ready_value[0] == "True" or phase == "Running" else "Pending"
    return {
        **previous,
        "phase": phase,
        "observedGeneration": generation,
        "conditions": merge_conditions(old, ours),
        "pools": pool_summaries(list(previous.get("pools") or []), pools),
        "poolCount": len(pools),
    }


def without_policy_violation(previous: Obj) -> list[Obj]:
    """The conditions before, less PolicyViolation: it is there only while the policy refuses the
    spec, and a reconcile that gets past the policy check (or fails before it) drops it."""
    return [c for c in previous.get("conditions") or [] if c.get("type") != POLICY_VIOLATION]


FINAL_PHASES = ("Succeeded", "Failed")
"""A run's phase once it ended: kept whatever its spec later says (valid, invalid, refused)."""


def kept_final(previous: Obj, phase: str) -> str:
    """``phase``, unless the run already ended: an ended run stays Succeeded or Failed."""
    before = previous.get("phase")
    return before if before in FINAL_PHASES else phase


def invalid_run_status(previous: Obj, generation: int | None, message: str, now: str) -> Obj:
    """The status of a run whose spec cannot be valid: the one-line message, nothing created (a
    run that ended keeps its Succeeded or Failed phase; the conditions say the spec is invalid)."""
    old = without_policy_violation(previous)
    ours = [
        make_condition(READY, ("False", Reason.INVALID_SPEC, message), generation, now, old),
        make_condition(
            PROGRESSING, ("False", Reason.INVALID_SPEC, "waiting for a valid spec"), generation, now, old
        ),
        make_condition(INVALID_SPEC, ("True", Reason.INVALID_SPEC, message), generation, now, old),
    ]
    return {
        **previous,
        "phase": kept_final(previous, "Invalid"),
        "observedGeneration": generation,
        "conditions": merge_conditions(old, ours),
    }


def refused_run_status(previous: Obj, generation: int | None, message: str, now: str) -> Obj:
    """The status of a valid run that the cluster's policy refuses: the one line naming the field,
    nothing created or changed (what already runs stays as it was) until the spec or the policy
    changes; a run that ended keeps its Succeeded or Failed phase."""
    old = list(previous.get("conditions") or [])
    ours = [
        make_condition(READY, ("False", Reason.POLICY_VIOLATION, message), generation, now, old),
        make_condition(
            PROGRESSING,
            ("False", Reason.POLICY_VIOLATION, "waiting for a spec the cluster's policy allows"),
            generation,
            now,
            old,
        ),
        make_condition(INVALID_SPEC, ("False", Reason.VALID, ""), generation, now, old),
        make_condition(POLICY_VIOLATION, ("True", Reason.POLICY_VIOLATION, message), generation, now, old),
    ]
    return {
        **previous,
        "phase": kept_final(previous, "Invalid"),
        "observedGeneration": generation,
        "conditions": merge_conditions(old, ours),
    }


def pool_status(
    previous: Obj,
    generation: int | None,
    deployment: Obj | None,
    selector: str,
    now: str,
    autoscaler: ConditionValue | None = None,
    drop: tuple[str, ...] = (),
    problems: Sequence[Problem] = (),
    elastic: Elastic | None = None,
) -> Obj:
    """A SamplerPool's status from its Deployment (the scale subresource reads replicas and selector).

    ``autoscaler``: the AutoscalerReady value; ``drop``: condition types that no longer apply (the
    built-in loop's MetricsAvailable once another engine scales the pool); ``problems``: children
    that could not be applied, reported by a Progressing condition that is there only while they
    last; ``elastic``: a queued run's pool, whose ``Admitted`` condition and ``awaitingAdmission``
    say how many of its replicas above the start Kueue has not admitted, and why (both go when the
    run leaves its queue)."""
    state = WorkloadState.of(deployment)
    status = (deployment or {}).get("status") or {}
    failed = problems_value(problems)
    gone = (*drop, PROGRESSING) if failed is None else drop
    if elastic is None:
        gone = (*gone, ADMITTED)
    old = [c for c in previous.get("conditions") or [] if c.get("type") not in gone]
    ours = [make_condition(READY, condition_value(state), generation, now, old)]
    if failed is not None:
        ours.append(make_condition(PROGRESSING, failed, generation, now, old))
    if autoscaler is not None:
        ours.append(make_condition(AUTOSCALER_READY, autoscaler, generation, now, old))
    if elastic is not None:
        ours.append(make_condition(ADMITTED, elastic_value(elastic), generation, now, old))
    new = {
        **previous,
        "replicas": int(status.get("replicas") or 0),
        "readyReplicas": int(status.get("readyReplicas") or 0),
        "selector": selector,
        "observedGeneration": generation,
        "conditions": merge_conditions(old, ours),
    }
    if elastic is not None:
        new["awaitingAdmission"] = elastic.waiting
    elif "awaitingAdmission" in previous:
        new["awaitingAdmission"] = None  # a merge patch's null removes it
    return new


def elastic_value(elastic: Elastic) -> ConditionValue:
    """A queued run's pool's Admitted: True while Kueue admitted every replica it asks for; False
    whatever it asks for while Kueue holds the whole run (none of its replicas may run)."""
    if elastic.run_held:
        return (
            "False",
            Reason.QUEUED,
            f"the run waits for Kueue, and with it this pool's {elastic.waiting} replica(s): "
            f"{elastic.reason}"[:1000],
        )
    counts = f"{elastic.start} with the run, {elastic.admitted} of {elastic.wanted} above it"
    if elastic.waiting == 0:
        return (
            "True",
            Reason.ADMITTED,
            f"every replica admitted by Kueue in LocalQueue {elastic.queue} ({counts})",
        )
    return (
        "False",
        Reason.QUEUED,
        f"{elastic.waiting} replica(s) above the start wait for Kueue ({counts}): {elastic.reason}"[:1000],
    )
