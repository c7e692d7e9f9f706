"""The autoscaler's I/O: Prometheus instant queries and the Kubernetes calls, over aiohttp.

:func:`query_prometheus` reads one number, :func:`query_label_values` the label values of a set of
series, :func:`observe` a pool's :class:`~mixrl.operator.autoscaling.plan.Observation`; a failure is
a :class:`~mixrl.operator.autoscaling.plan.MetricsUnavailable` with a CamelCase reason
(``PrometheusUnreachable``, ``QueryFailed``, ``NoSeries``).  :class:`PoolApi` makes the loop's
writes, through the operator's RBAC-checked API client.
"""

from __future__ import annotations

import math
from typing import Literal

import aiohttp

from mixrl.api.kube_types import Obj
from mixrl.operator.autoscaling.plan import MetricsUnavailable, Observation
from mixrl.operator.autoscaling.promql import SUSTAINED_STEP, SUSTAINED_WINDOW, sustained_query
from mixrl.operator.kube.client import KubeClient
from mixrl.operator.kube.events import event_object
from mixrl.operator.kube.rbac import EVENTS, RLRUNS, SAMPLERPOOLS, ApiResource


async def query_prometheus(
    session: aiohttp.ClientSession, base_url: str, query: str, timeout_s: float = 10.0
) -> float:
    """The value of an instant query that must return one number (a scalar or a one-sample vector)."""
    url = base_url.rstrip("/") + "/api/v1/query"
    try:
        async with session.get(
            url, params={"query": query}, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            text = await response.text()
            try:
                payload = await response.json(content_type=None)
            except ValueError:
                payload = None
            status = response.status
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise MetricsUnavailable("PrometheusUnreachable", f"{url}: {exc or type(exc).__name__}") from exc
    if not isinstance(payload, dict) or payload.get("status") != "success":
        detail = payload.get("error") if isinstance(payload, dict) else text[:200]
        raise MetricsUnavailable("QueryFailed", f"HTTP {status}: {detail}")
    data = payload.get("data") or {}
    kind, result = data.get("resultType"), data.get("result")
    raw: object
    if kind == "scalar" and isinstance(result, list) and len(result) == 2:
        raw = result[1]
    elif kind == "vector" and isinstance(result, list):
        if not result:
            raise MetricsUnavailable("NoSeries", f"query returned no series: {query}")
        if len(result) > 1:
            raise MetricsUnavailable(
                "QueryFailed", f"query returned {len(result)} series, expected one (sum them)"
            )
        # A native histogram's sample has "histogram", not "value": a user's query may return one.
        sample = result[0].get("value") if isinstance(result[0], dict) else None
        raw = sample[1] if isinstance(sample, list) and len(sample) == 2 else None
    else:
        raise MetricsUnavailable("QueryFailed", f"unsupported result type {kind!r}")
    # Anything but a number is the pool's failed query, not an exception that ends the loop's tick
    # before the pools after this one are polled.
    try:
        value = float(str(raw))  # Prometheus sends numbers as strings ("NaN", "+Inf" included)
    except ValueError:
        raise MetricsUnavailable("QueryFailed", f"query returned {raw!r}, expected a number ≥ 0") from None
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise MetricsUnavailable("QueryFailed", f"query returned {raw}, expected a number ≥ 0")
    return value


async def query_label_values(
    session: aiohttp.ClientSession, base_url: str, query: str, label: str, timeout_s: float = 10.0
) -> set[str]:
    """The values of ``label`` across the series an instant query returns (none is fine)."""
    url = base_url.rstrip("/") + "/api/v1/query"
    try:
        async with session.get(
            url, params={"query": query}, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            payload = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        raise MetricsUnavailable("PrometheusUnreachable", f"{url}: {exc or type(exc).__name__}") from exc
    if not isinstance(payload, dict) or payload.get("status") != "success":
        raise MetricsUnavailable(
            "QueryFailed", str(payload.get("error") if isinstance(payload, dict) else payload)
        )
    result = (payload.get("data") or {}).get("result") or []
    return {series["metric"][label] for series in result if series.get("metric", {}).get(label)}


async def observe(
    session: aiohttp.ClientSession,
    base_url: str,
    query: str,
    timeout_s: float = 10.0,
    window: tuple[str, str] = (SUSTAINED_WINDOW, SUSTAINED_STEP),
) -> Observation:
    """The pool's load and its one-minute average; a missing average only skips the confirmation."""
    try:
        load = await query_prometheus(session, base_url, query, timeout_s)
    except MetricsUnavailable as problem:
        return Observation(None, None, problem)
    try:
        sustained: float | None = await query_prometheus(
            session, base_url, sustained_query(query, *window), timeout_s
        )
    except MetricsUnavailable:
        sustained = None
    return Observation(load, sustained)


class PoolApi:
    """The loop's writes — the replicas, the pool's status, the run's status, an event — through
    the operator's API client.

    The client (:class:`mixrl.operator.kube.client.KubeClient`) checks every call against the RBAC
    registry (:data:`mixrl.operator.kube.rbac.RECONCILER`) before sending it, so the chart's rules are
    generated from these calls too.  ``scale_via="subresource"`` (the default, what a cluster needs)
    patches ``…/samplerpools/NAME/scale`` with ``{"spec": {"replicas": N}}``; the API server maps it
    onto the CRD's ``specReplicasPath`` (``.spec.replicas``).  ``"object"`` merge-patches the
    SamplerPool itself — for an API that has no scale semantics.  Failures are
    :class:`mixrl.operator.kube.client.ApiError`.
    """

    def __init__(self, client: KubeClient, scale_via: Literal["subresource", "object"] = "subresource"):
        self.client = client
        self.scale_via = scale_via

    async def set_replicas(self, namespace: str, name: str, replicas: int) -> None:
        subresource = "scale" if self.scale_via == "subresource" else None
        body = {"spec": {"replicas": replicas}}
        await self.client.merge_patch(SAMPLERPOOLS, namespace, name, body, subresource=subresource)

    async def patch_status(self, namespace: str, name: str, patch: Obj) -> None:
        await self.client.merge_patch(SAMPLERPOOLS, namespace, name, patch, subresource="status")

    async def patch_annotations(self, namespace: str, name: str, annotations: Obj) -> None:
        """Merge ``annotations`` into the pool's (what the loop keeps there across a restart:
        :data:`mixrl.operator.autoscaling.plan.BLOCKED_UNTIL`)."""
        body = {"metadata": {"annotations": annotations}}
        await self.client.merge_patch(SAMPLERPOOLS, namespace, name, body)

    async def patch_run_status(self, namespace: str, name: str, patch: Obj) -> None:
        """The run's own status (``objective: trainer`` reports the concurrency the demand needs)."""
        await self.client.merge_patch(RLRUNS, namespace, name, {"status": patch}, subresource="status")

    async def post_event(
        self, body: Obj, kind: str, reason: str, message: str, now: float, about: ApiResource = SAMPLERPOOLS
    ) -> None:
        """An Event about ``body``, a SamplerPool unless ``about`` says (the run's TrainerStarved)."""
        event = event_object(about, body, kind, reason, message, now, "mixrl-autoscaler")
        await self.client.create(EVENTS, body["metadata"]["namespace"], event)
