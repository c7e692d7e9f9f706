"""The live status loop: reads each run's figures from Prometheus and writes its status (I/O).

Composition is pure (:mod:`mixrl.operator.controller.live_status`); this is the reading and the
writing.  Every ``interval_s`` (per run), for every RLRun kopf has shown it:

1. instant queries for the run's figures, and one range query for the trainer's history since the
   last poll (the collapse signs are judged on the whole run, and Prometheus keeps it across an
   operator restart);
2. the trainer's pods, for a trainer that keeps failing (Failed);
3. the run's status and each of its SamplerPools' statuses are merge-patched, only when they
   changed, and never more often than ``min_write_interval_s`` unless the phase or CollapseRisk
   flips — so an idle run costs no writes at all (``writes`` counts them);
4. a Warning event when CollapseRisk becomes True or the buffer quarantines a batch, a Normal one when the run succeeds, a Warning
   when it fails; and at either end a reconcile of the run, which releases its GPUs.

Each status is composed and written under the object's lock (the one its reconciler holds) from a
fresh read: a reconcile writes the whole status from what it read, so the two never interleave.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp

from mixrl.api.errors import InvalidSpec
from mixrl.api.gpus import default_price, price_per_gpu_hour, requested_gpus
from mixrl.api.kube_types import Obj
from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.operator.builders import labels as L
from mixrl.operator.controller.live_status import (
    CAPACITY_MISMATCH,
    COLLAPSE_RISK,
    EXPLAIN_HINT,
    PODS_PLACED,
    SPEND_WRITE_INTERVAL_S,
    TRAINER,
    Figures,
    LiveReason,
    Spend,
    figures_from,
    history_query,
    live_pool_status,
    live_run_status,
    placement_explanation,
    placement_problem,
    quarantine_event,
    records_from_history,
    run_queries,
    spend_fields,
    spend_from_status,
    trainer_failure,
    unplaced_pod,
)
from mixrl.operator.controller.reconcile import manifest
from mixrl.operator.kube.client import ApiError, KubeClient
from mixrl.operator.kube.events import event_object, rfc3339
from mixrl.operator.kube.rbac import EVENTS, NODES, PODS, RLRUNS, SAMPLERPOOLS
from mixrl.operator.kube.ticker import Ticker
from mixrl.rl.health.collapse import assess

log = logging.getLogger("mixrl.operator.status")

Key = tuple[str, str]


class PrometheusError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


async def prometheus_api(
    session: aiohttp.ClientSession, base_url: str, path: str, params: Mapping[str, str], timeout_s: float
) -> Any:
    """``data.result`` of one Prometheus API call, or PrometheusError(reason, message)."""
    url = base_url.rstrip("/") + path
    try:
        async with session.get(
            url, params=params, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            payload = await response.json(content_type=None)
            status = response.status
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        raise PrometheusError("PrometheusUnreachable", f"{url}: {exc or type(exc).__name__}") from exc
    if not isinstance(payload, dict) or payload.get("status") != "success":
        detail = payload.get("error") if isinstance(payload, dict) else "not a Prometheus answer"
        raise PrometheusError("QueryFailed", f"HTTP {status}: {detail}")
    return (payload.get("data") or {}).get("result") or []


def _number(raw: Any) -> float:
    try:
        return float(raw)
    except (TypeError, ValueError):
        return math.nan


async def query_vector(
    session: aiohttp.ClientSession, base_url: str, query: str, timeout_s: float
) -> dict[str, float]:
    """An instant vector as value by ``pool`` label ("" for a series without one)."""
    result = await prometheus_api(session, base_url, "/api/v1/query", {"query": query}, timeout_s)
    return {
        str(item.get("metric", {}).get("pool", "")): _number(item.get("value", [0, None])[1])
        for item in result
        if isinstance(item, dict)
    }


async def query_history(
    session: aiohttp.ClientSession, base_url: str, query: str, start: float, end: float, timeout_s: float
) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
    # At most ~10,000 points per series (Prometheus refuses 11,000), never finer than 1 s (the
    # finest scrape interval in use; a trainer step takes longer).
    step = max(1.0, (end - start) / 10_000)
    params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:.3f}"}
    result = await prometheus_api(session, base_url, "/api/v1/query_range", params, timeout_s)
    return [
        (dict(item.get("metric", {})), [(float(t), _number(v)) for t, v in item.get("values", [])])
        for item in result
        if isinstance(item, dict)
    ]


def created_at(body: Obj) -> float | None:
    stamp = body.get("metadata", {}).get("creationTimestamp")
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except (TypeError, ValueError):
        return None


UNBOUND = "spec.nodeName="
"""A field selector for the pods the scheduler has not bound to a node yet."""


@dataclass
class ObserverSettings:
    interval_s: float = 15.0
    """How often each run's figures are read."""
    min_write_interval_s: float = 30.0
    """Fewest seconds between two status writes of one object (flips of phase or CollapseRisk excepted)."""
    query_timeout_s: float = 10.0
    tick_s: float = 1.0
    explain_placement: bool = False
    """A run with an unplaced pod is told which nodes could hold it and who holds their GPUs: a
    cluster-wide read of nodes and pods (``--explain-placement``; its RBAC only with it)."""


@dataclass
class RunMemory:
    records: dict[int, Obj] = field(default_factory=dict)
    """The trainer's per-step records read so far (the collapse signs' input)."""
    history_until: float | None = None
    last_read: float = -math.inf
    last_write: dict[str, float] = field(default_factory=dict)
    """Object name -> when its status was last written."""
    collapse: str | None = None
    """CollapseRisk's status at the last write (an event is posted when it becomes True)."""
    spends: dict[str, Spend] | None = None
    """GPU-hours and dollars per pool and the trainer, accrued at every poll (None until read
    back from the status, so an operator restart goes on from what was written)."""
    spend_written: float = -math.inf


Reconcile = Callable[[str, str], None]
Gate = Callable[[str], Awaitable[bool]]


class StatusObserver(Ticker):
    """Keeps the RLRuns kopf shows it (watch events) and writes their live status."""

    tick_name = "mixrl-status"

    def __init__(
        self,
        client: KubeClient,
        settings: ObserverSettings | None = None,
        reconcile: Reconcile | None = None,
        may_act: Gate | None = None,
        clock: Callable[[], float] = time.time,
        lock: Callable[[str], asyncio.Lock] | None = None,
    ):
        settings = settings or ObserverSettings()
        super().__init__(settings.tick_s, log)
        self.client = client
        self._locks: dict[str, asyncio.Lock] = {}
        self.lock = lock or (lambda key: self._locks.setdefault(key, asyncio.Lock()))
        """Object key (``Kind/namespace/name``) -> the lock its reconciler holds while it writes."""
        self.settings = settings
        self.reconcile = reconcile
        self.may_act = may_act
        self.clock = clock
        self.runs: dict[Key, Obj] = {}
        self.memory: dict[Key, RunMemory] = {}
        self.writes = 0
        """Status patches sent (tests count them: an idle run must cost none)."""
        self._cluster: tuple[float, list[Obj], list[Obj]] | None = None
        """(when read, nodes, pods bound to a node): one cluster-wide read serves every run that
        needs an explanation within one interval."""

    def observe_run(self, body: Mapping[str, Any], deleted: bool) -> None:
        meta = body["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        if deleted:
            self.runs.pop(key, None)
            self.memory.pop(key, None)
        else:
            self.runs[key] = dict(body)

    def forget(self, key: Key, uid: str | None) -> None:
        """Drop a run found deleted (and its memory), unless the watch already holds a newer run
        of that name."""
        known = self.runs.get(key)
        if known is not None and known.get("metadata", {}).get("uid") == uid:
            self.runs.pop(key, None)
            self.memory.pop(key, None)

    async def tick(self) -> None:
        now = self.clock()
        for key, body in list(self.runs.items()):
            memory = self.memory.setdefault(key, RunMemory())
            if now - memory.last_read < self.settings.interval_s:
                continue
            if self.may_act is not None and not await self.may_act(key[0]):
                continue
            memory.last_read = now
            try:
                await self.observe(body, memory, now)
            except ApiError as exc:
                log.warning("status of RLRun %s/%s not written: %s", *key, exc)

    async def observe(self, body: Obj, memory: RunMemory, now: float) -> None:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        if (body.get("status") or {}).get("phase") in ("Invalid", "Succeeded", "Failed"):
            return  # nothing live to show; an ended run's last figures and spend were written at its end
        try:
            run = parse_document(manifest(body))
            assert isinstance(run, RLRun)
            resolved = resolve(run)
        except InvalidSpec:  # the reconciler reports it; there is nothing live to show
            return
        url = resolved.autoscaling.prometheus_url
        timeout = self.settings.query_timeout_s
        figures, problem = Figures(), None
        try:
            answers = {
                figure: await query_vector(self.session(), url, query, timeout)
                for figure, query in run_queries(namespace, name).items()
            }
            figures = figures_from(answers)
            start = memory.history_until or created_at(body) or now - 86_400.0
            history = await query_history(
                self.session(), url, history_query(namespace, name), start, now, timeout
            )
            for record in records_from_history(history):
                memory.records[record["step"]] = record
            memory.history_until = now
        except PrometheusError as exc:
            problem = (exc.reason, exc.message)
        pods = await self.client.list(PODS, namespace, L.selector_labels(name, "trainer"))
        failure = trainer_failure(pods)
        # Of the engines only those on no node yet: the ones the scheduler may not be able to place
        # (every pod of a run's pools, read every interval, was most of the loop's cost).
        samplers = await self.client.list(
            PODS, namespace, L.selector_labels(name, "sampler"), field_selector=UNBOUND
        )
        unplaced = await self._placement([*pods, *samplers], now)
        pool_bodies = await self.client.list(
            SAMPLERPOOLS, namespace, L.selector_labels(name, "sampler"), cached=True
        )
        collapse_spec = run.spec.health.collapse
        records = [memory.records[step] for step in sorted(memory.records)]
        assessment = assess(records, collapse_spec) if records else None
        # Composed and written under the run's lock from the run as it is now: a reconcile writes
        # the whole status from what it read, so the two must not interleave.
        async with self.lock(f"RLRun/{namespace}/{name}"):
            fresh = await self.client.get(RLRUNS, namespace, name)
            if fresh is None:
                # Deleted while the watch was away (kopf reports no DELETED for that): forgotten.
                self.forget((namespace, name), meta.get("uid"))
                return
            if fresh["metadata"].get("uid") != meta.get("uid"):
                return
            previous = fresh.get("status") or {}
            new = live_run_status(
                previous,
                figures,
                fresh["metadata"].get("generation"),
                rfc3339(now),
                assessment=assessment,
                trainer_failure=failure,
                problem=problem,
                unplaced=unplaced,
            )
            spends = self._accrue(memory, previous, resolved, pool_bodies, now)
            moved = new.get("step") != previous.get("step") or new.get("phase") != previous.get("phase")
            if moved or now - memory.spend_written >= SPEND_WRITE_INTERVAL_S:
                new = spend_fields(new, spends, rfc3339(now))
            written = await self._write_run(fresh, previous, new, memory, now)
            if written and new.get("spendUpdatedAt") != previous.get("spendUpdatedAt"):
                memory.spend_written = now
        if written:
            await self._events(fresh, previous, new, memory, now)
        if problem is None:
            await self._write_pools(fresh, figures, memory, now)

    async def _placement(self, pods: list[Obj], now: float) -> str | None:
        """PodsPlaced's message: the unplaced pod and the scheduler's reason, and with
        ``explain_placement`` the nodes it may use and who holds their GPUs (else how to get that)."""
        stuck = unplaced_pod(pods)
        if stuck is None:
            return None
        if not self.settings.explain_placement:
            return placement_problem(pods, EXPLAIN_HINT)
        try:
            if self._cluster is None or now - self._cluster[0] >= self.settings.interval_s:
                nodes = await self.client.list_cluster(NODES)
                # Only pods that hold a node: bound (nodeName set) and not terminated.
                bound = await self.client.list_cluster(
                    PODS, field_selector="spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
                )
                self._cluster = (now, nodes, bound)
            explanation = placement_explanation(stuck, self._cluster[1], self._cluster[2])
        except ApiError as exc:
            explanation = f"nodes and pods could not be read to explain it: {exc}"
        return placement_problem(pods, explanation)

    def _accrue(
        self, memory: RunMemory, previous: Obj, resolved: ResolvedRun, pool_bodies: list[Obj], now: float
    ) -> dict[str, Spend]:
        """GPUs held since the last poll, priced: each pool's existing pods (``status.replicas``:
        a Pending pod's node is billed too) × its GPUs per replica, and the trainer's nodes until
        the run ends.  Prices: ``costPerGpuHour``, else the default table (mixrl.api.gpus)."""
        if memory.spends is None:  # first look since this operator started: go on from the status
            memory.spends = spend_from_status(previous)
            written_at = memory.spends[TRAINER].since
            if written_at is not None:  # so a restart on an unchanged cluster writes nothing at once
                memory.spend_written = written_at
        existing = {
            body.get("spec", {}).get("pool", ""): int((body.get("status") or {}).get("replicas") or 0)
            for body in pool_bodies
        }
        for pool in resolved.pools:
            price = price_per_gpu_hour(pool.gpu_type, pool.cost_per_gpu_hour)
            gpus = existing.get(pool.name, 0) * pool.gpus_per_replica
            memory.spends[pool.name] = memory.spends.get(pool.name, Spend()).accrue(gpus, price, now)
        trainer = resolved.trainer.spec
        ended = (previous.get("phase") or "") in ("Succeeded", "Failed")
        gpus = 0 if ended else trainer.nodes * requested_gpus(trainer.gpu_type, trainer.gpus_per_node)
        spend = memory.spends.get(TRAINER, Spend())
        memory.spends[TRAINER] = spend.accrue(gpus, default_price(trainer.gpu_type), now)
        return memory.spends

    async def _write_run(self, body: Obj, previous: Obj, new: Obj, memory: RunMemory, now: float) -> bool:
        meta = body["metadata"]
        if new == previous:
            return False
        flipped = new.get("phase") != previous.get("phase") or _condition_status(
            new, COLLAPSE_RISK
        ) != _condition_status(previous, COLLAPSE_RISK)
        last = memory.last_write.get(meta["name"], -math.inf)
        if not flipped and now - last < self.settings.min_write_interval_s:
            return False
        await self.client.merge_patch(
            RLRUNS, meta["namespace"], meta["name"], {"status": new}, subresource="status"
        )
        self.writes += 1
        memory.last_write[meta["name"]] = now
        return True

    async def _events(self, body: Obj, previous: Obj, new: Obj, memory: RunMemory, now: float) -> None:
        if _condition_status(new, PODS_PLACED) == "False" != _condition_status(previous, PODS_PLACED):
            message = next(c["message"] for c in new["conditions"] if c["type"] == PODS_PLACED)
            await self.post_event(body, "Warning", LiveReason.UNSCHEDULABLE, message, now)
        meta = body["metadata"]
        risk = _condition_status(new, COLLAPSE_RISK)
        if risk == "True" and memory.collapse != "True":
            message = next(c["message"] for c in new["conditions"] if c["type"] == COLLAPSE_RISK)
            await self.post_event(body, "Warning", "CollapseRisk", message, now)
        memory.collapse = risk
        quarantined = quarantine_event(previous, new)
        if quarantined is not None:
            await self.post_event(body, "Warning", "BatchQuarantined", quarantined, now)
        phase = new.get("phase")
        if phase != previous.get("phase") and phase in ("Succeeded", "Failed"):
            kind = "Normal" if phase == "Succeeded" else "Warning"
            await self.post_event(body, kind, phase, str(new.get("message", phase)), now)
            if self.reconcile is not None:  # the reconciler releases a finished run's GPUs
                self.reconcile(meta["namespace"], meta["name"])

    async def _write_pools(self, run_body: Obj, figures: Figures, memory: RunMemory, now: float) -> None:
        """Each pool's live figures and CapacityMismatch condition (a Warning on the run when it
        turns True)."""
        namespace, run = run_body["metadata"]["namespace"], run_body["metadata"]["name"]
        # The pools as the watches showed them; each one whose status would change is read again
        # under its lock before the write.
        listed_pools = await self.client.list(
            SAMPLERPOOLS, namespace, L.selector_labels(run, "sampler"), cached=True
        )
        for listed in listed_pools:
            name = listed["metadata"]["name"]
            if now - memory.last_write.get(name, -math.inf) < self.settings.min_write_interval_s:
                continue
            live = figures.pools.get(listed.get("spec", {}).get("pool", ""), {})

            def composed(pool: Obj, live: Mapping[str, float] = live) -> Obj:
                return live_pool_status(
                    pool.get("status") or {},
                    live,
                    declared=(pool.get("spec") or {}).get("capacity"),
                    generation=pool["metadata"].get("generation"),
                    now=rfc3339(now),
                )

            if composed(listed) == (listed.get("status") or {}):
                continue
            async with self.lock(f"SamplerPool/{namespace}/{name}"):  # as the pool's reconcile
                pool = await self.client.get(SAMPLERPOOLS, namespace, name)
                if pool is None:
                    continue
                previous = pool.get("status") or {}
                new = composed(pool)
                if new == previous:
                    continue
                changed = {k: v for k, v in new.items() if previous.get(k) != v}
                await self.client.merge_patch(
                    SAMPLERPOOLS, namespace, name, {"status": changed}, subresource="status"
                )
            self.writes += 1
            memory.last_write[name] = now
            if (
                _condition_status(new, CAPACITY_MISMATCH)
                == "True"
                != _condition_status(previous, CAPACITY_MISMATCH)
            ):
                message = next(c["message"] for c in new["conditions"] if c["type"] == CAPACITY_MISMATCH)
                await self.post_event(run_body, "Warning", CAPACITY_MISMATCH, f"pool {name}: {message}", now)

    async def post_event(self, body: Obj, kind: str, reason: str, message: str, now: float) -> None:
        """Best effort: an event that cannot be posted is logged, and what follows it (the other
        events, the reconcile that releases an ended run's GPUs, the pools' writes) still runs."""
        event = event_object(RLRUNS, body, kind, reason, message, now, "mixrl-status")
        try:
            await self.client.create(EVENTS, body["metadata"]["namespace"], event)
        except ApiError as exc:
            meta = body["metadata"]
            log.warning(
                "event %s on RLRun %s/%s not posted: %s", reason, meta["namespace"], meta["name"], exc
            )


def _condition_status(status: Obj, kind: str) -> str | None:
    return next((c.get("status") for c in status.get("conditions") or [] if c.get("type") == kind), None)
