"""The router's Prometheus series (``mixrl_router_*``, names in :mod:`mixrl.rl.metrics`).

Gauges and counters are read from :class:`RouterState` at scrape time, so they can never drift
from what ``GET /pools`` shows; only the latency histogram is observed per request.  The queue
depth's exact meaning is documented beside its name in :mod:`mixrl.rl.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mixrl.rl import metrics
from mixrl.rl.health.routing import HEALTHY
from mixrl.rl.metrics import MetricSpec
from mixrl.rl.router.shares import capacity_per_replica, reported_measurements
from mixrl.rl.router.state import Pool, RouterState


class RouterCollector(Collector):
    def __init__(self, state: RouterState, run: str) -> None:
        self.state = state
        self.run = run

    def _family(self, spec: MetricSpec, value_of: Callable[[Pool], float]) -> Metric:
        kind = GaugeMetricFamily if spec.kind == "gauge" else CounterMetricFamily
        family = kind(spec.name, spec.help, labels=spec.labels)
        for pool in self.state.pools.values():
            family.add_metric([self.run, pool.name, pool.gpu_type, pool.precision], float(value_of(pool)))
        return family

    def collect(self) -> Iterator[Metric]:
        active = self.state.active_sessions()
        shares = self.state.scheduler.shares
        assigned_total = sum(pool.sessions_assigned for pool in self.state.pools.values())
        series: list[tuple[MetricSpec, Callable[[Pool], float]]] = [
            (metrics.MIXRL_ROUTER_SESSIONS, lambda p: active[p.name]),
            (metrics.MIXRL_ROUTER_SESSIONS_ASSIGNED_TOTAL, lambda p: p.sessions_assigned),
            (metrics.MIXRL_ROUTER_SESSIONS_MOVED_TOTAL, lambda p: p.sessions_moved_out),
            (metrics.MIXRL_ROUTER_REQUESTS_TOTAL, lambda p: p.requests),
            (metrics.MIXRL_ROUTER_ERRORS_TOTAL, lambda p: p.errors),
            (
                metrics.MIXRL_ROUTER_REQUESTS_IN_FLIGHT,
                lambda p: sum(r.in_flight for r in p.replicas.values()),
            ),
            (metrics.MIXRL_ROUTER_QUEUE_DEPTH, lambda p: sum(r.waiting for r in p.replicas.values())),
            (
                metrics.MIXRL_ROUTER_TRAFFIC_SHARE,
                lambda p: p.sessions_assigned / assigned_total if assigned_total else 0.0,
            ),
            (metrics.MIXRL_ROUTER_TARGET_SHARE, lambda p: shares.get(p.name, 0.0)),
            (metrics.MIXRL_ROUTER_REPLICAS, lambda p: len(p.replicas)),
            (metrics.MIXRL_ROUTER_REPLICAS_READY, lambda p: len(p.ready_replicas())),
            (metrics.MIXRL_ROUTER_GENERATED_TOKENS_TOTAL, lambda p: p.generated_tokens),
            (metrics.MIXRL_COST_DOLLARS_TOTAL, lambda p: p.cost_dollars),
            (metrics.MIXRL_ROUTER_POOL_HEALTH, lambda p: self.state.health.get(p.name, HEALTHY).health),
        ]
        capacities = self.state.capacities()
        per_replica = capacity_per_replica(capacities)
        series.append((metrics.MIXRL_ROUTER_CAPACITY_PER_REPLICA, lambda p: per_replica[p.name]))
        for spec, value_of in series:
            yield self._family(spec, value_of)
        # Only pools measured (a declared one: with trust): an absent series is "not measured".
        spec = metrics.MIXRL_ROUTER_CAPACITY_MEASURED
        measured = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
        for name, value in reported_measurements(capacities).items():
            pool = self.state.pools[name]
            measured.add_metric([self.run, pool.name, pool.gpu_type, pool.precision], value)
        yield measured
        # Only pools that have answered with a version: 0 would read as "serving version 0".
        spec = metrics.MIXRL_ROUTER_WEIGHT_VERSION
        version = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
        for pool in self.state.pools.values():
            if pool.weight_version is not None:
                labels = [self.run, pool.name, pool.gpu_type, pool.precision]
                version.add_metric(labels, float(pool.weight_version))
        yield version


def make_registry(state: RouterState, run: str) -> tuple[CollectorRegistry, Histogram]:
    """A registry of its own (several routers can live in one test process) and the latency histogram."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(state, run))
    latency = metrics.create(metrics.MIXRL_ROUTER_REQUEST_LATENCY, registry)
    assert isinstance(latency, Histogram)
    return registry, latency
