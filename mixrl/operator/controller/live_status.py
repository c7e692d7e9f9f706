"""The live part of an RLRun's and its SamplerPools' status, from the components' metrics (pure).

The operator reads the run's figures from the Prometheus the run names
(``spec.autoscaling.prometheusUrl``), whatever ``autoscaling.engine`` says: the status is written
with the built-in autoscaler on, off (``none``) or replaced by KEDA.  Prometheus rather than
scraping the pods: it already holds every component's series under the pod's namespace (the
chart's PodMonitor or scrape annotations put them there), its history survives an operator
restart (the collapse signs need the run's first steps), and the operator needs no route to the
pods.  This module holds the queries (strings), turns their answers into figures, and composes
status from figures; :mod:`mixrl.operator.controller.observer` does the I/O (docs/health.md#live-status).

What is written, and from which series (names in :mod:`mixrl.rl.metrics`):

- the run: ``step`` (``mixrl_trainer_step``), ``weightVersion`` (``mixrl_trainer_weight_version``),
  ``reward`` (``mixrl_trainer_reward``), ``quarantinedBatches``
  (``mixrl_buffer_quarantined_batches_total``, with a Warning event when it rises), the phase (Succeeded once ``mixrl_trainer_finished`` is 1,
  Failed when the trainer's containers keep failing), the conditions ``MetricsAvailable`` and
  ``CollapseRisk`` (:mod:`mixrl.rl.health.collapse` on the run's history);
- each pool (in the run's ``pools`` list and on the SamplerPool): ``kl`` and ``extremeRatioShare``
  (the trainer's, over all of the pool's tokens of the last batch, stale ones included),
  ``klFresh`` (the same KL over its fresh tokens alone, staleness 0: the precision effect without
  drift; absent in a step without fresh tokens), ``health`` (the router's mismatch-aware health,
  with ``spec.health.routing``), ``trafficShare`` (the router's share of sessions),
  ``tokensPerSecond`` (tokens the router passed back from the pool, over two minutes) and
  ``servingWeightVersion`` (the newest version in the pool's answers).

Figures are rounded to :data:`SIGNIFICANT` digits, so that a write happens when a figure moves,
not when its last bit does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from mixrl.api.kube_types import Condition, ConditionValue, Obj
from mixrl.operator.autoscaling.promql import run_matchers
from mixrl.operator.autoscaling.replicas import unschedulable_message
from mixrl.operator.builders import labels as L
from mixrl.operator.kube.conditions import make_condition, update_conditions
from mixrl.rl import metrics as m
from mixrl.rl.health.collapse import Assessment
from mixrl.rl.router.shares import mismatched

METRICS_AVAILABLE = "MetricsAvailable"
COLLAPSE_RISK = "CollapseRisk"
SIGNIFICANT = 4
ALL_POOLS = "all"
"""The ``pool`` label of the trainer's run-wide series (mixrl.rl.trainer.telemetry.ALL_POOLS)."""
RATE_WINDOW = "2m"
"""``tokensPerSecond``'s window: rate() needs two samples in it, and Prometheus scrapes every minute
by default (annotations mode); over one minute it was empty there."""


class LiveReason:
    """Reasons of the conditions this module writes (alerts and tests match on them)."""

    SERIES_FOUND = "SeriesFound"
    NO_SERIES = "NoSeries"
    """Prometheus answers but holds no series of the run yet (components starting, or not scraped)."""
    STABLE = "NoSignOfCollapse"
    COLLAPSE = "SignsOfCollapse"
    FINISHED = "TotalStepsReached"
    TRAINER_FAILED = "TrainerFailed"
    PLACED = "AllPodsPlaced"
    UNSCHEDULABLE = "Unschedulable"


def _selector(namespace: str, run: str, pool: str | None = None) -> str:
    return f"{{{run_matchers(namespace, run, pool)}}}"


def run_queries(namespace: str, run: str) -> dict[str, str]:
    """The instant queries of one run's live status, by figure name; each answers per ``pool``."""
    everything = _selector(namespace, run, ALL_POOLS)
    per_pool = _selector(namespace, run)
    return {
        "step": f"max({m.MIXRL_TRAINER_STEP.name}{everything})",
        "weight_version": f"max({m.MIXRL_TRAINER_WEIGHT_VERSION.name}{everything})",
        "reward": f"max({m.MIXRL_TRAINER_REWARD.name}{everything})",
        "finished": f"max({m.MIXRL_TRAINER_FINISHED.name}{everything})",
        "kl": f"max by (pool) ({m.MIXRL_TRAINER_KL.name}{per_pool})",
        "kl_fresh": f"max by (pool) ({m.MIXRL_TRAINER_KL_FRESH.name}{per_pool})",
        "health": f"max by (pool) ({m.MIXRL_ROUTER_POOL_HEALTH.name}{per_pool})",
        "extreme_ratio_share": f"max by (pool) ({m.MIXRL_TRAINER_EXTREME_RATIO_SHARE.name}{per_pool})",
        "traffic_share": f"max by (pool) ({m.MIXRL_ROUTER_TRAFFIC_SHARE.name}{per_pool})",
        "tokens_per_second": (
            f"sum by (pool) (rate({m.MIXRL_ROUTER_GENERATED_TOKENS_TOTAL.name}{per_pool}[{RATE_WINDOW}]))"
        ),
        "serving_weight_version": f"max by (pool) ({m.MIXRL_ROUTER_WEIGHT_VERSION.name}{per_pool})",
        "measured_capacity": f"max by (pool) ({m.MIXRL_ROUTER_CAPACITY_MEASURED.name}{per_pool})",
        "quarantined_batches": f"max({m.MIXRL_BUFFER_QUARANTINED_BATCHES_TOTAL.name}{_selector(namespace, run)})",
    }


HISTORY_SERIES = {
    "step": m.MIXRL_TRAINER_STEP.name,
    "reward": m.MIXRL_TRAINER_REWARD.name,
    "kl_k3": m.MIXRL_TRAINER_KL.name,
    "format_error_endings": m.MIXRL_TRAINER_FORMAT_ERROR_ENDINGS.name,
}
"""The trainer's series the collapse signs are judged on, by the record key they become."""


def history_query(namespace: str, run: str) -> str:
    """One range query for the run's whole history of those series (every pool, the run's ``all``)."""
    names = "|".join(HISTORY_SERIES.values())
    return f'{{__name__=~"{names}",{run_matchers(namespace, run)}}}'


Vector = Mapping[str, float]
"""One query's answer: value by ``pool`` label ("" where the series has none)."""


@dataclass(frozen=True)
class Figures:
    """What Prometheus says about one run now."""

    run: dict[str, float] = field(default_factory=dict)
    """Run-wide figures: step, weight_version, reward, finished."""
    pools: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per pool: the keys of :data:`POOL_FIELDS` (kl, kl_fresh, health, extreme_ratio_share, ...)."""

    @property
    def empty(self) -> bool:
        return not self.run and not self.pools


RUN_FIGURES = ("step", "weight_version", "reward", "finished", "quarantined_batches")


def figures_from(answers: Mapping[str, Vector]) -> Figures:
    """Figures from the answers to :func:`run_queries` (a query with no series is simply absent)."""
    run: dict[str, float] = {}
    pools: dict[str, dict[str, float]] = {}
    for name, vector in answers.items():
        for pool, value in vector.items():
            if not math.isfinite(value):
                continue
            if name in RUN_FIGURES:
                run[name] = value
            elif pool and pool != ALL_POOLS:
                pools.setdefault(pool, {})[name] = value
    return Figures(run, pools)


def records_from_history(
    series: Sequence[tuple[Mapping[str, str], Sequence[tuple[float, float]]]],
) -> list[Obj]:
    """The trainer's per-step records (as ``metrics.jsonl`` holds them) from a range query's series.

    Samples are joined on their timestamp: at each sample time the run's ``step`` names the step
    the other gauges describe (the trainer sets them together).  One record per step, the last
    sample of that step winning; per-pool KL goes to ``pools.<name>.kl_k3``."""
    by_time: dict[float, Obj] = {}
    for labels, samples in series:
        key = next((k for k, name in HISTORY_SERIES.items() if name == labels.get("__name__")), None)
        pool = labels.get("pool", ALL_POOLS)
        if key is None:
            continue
        for when, value in samples:
            if not math.isfinite(value):
                continue
            record = by_time.setdefault(when, {"pools": {}})
            if pool == ALL_POOLS:
                record[key] = value
            elif key == "kl_k3":
                record["pools"].setdefault(pool, {})[key] = value
    records: dict[int, Obj] = {}
    for when in sorted(by_time):
        record = by_time[when]
        if "step" not in record or record["step"] < 1:
            continue
        record["step"] = int(record["step"])
        records[record["step"]] = record
    return [records[step] for step in sorted(records)]


def significant(value: float, digits: int = SIGNIFICANT) -> float:
    if value == 0 or not math.isfinite(value):
        return 0.0
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


POOL_FIELDS = {
    "kl": "kl",
    "kl_fresh": "klFresh",
    "health": "health",
    "extreme_ratio_share": "extremeRatioShare",
    "traffic_share": "trafficShare",
    "tokens_per_second": "tokensPerSecond",
    "serving_weight_version": "servingWeightVersion",
    "measured_capacity": "measuredCapacity",
}
INTEGER_FIELDS = frozenset({"servingWeightVersion", "step", "weightVersion", "quarantinedBatches"})


def pool_fields(figures: Mapping[str, float]) -> Obj:
    """A pool's live status fields (camelCase, as the CRD names them)."""
    out: Obj = {}
    for name, key in POOL_FIELDS.items():
        if name in figures:
            value = figures[name]
            out[key] = int(value) if key in INTEGER_FIELDS else significant(value)
    return out


def collapse_value(assessment: Assessment | None) -> ConditionValue:
    """CollapseRisk: True as soon as a sign judged so far is raised (with every raised sign and its
    figures); Unknown until every run-wide sign can be judged (:attr:`Assessment.complete`: the KL's
    baseline and window, the reward's ``rewardWindow``); then False while none is raised."""
    if assessment is not None and assessment.raised:
        message = "; ".join(sign.describe() for sign in assessment.raised)
        return "True", LiveReason.COLLAPSE, message[:1000]
    if assessment is None or not assessment.complete:
        return "Unknown", LiveReason.NO_SERIES, "not enough steps recorded yet to judge every sign"
    return "False", LiveReason.STABLE, "no sign of collapse (docs/health.md)"


def live_run_status(
    previous: Obj,
    figures: Figures,
    generation: int | None,
    now: str,
    *,
    assessment: Assessment | None = None,
    trainer_failure: str | None = None,
    problem: tuple[str, str] | None = None,
    unplaced: str | None = None,
) -> Obj:
    """The RLRun's status with its live fields, phase and the two metric conditions.

    ``problem``: (reason, message) when Prometheus could not be read: the last figures are kept
    (they are the last known truth) and MetricsAvailable says why.  ``trainer_failure``: the
    reason the trainer's containers keep failing (:func:`trainer_failure`), which fails the run.
    ``unplaced``: why a pod of the run cannot be scheduled (:func:`placement_problem`), for the
    PodsPlaced condition.  Phases Succeeded and Failed are final."""
    old = list(previous.get("conditions") or [])
    status = dict(previous)
    available: ConditionValue
    if problem is not None:
        available = ("False", *problem)
    elif figures.empty:
        available = ("False", LiveReason.NO_SERIES, "Prometheus holds no series of this run yet")
    else:
        available = ("True", LiveReason.SERIES_FOUND, "")
    ours = [make_condition(METRICS_AVAILABLE, available, generation, now, old)]
    placed: ConditionValue = (
        ("True", LiveReason.PLACED, "the scheduler placed every pod of the run")
        if unplaced is None
        else ("False", LiveReason.UNSCHEDULABLE, unplaced)
    )
    ours.append(make_condition(PODS_PLACED, placed, generation, now, old))
    if problem is None and not figures.empty:
        run_fields = (
            ("step", "step"),
            ("weight_version", "weightVersion"),
            ("reward", "reward"),
            ("quarantined_batches", "quarantinedBatches"),
        )
        for name, key in run_fields:
            if name in figures.run:
                value = figures.run[name]
                status[key] = int(value) if key in INTEGER_FIELDS else significant(value)
        pools = []
        for summary in previous.get("pools") or []:
            live = pool_fields(figures.pools.get(summary.get("name", ""), {}))
            pools.append({**summary, **live})
        if pools:
            status["pools"] = pools
        ours.append(make_condition(COLLAPSE_RISK, collapse_value(assessment), generation, now, old))
    phase = previous.get("phase")
    if phase not in ("Succeeded", "Failed", "Invalid"):
        if figures.run.get("finished") == 1:
            phase = "Succeeded"
            status["reason"] = LiveReason.FINISHED
            status["message"] = f"finished: {int(figures.run.get('step', 0))} steps taken"
        elif trainer_failure is not None:
            phase = "Failed"
            status["reason"] = LiveReason.TRAINER_FAILED
            status["message"] = trainer_failure[:1000]
        status["phase"] = phase
    status["conditions"] = update_conditions(old, ours)  # the reconciler's stay first, in their order
    return status


PODS_PLACED = "PodsPlaced"
"""Condition: whether the scheduler placed every pod of the run (False names the first it cannot)."""
GPU_RESOURCE = "nvidia.com/gpu"


def unplaced_pod(pods: Sequence[Obj]) -> Obj | None:
    """The first of ``pods`` (by name) the scheduler cannot place (``PodScheduled=False``,
    ``Unschedulable``), not being deleted; None when every pod is placed."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("name", "")):
        meta = pod.get("metadata") or {}
        if not meta.get("deletionTimestamp") and unschedulable_message(pod) is not None:
            return pod
    return None


def placement_problem(pods: Sequence[Obj], explanation: str | None = None) -> str | None:
    """Why the first of ``pods`` the scheduler cannot place waits, in one line: which component,
    what it asks of one node, and the scheduler's own reason; then ``explanation`` (what would
    fix it: :func:`placement_explanation`), for which the scheduler's reason is shortened so the
    line stays within a condition's 1000 characters.  None when every pod is placed."""
    pod = unplaced_pod(pods)
    if pod is None:
        return None
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    what = labels.get(L.COMPONENT, "a")
    if labels.get(L.POOL):
        what = f"pool {labels[L.POOL]}'s"
    gpus = pod_gpus(pod)
    needs = f"{gpus} × {labels.get(L.GPU_TYPE) or GPU_RESOURCE} on one node" if gpus else "its CPU and memory"
    head = f"{what} pod {meta.get('name', '?')} needs {needs} and cannot be placed: "
    tail = f"; {explanation[:EXPLANATION_LIMIT]}" if explanation else ""
    reason = unschedulable_message(pod, limit=max(MESSAGE_LIMIT - len(head) - len(tail), 80)) or ""
    return f"{head}{reason}{tail}"[:MESSAGE_LIMIT]


MESSAGE_LIMIT = 1000
EXPLANATION_LIMIT = 400
EXPLAIN_HINT = (
    "the operator's --explain-placement (chart: placement.explain) adds which nodes and runs hold the GPUs"
)
"""Appended when the explanation is off: turning it on is one flag, so the message says so."""
TOP_NODES = 3
TOP_HOLDERS = 3


def _quantity(raw: Any) -> float:
    """A GPU count as Kubernetes writes it ("8", 8); GPUs are whole, so no suffixes."""
    try:
        return float(raw or 0)
    except (TypeError, ValueError):
        return 0.0


def pod_gpus(pod: Obj) -> int:
    """GPUs a pod holds on its node: the larger of its containers' sum and any init container's
    (a request, else the limit, which is the request for an extended resource)."""

    def gpus(container: Obj) -> float:
        resources = container.get("resources") or {}
        for kind in ("requests", "limits"):
            if GPU_RESOURCE in (resources.get(kind) or {}):
                return _quantity(resources[kind][GPU_RESOURCE])
        return 0.0

    spec = pod.get("spec") or {}
    running = sum(gpus(c) for c in spec.get("containers") or [])
    init = max((gpus(c) for c in spec.get("initContainers") or []), default=0.0)
    return int(max(running, init))


def _expression_matches(expression: Obj, values_of: Mapping[str, str]) -> bool:
    key, operator = expression.get("key", ""), expression.get("operator", "")
    values = [str(v) for v in expression.get("values") or []]
    present = key in values_of
    value = values_of.get(key, "")
    if operator == "In":
        return present and value in values
    if operator == "NotIn":
        return not present or value not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and values:
        try:
            number, bound = int(value), int(values[0])
        except ValueError:
            return False
        return number > bound if operator == "Gt" else number < bound
    return False


def node_matches(pod: Obj, node: Obj) -> bool:
    """Whether ``node`` satisfies ``pod``'s node selector and required node affinity (the terms
    OR-ed, the expressions of one term AND-ed, as the scheduler reads them); taints and resources
    are not looked at."""
    spec = pod.get("spec") or {}
    meta = node.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    if any(labels.get(k) != str(v) for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    fields = {"metadata.name": str(meta.get("name", ""))}
    return any(
        all(_expression_matches(e, labels) for e in term.get("matchExpressions") or [])
        and all(_expression_matches(e, fields) for e in term.get("matchFields") or [])
        for term in terms
    )


def _holder(pod: Obj) -> str:
    """Who holds a pod's GPUs: ``run <namespace>/<name>`` for a mixrl pod, else the pod."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    namespace = meta.get("namespace", "?")
    if labels.get(L.NAME) == L.APP and labels.get(L.INSTANCE):
        return f"run {namespace}/{labels[L.INSTANCE]}"
    return f"pod {namespace}/{meta.get('name', '?')}"


def placement_explanation(pod: Obj, nodes: Sequence[Obj], pods: Sequence[Obj]) -> str | None:
    """What would let the unplaced ``pod`` in, from the cluster's nodes and pods: how many GPUs
    the nodes it may use (its GPU placement) have free — allocatable minus the GPUs of the
    non-terminated pods bound there — the most free first, and which runs (or, for pods not of
    mixrl, which pods) hold the rest.  None for a pod that asks for no GPU (the scheduler's reason
    says enough about CPU and memory)."""
    wanted = pod_gpus(pod)
    if wanted == 0:
        return None
    labels = (pod.get("metadata") or {}).get("labels") or {}
    kind = labels.get(L.GPU_TYPE) or GPU_RESOURCE
    matching = {
        str(n["metadata"]["name"]): n
        for n in nodes
        if node_matches(pod, n)
        and _quantity(((n.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE)) > 0
    }
    if not matching:
        return (
            f"no node of the cluster offers {kind} GPUs to this pod: add {kind} nodes, or change the gpuType"
        )
    used: dict[str, int] = dict.fromkeys(matching, 0)
    holders: dict[str, list[int]] = {}  # holder -> [GPUs, pods]
    for other in pods:
        node = (other.get("spec") or {}).get("nodeName")
        phase = (other.get("status") or {}).get("phase")
        if node not in used or phase in ("Succeeded", "Failed"):
            continue
        gpus = pod_gpus(other)
        if gpus == 0:
            continue
        used[node] += gpus
        held = holders.setdefault(_holder(other), [0, 0])
        held[0] += gpus
        held[1] += 1
    free = {
        name: int(_quantity(node["status"]["allocatable"][GPU_RESOURCE])) - used[name]
        for name, node in matching.items()
    }
    cordoned = {name for name, node in matching.items() if (node.get("spec") or {}).get("unschedulable")}
    ranked = sorted(matching, key=lambda name: (-free[name], name))
    shown = ", ".join(
        f"{name} {max(free[name], 0)}" + (" (cordoned)" if name in cordoned else "")
        for name in ranked[:TOP_NODES]
    )
    more = f" and {len(ranked) - TOP_NODES} more" if len(ranked) > TOP_NODES else ""
    fits = [name for name in ranked if free[name] >= wanted and name not in cordoned]
    if fits:
        verdict = f"{fits[0]} has {free[fits[0]]} free, so the GPUs are not what blocks it"
    else:
        best = (
            max(free[name] for name in ranked if name not in cordoned) if len(cordoned) < len(ranked) else 0
        )
        verdict = (
            f"none has {wanted} free: it fits once {wanted - max(best, 0)} more are freed on one of them"
        )
    text = f"{len(matching)} {kind} node(s) it may use; GPUs free on the most free: {shown}{more}; {verdict}"
    if holders:
        top = sorted(holders.items(), key=lambda item: (-item[1][0], item[0]))
        named = ", ".join(
            f"{who} ({gpus} GPUs in {count} pod(s))" for who, (gpus, count) in top[:TOP_HOLDERS]
        )
        others = f" and {len(top) - TOP_HOLDERS} more" if len(top) > TOP_HOLDERS else ""
        text += f"; their GPUs are held by {named}{others}"
    return text[:EXPLANATION_LIMIT]


def quarantine_event(previous: Obj, new: Obj) -> str | None:
    """The Warning event's message when the buffer quarantined more batches since the last status."""
    before, now = previous.get("quarantinedBatches") or 0, new.get("quarantinedBatches") or 0
    if now <= before:
        return None
    return (
        f"{now - before} more batch(es) the trainer could not train were quarantined ({now} in all); the run "
        "goes on with other groups. The buffer's GET /stats lists each with its reason; the batches are in "
        "its quarantine/ directory"
    )


CAPACITY_MISMATCH = "CapacityMismatch"
"""Condition (and Warning event on the run) of a pool whose measured capacity is far off its declared one."""


def capacity_condition(
    previous: Obj, declared: float | None, measured: float | None, generation: int | None, now: str
) -> Condition | None:
    """``CapacityMismatch``: True naming both figures when the router's trusted measurement is off
    the declared capacity by more than :data:`~mixrl.rl.router.shares.MISMATCH_FACTOR` (the router
    then shares by the measurement); False when within it; None while there is nothing to compare
    (a pool declared null is measured, not checked)."""
    if declared is None or measured is None:
        return None
    value: ConditionValue
    if mismatched(declared, measured):
        value = (
            "True",
            "MeasuredOff",
            f"measured capacity {measured:.3g} per replica against the declared {declared:.3g} "
            f"({max(measured, declared) / min(measured, declared):.2g}x off): the router shares by the "
            "measurement; correct spec.samplerPools[].capacity, or set it null to have it measured",
        )
    else:
        value = (
            "False",
            "AsDeclared",
            f"measured capacity {measured:.3g} per replica, declared {declared:.3g}",
        )
    return make_condition(CAPACITY_MISMATCH, value, generation, now, list(previous.get("conditions") or []))


def live_pool_status(
    previous: Obj,
    figures: Mapping[str, float],
    declared: float | None = None,
    generation: int | None = None,
    now: str = "",
) -> Obj:
    """A SamplerPool's status with its live figures (the rest as its controller wrote it), and its
    ``CapacityMismatch`` condition when the router measured it (``declared``: its spec's capacity)."""
    status = {**previous, **pool_fields(figures)}
    condition = capacity_condition(previous, declared, figures.get("measured_capacity"), generation, now)
    if condition is not None:  # in its place: the pool's controller writes the others
        status["conditions"] = update_conditions(previous.get("conditions") or [], [condition])
    return status


FAILED_AFTER_RESTARTS = 6
"""A trainer container that has failed this many times fails the run (a Job's default backoffLimit)."""


def trainer_failure(pods: Sequence[Obj], limit: int = FAILED_AFTER_RESTARTS) -> str | None:
    """Why the run failed, when a trainer container has restarted ``limit`` times and its last
    run ended in an error (exit code ≠ 0) — its termination message or reason, else None.

    A trainer that exits 0 is never a failure (a finished trainer holds; docs/health.md#the-end-of-a-run)."""
    for pod in pods:
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            if container.get("name") != "trainer" or int(container.get("restartCount") or 0) < limit:
                continue
            state = container.get("state") or {}
            last = (state.get("terminated") or (container.get("lastState") or {}).get("terminated")) or {}
            code = last.get("exitCode")
            if code in (None, 0):
                continue
            detail = (last.get("message") or last.get("reason") or "").strip().splitlines()
            name = pod.get("metadata", {}).get("name", "trainer")
            why = f": {detail[-1]}" if detail else ""
            return f"trainer {name} failed {container['restartCount']} times (exit code {code}){why}"
    return None


# ----------------------------------------------------------------------------- spend

TRAINER = "trainer"
SPEND_WRITE_INTERVAL_S = 300.0
"""Spend alone (no new step, no phase change) is written at most this often: GPUs held by an idle
run cost money, but a write every poll for it would be the write storm the rate limit prevents."""


@dataclass(frozen=True)
class Spend:
    """GPU-hours and dollars accrued by one pool (or the trainer) up to ``since`` (unix time)."""

    gpu_hours: float = 0.0
    dollars: float = 0.0
    since: float | None = None

    def accrue(self, gpus: float, price_per_gpu_hour: float, now: float) -> Spend:
        """``gpus`` held since the last accrual (sampled now: the poll interval is the resolution)."""
        hours = max(now - self.since, 0.0) / 3600 if self.since is not None else 0.0
        return Spend(self.gpu_hours + gpus * hours, self.dollars + gpus * hours * price_per_gpu_hour, now)


def spend_from_status(status: Obj) -> dict[str, Spend]:
    """The spend a status recorded (after an operator restart the accrual goes on from there)."""
    since = _unix(status.get("spendUpdatedAt"))
    spends = {TRAINER: Spend(status.get("trainerGpuHours") or 0.0, status.get("trainerCost") or 0.0, since)}
    for pool in status.get("pools") or []:
        spends[pool.get("name", "")] = Spend(pool.get("gpuHours") or 0.0, pool.get("cost") or 0.0, since)
    return spends


def spend_fields(previous: Obj, spends: Mapping[str, Spend], now: str) -> Obj:
    """The status's spend fields: per pool, the trainer, the run's total and its cost per update."""
    status = dict(previous)
    pools = []
    for summary in previous.get("pools") or []:
        spend = spends.get(summary.get("name", ""))
        if spend is not None:
            summary = {
                **summary,
                "gpuHours": significant(spend.gpu_hours),
                "cost": significant(spend.dollars),
            }
        pools.append(summary)
    if pools:
        status["pools"] = pools
    trainer = spends.get(TRAINER, Spend())
    status["trainerGpuHours"] = significant(trainer.gpu_hours)
    status["trainerCost"] = significant(trainer.dollars)
    total = sum(spend.dollars for spend in spends.values())
    status["gpuHours"] = significant(sum(spend.gpu_hours for spend in spends.values()))
    status["cost"] = significant(total)
    step = status.get("step") or 0
    if step > 0:
        status["costPerUpdate"] = significant(total / step)
    status["spendUpdatedAt"] = now
    return status


def _unix(stamp: Any) -> float | None:
    try:
        return datetime.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None
