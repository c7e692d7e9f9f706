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
  ``tokensPerSecond`` (tokens the router passed back from the pool, over one minute) and
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
RATE_WINDOW = "1m"


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
    def literal(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"')

    pool_matcher = f',pool="{literal(pool)}"' if pool is not None else ""
    return f'{{namespace="{literal(namespace)}",run="{literal(run)}"{pool_matcher}}}'


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
    return f'{{__name__=~"{names}",{_selector(namespace, run)[1:-1]}}}'


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


def collapse_value(assessment: Assessment | None, judged: bool) -> ConditionValue:
    """CollapseRisk: True with every raised sign and its figures, False when judged healthy, Unknown
    while there is not yet enough history to judge."""
    if assessment is not None and assessment.raised:
        message = "; ".join(sign.describe() for sign in assessment.raised)
        return "True", LiveReason.COLLAPSE, message[:1000]
    if not judged:
        return "Unknown", LiveReason.NO_SERIES, "not enough steps recorded yet to judge"
    return "False", LiveReason.STABLE, "no sign of collapse (docs/health.md)"


def live_run_status(
    previous: Obj,
    figures: Figures,
    generation: int | None,
    now: str,
    *,
    assessment: Assessment | None = None,
    judged: bool = False,
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
        ours.append(make_condition(COLLAPSE_RISK, collapse_value(assessment, judged), generation, now, old))
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


def placement_problem(pods: Sequence[Obj]) -> str | None:
    """Why the first of ``pods`` the scheduler cannot place waits, in one line: which component,
    what it asks of one node, and the scheduler's own reason (``PodScheduled=False``,
    ``Unschedulable``); None when every pod is placed (or being deleted)."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("name", "")):
        meta = pod.get("metadata") or {}
        reason = None if meta.get("deletionTimestamp") else unschedulable_message(pod, limit=800)
        if reason is None:
            continue
        spec = pod.get("spec") or {}
        gpus = sum(
            int(float((c.get("resources") or {}).get("limits", {}).get(GPU_RESOURCE, 0) or 0))
            for c in spec.get("containers") or []
        )
        labels = meta.get("labels") or {}
        what = labels.get(L.COMPONENT, "a")
        if labels.get(L.POOL):
            what = f"pool {labels[L.POOL]}'s"
        gpu_type = labels.get(L.GPU_TYPE)
        needs = f"{gpus} × {gpu_type or GPU_RESOURCE} on one node" if gpus else "its CPU and memory"
        return f"{what} pod {meta.get('name', '?')} needs {needs} and cannot be placed: {reason}"[:1000]
    return None


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
