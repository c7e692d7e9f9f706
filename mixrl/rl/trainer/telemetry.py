"""The trainer's Prometheus series (names from mixrl.rl.metrics), per pool and for the whole run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server

from mixrl.api.resolve import ResolvedRun
from mixrl.rl import metrics as m

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from mixrl.rl.trainer.distributed import Ranks

ALL_POOLS = "all"

# record key -> metric; the same keys exist per pool and for the whole batch
GAUGES = {
    "reward": m.MIXRL_TRAINER_REWARD,
    "kl_k3": m.MIXRL_TRAINER_KL,
    "kl_k3_fresh": m.MIXRL_TRAINER_KL_FRESH,
    "extreme_ratio": m.MIXRL_TRAINER_EXTREME_RATIO_SHARE,
    "entropy": m.MIXRL_TRAINER_ENTROPY,
    "format_error_endings": m.MIXRL_TRAINER_FORMAT_ERROR_ENDINGS,
}


def trainer_telemetry(run: ResolvedRun, port: int, ranks: Ranks) -> TrainerTelemetry | None:
    """The trainer's series, served on ``port`` (0: none) by one process per node (its local rank 0).

    torchrun gives every rank of a node the same ``--metrics-port``, so a second server there would
    fail to bind it.  Only the main rank writes the series; the other nodes' pods still answer
    their scrapes (``mixrl_trainer_finished`` 0, which the status reads as the maximum over pods)."""
    return TrainerTelemetry(run, port=port) if port and ranks.local_rank == 0 else None


class TrainerTelemetry:
    def __init__(
        self, run: ResolvedRun, port: int, host: str = "0.0.0.0", registry: CollectorRegistry | None = None
    ) -> None:
        self.run = run
        self.registry = registry or CollectorRegistry()
        self.pools = {p.name: p for p in run.pools}
        self.gauges = {key: m.gauge(spec, self.registry) for key, spec in GAUGES.items()}
        self.step = m.gauge(m.MIXRL_TRAINER_STEP, self.registry)
        self.version = m.gauge(m.MIXRL_TRAINER_WEIGHT_VERSION, self.registry)
        self.grad_norm = m.gauge(m.MIXRL_TRAINER_GRAD_NORM, self.registry)
        self.staleness = m.gauge(m.MIXRL_TRAINER_STALENESS, self.registry)
        self.tokens = m.counter(m.MIXRL_TRAINER_TOKENS_TOTAL, self.registry)
        self.finished = m.gauge(m.MIXRL_TRAINER_FINISHED, self.registry)
        self.finished.labels(**self._labels(ALL_POOLS)).set(0)
        self._written: set[tuple[str, str]] = set()
        """(record key, pool) of the per-batch gauges the last record set."""
        self.server: WSGIServer | None = None
        if port:
            self.server, _ = start_http_server(port, addr=host, registry=self.registry)

    def _labels(self, pool: str) -> dict[str, str]:
        resolved = self.pools.get(pool)
        return {
            "run": self.run.name,
            "pool": pool,
            "gpu_type": resolved.gpu_type if resolved else "",
            "precision": resolved.weight_precision if resolved else "",
        }

    def mark_finished(self, step: int, version: int) -> None:
        """The last step is taken: the series say so (the operator reads it as the run's end)."""
        everything = self._labels(ALL_POOLS)
        self.step.labels(**everything).set(step)
        self.version.labels(**everything).set(version)
        self.finished.labels(**everything).set(1)

    def observe(self, record: dict[str, Any]) -> None:
        everything = self._labels(ALL_POOLS)
        self.step.labels(**everything).set(record["step"])
        self.version.labels(**everything).set(record["weight_version"])
        self.grad_norm.labels(**everything).set(record["grad_norm"])
        self.staleness.labels(**everything).set(record.get("staleness_mean", 0.0))
        self.tokens.labels(**everything).inc(record["tokens"])
        # The gauges describe the last batch (their help says so): one it has no figure for (no
        # fresh token, a pool without trajectories in it) is removed, not left at an earlier
        # batch's value, which the live status and the dashboard would show as current.
        scopes: dict[str, dict[str, Any]] = {ALL_POOLS: record, **record.get("pools", {})}
        written = {(key, pool) for key in self.gauges for pool, stats in scopes.items() if key in stats}
        for key, pool in written:
            self.gauges[key].labels(**self._labels(pool)).set(scopes[pool][key])
        for key, pool in self._written - written:
            labels = self._labels(pool)
            self.gauges[key].remove(*(labels[name] for name in GAUGES[key].labels))
        self._written = written
