"""The PromQL the autoscaler and the dashboards send, built in one place (pure: strings only).

Series are matched by ``namespace`` and ``pod`` labels, which both the Prometheus Operator's
PodMonitor and the usual ``kubernetes-pods`` annotation job attach.  A pool's engine pods belong to
its Deployment ``<run>-<pool>``, so they are named ``<run>-<pool>-<replicaset hash>-<pod hash>``;
the anchored regex below matches exactly those (two more dash-free segments), never the pods of a
pool whose name merely starts the same way.

SGLang's metric names contain a colon.  prometheus-client writes ``sglang:num_queue_reqs`` as
``sglang_num_queue_reqs`` when the scraper negotiates OpenMetrics without UTF-8 names (Prometheus
2.x does; 3.x keeps the colon), so every engine query matches both spellings through
``__name__``.  One scrape returns one spelling, so nothing is counted twice.
"""

from __future__ import annotations

import re

from mixrl.api.models import AutoscalingSpec
from mixrl.api.resolve import ResolvedPool, ResolvedRun
from mixrl.rl.metrics import (
    DCGM_FI_DEV_GPU_UTIL,
    MIXRL_BUFFER_BATCHES_TOTAL,
    MIXRL_BUFFER_TRAINER_BUSY_SECONDS,
    MIXRL_BUFFER_TRAINER_WAIT_SECONDS_TOTAL,
    MIXRL_BUFFER_TRAJECTORIES,
    MIXRL_BUFFER_TRAJECTORIES_RECEIVED_TOTAL,
    MIXRL_ROUTER_CAPACITY_PER_REPLICA,
    MIXRL_ROUTER_QUEUE_DEPTH,
    MIXRL_ROUTER_REPLICAS_READY,
    MIXRL_ROUTER_REQUESTS_IN_FLIGHT,
    MIXRL_ROUTER_SESSIONS,
    SGLANG_NUM_PAUSED_REQS,
    SGLANG_NUM_QUEUE_REQS,
    SGLANG_NUM_RUNNING_REQS,
)

QUEUE_METRICS = (SGLANG_NUM_QUEUE_REQS.name, SGLANG_NUM_QUEUE_REQS.name.replace(":", "_"))
RUNNING_METRICS = (SGLANG_NUM_RUNNING_REQS.name, SGLANG_NUM_RUNNING_REQS.name.replace(":", "_"))
SUSTAINED_WINDOW = "1m"
"""The window of the confirming query (``avg_over_time``): see rule 1 of the policy."""
SUSTAINED_STEP = "15s"
"""Its resolution, explicit: a subquery's default step is the global evaluation interval (1m)."""

DCGM_GPU_UTIL = DCGM_FI_DEV_GPU_UTIL.name

_PLACEHOLDER = re.compile(r"\{(pool|namespace|run|object)\}")


def _label_value(value: str) -> str:
    """A PromQL string literal's content (Kubernetes names never need it, user input might)."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def regex_literal(text: str) -> str:
    """``text`` matched literally by an RE2 regex (``-`` needs no escape outside a class)."""
    return re.escape(text).replace("\\-", "-")


def pod_matchers(namespace: str, object_name: str) -> str:
    pattern = f"{regex_literal(object_name)}-[a-z0-9]+-[a-z0-9]+"
    return f'namespace="{_label_value(namespace)}",pod=~"{_label_value(pattern)}"'


def names_regex(names: tuple[str, ...]) -> str:
    return _label_value("|".join(regex_literal(name) for name in names))


def default_load_query(namespace: str, object_name: str) -> str:
    """Queued plus running requests summed over the pool's engine pods, both metric spellings."""
    metrics = names_regex(QUEUE_METRICS + RUNNING_METRICS)
    return f'sum({{__name__=~"{metrics}",{pod_matchers(namespace, object_name)}}})'


def paused_query(namespace: str, object_name: str) -> str:
    """Requests the pool's engines hold paused, both spellings: above 0 while the weight-sync
    sidecar has paused generation in place to load a new version (pause, update, continue), so it
    marks the weight update as the engines live it (the sidecar itself has no Kubernetes access)."""
    paused = SGLANG_NUM_PAUSED_REQS.name
    metrics = names_regex((paused, paused.replace(":", "_")))
    return f'sum({{__name__=~"{metrics}",{pod_matchers(namespace, object_name)}}})'


def substitute(template: str, *, pool: str, namespace: str, run: str, object_name: str) -> str:
    """``{pool}``, ``{namespace}``, ``{run}`` and ``{object}`` in a user's query.

    Only these four names are replaced, so PromQL's own braces (``metric{label="x"}``) stay as
    they are — no ``str.format`` escaping needed in the spec.
    """
    values = {"pool": pool, "namespace": namespace, "run": run, "object": object_name}
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def load_query(autoscaling: AutoscalingSpec, run: ResolvedRun, pool: ResolvedPool) -> str:
    """The pool's load query: the spec's ``query`` with its placeholders filled, or the default."""
    if autoscaling.query:
        return substitute(
            autoscaling.query,
            pool=pool.name,
            namespace=run.namespace,
            run=run.name,
            object_name=pool.object_name,
        )
    return default_load_query(run.namespace, pool.object_name)


def sustained_query(query: str, window: str = SUSTAINED_WINDOW, step: str = SUSTAINED_STEP) -> str:
    """The same load averaged over ``window``: a PromQL subquery, valid for any instant query."""
    return f"avg_over_time(({query})[{window}:{step}])"


def gpu_models_query(namespace: str, object_name: str) -> str:
    """One series per GPU model DCGM sees under the pool's pods (label ``modelName``)."""
    return f"count by (modelName) ({DCGM_GPU_UTIL}{{{pod_matchers(namespace, object_name)}}})"


ROUTER_LOAD_QUERY = (
    f'sum({{__name__=~"{MIXRL_ROUTER_REQUESTS_IN_FLIGHT.name}|{MIXRL_ROUTER_QUEUE_DEPTH.name}",'
    'namespace="{namespace}",run="{run}",pool="{pool}"})'
)
"""A template for ``autoscaling.query``: the router's view of a pool's load (requests forwarded
and not yet answered, plus those it holds for a slot).  Same meaning as the engine default, from
the router's series (names in :mod:`mixrl.rl.metrics`)."""


# ----------------------------------------------------------------------------- objective: trainer

TRAINER_WINDOW = "5m"
"""The window of every rate the trainer objective reads (several steps of a minutes-long step)."""


def run_matchers(namespace: str, run: str, pool: str | None = None) -> str:
    """The label matchers of one run's series (and of one ``pool``'s), without braces."""
    matchers = f'namespace="{_label_value(namespace)}",run="{_label_value(run)}"'
    return matchers if pool is None else f'{matchers},pool="{_label_value(pool)}"'


def trainer_queries(namespace: str, run: str, window: str = TRAINER_WINDOW) -> dict[str, str]:
    """The run-wide series of ``objective: trainer`` (fields of
    :class:`mixrl.operator.autoscaling.fleet_objective.TrainerSignals`), from the buffer and the router."""
    m = run_matchers(namespace, run)
    return {
        "step_rate": f"sum(rate({MIXRL_BUFFER_BATCHES_TOTAL.name}{{{m}}}[{window}]))",
        "idle_share": f"sum(rate({MIXRL_BUFFER_TRAINER_WAIT_SECONDS_TOTAL.name}{{{m}}}[{window}]))",
        "busy_step_s": f"avg(avg_over_time({MIXRL_BUFFER_TRAINER_BUSY_SECONDS.name}{{{m}}}[{window}]))",
        "buffered": f"sum({MIXRL_BUFFER_TRAJECTORIES.name}{{{m}}})",
        "in_flight": f"sum({MIXRL_ROUTER_SESSIONS.name}{{{m}}})",
    }


def pool_throughput_query(namespace: str, run: str, pool: str, window: str = TRAINER_WINDOW) -> str:
    """Trajectories per second the buffer received from one pool (the pool's delivered supply)."""
    m = run_matchers(namespace, run, pool)
    return f"sum(rate({MIXRL_BUFFER_TRAJECTORIES_RECEIVED_TOTAL.name}{{{m}}}[{window}]))"


REPLICA_SECONDS_STEP = "1s"
"""The step of the replica-seconds subquery: one second, so a series younger than the window (a run
that just started, a pool just woken) counts its replica-seconds to within a scrape interval."""


def pool_rate_per_replica_query(namespace: str, run: str, pool: str, window: str = TRAINER_WINDOW) -> str:
    """Trajectories per second one ready replica of a pool delivered: what the buffer received from
    it over the window, divided by the replica-seconds the router saw ready over the same window.

    ``sum(rate(...)) / ready`` is wrong twice: ``rate`` divides by the whole window even when the
    series is younger than it (5 minutes after a start or a wake, a pool 2 minutes old reads at 2/5
    of its speed), and the replicas ready now are not those that delivered over the window (after
    a scale-up the new ones count before they delivered anything).  Both parts here cover the same
    span: the fleet would otherwise see its replicas as slow and fill every pool to its maximum."""
    m = run_matchers(namespace, run, pool)
    received = f"sum(increase({MIXRL_BUFFER_TRAJECTORIES_RECEIVED_TOTAL.name}{{{m}}}[{window}]))"
    ready = f"sum({MIXRL_ROUTER_REPLICAS_READY.name}{{{m}}})"
    seconds = int(REPLICA_SECONDS_STEP.removesuffix("s"))
    return f"{received} / (sum_over_time(({ready})[{window}:{REPLICA_SECONDS_STEP}]) * {seconds})"


def pool_busy_query(
    load: str,
    namespace: str,
    run: str,
    pool: str,
    slots_per_replica: float,
    window: tuple[str, str] = (TRAINER_WINDOW, SUSTAINED_STEP),
) -> str:
    """The share of a pool's slots kept busy, averaged per scrape over the window: its load (the
    pool's load query) over ``slots_per_replica`` × the replicas the router sees ready, at most 1.

    Averaging the clipped share, not the load, matters: a rollout that refills a whole step at once
    overfills the slots and then leaves them idle, which averages to a full load but a half-busy pool."""
    m = run_matchers(namespace, run, pool)
    ready = f"sum({MIXRL_ROUTER_REPLICAS_READY.name}{{{m}}})"
    span, step = window
    return f"avg_over_time(clamp_max(({load}) / ({slots_per_replica:g} * {ready}), 1)[{span}:{step}])"


def pool_capacity_query(namespace: str, run: str, pool: str) -> str:
    """The capacity per replica the router shares sessions by (the declared one, or its trusted
    measurement where that is far off it or the pool is declared null): the autoscaler sizes the
    pool by the same figure."""
    m = run_matchers(namespace, run, pool)
    return f"max({MIXRL_ROUTER_CAPACITY_PER_REPLICA.name}{{{m}}})"
