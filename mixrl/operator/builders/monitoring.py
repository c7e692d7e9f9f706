"""Alert rules for the three signs of collapse (docs/architecture.md#metrics) and the Grafana dashboard (pure).

The Helm chart ships both (``python -m mixrl.operator.install.chart`` writes them into charts/mixrl/files),
built from the metric names in :mod:`mixrl.rl.metrics`, so a renamed series cannot leave a stale
alert behind.

The three signs, as the paper saw them before a run collapsed, judged on the series ``mixrl run``
judges (mixrl.rl.health.collapse): the trainer exports each figure for the whole batch
(``pool="all"``) and per pool.
- reward falls: the run's 15-minute mean reward (``pool="all"`` only, not averaged with the pools'
  own rewards) drops ``rewardDrop`` (30 %) or more below its best 15-minute mean of the last 6 hours;
- KL grows: a pool's sampler–trainer KL (k3), or the run's (``pool="all"``, the whole batch), reaches
  ``klGrowth`` (3×) its early level — PromQL has no "first value", so the early level is the lowest
  15-minute mean of the last 12 hours, which for a degrading run is its early level;
- format errors: more than ``formatErrorShare`` (50 %) of episodes end on repeated replies without
  a tool call.

The thresholds are the defaults of ``spec.health.collapse`` (:class:`mixrl.api.models.CollapseSpec`),
the same numbers ``mixrl run`` judges a run by (mixrl.rl.health.collapse): defined once, there.  The
chart's rules are one set for every run, so a run's own ``spec.health`` does not change them.
"""

from __future__ import annotations

from mixrl.api.kube_types import Obj
from mixrl.api.models import CollapseSpec
from mixrl.rl.metrics import (
    MIXRL_BUFFER_STALENESS,
    MIXRL_COST_DOLLARS_TOTAL,
    MIXRL_ROUTER_POOL_HEALTH,
    MIXRL_ROUTER_QUEUE_DEPTH,
    MIXRL_ROUTER_REPLICAS_READY,
    MIXRL_ROUTER_TRAFFIC_SHARE,
    MIXRL_ROUTER_WEIGHT_VERSION,
    MIXRL_TRAINER_EXTREME_RATIO_SHARE,
    MIXRL_TRAINER_FORMAT_ERROR_ENDINGS,
    MIXRL_TRAINER_GRAD_NORM,
    MIXRL_TRAINER_KL,
    MIXRL_TRAINER_KL_FRESH,
    MIXRL_TRAINER_REWARD,
    MIXRL_TRAINER_STEP,
    MIXRL_TRAINER_WEIGHT_VERSION,
    SGLANG_GEN_THROUGHPUT,
    SGLANG_NUM_QUEUE_REQS,
    SGLANG_NUM_RUNNING_REQS,
    promql_any_spelling,
)

DEFAULT_THRESHOLDS = CollapseSpec()
"""The defaults of ``spec.health.collapse``: the chart's rules."""

REWARD = MIXRL_TRAINER_REWARD.name
KL = MIXRL_TRAINER_KL.name
RUN_POOL = "all"
"""The ``pool`` label of the trainer's whole-batch series (mixrl.rl.trainer.telemetry.ALL_POOLS)."""
RUN_REWARD = f'{REWARD}{{pool="{RUN_POOL}"}}'
"""The run's reward, the one ``mixrl run`` judges: not the per-pool series beside it."""
RUN_FORMAT_ERRORS = f'{MIXRL_TRAINER_FORMAT_ERROR_ENDINGS.name}{{pool="{RUN_POOL}"}}'
"""The share of the trained batch's episodes that ended on format errors, the one ``mixrl run``
judges: training episodes the trainer took, not every episode a rollout worker ended (held-out
ones, groups dropped or too stale)."""


RUN_KEY = "namespace, run"
"""What names one run in an alert: two runs of one name in two namespaces are two runs."""


def reward_falling_expr(t: CollapseSpec) -> str:
    recent = f"avg by ({RUN_KEY}) (avg_over_time({RUN_REWARD}[15m]))"
    best = f"max_over_time(avg by ({RUN_KEY}) (avg_over_time({RUN_REWARD}[15m]))[6h:5m])"
    return f"{recent} < ({1 - t.reward_drop:g} * {best}) and {best} > 0"


def kl_growing_expr(t: CollapseSpec) -> str:
    # Every pool's series and the run's (pool="all"), each judged on its own, as `mixrl run` does.
    # kl_floor: below it the ratio is noise (a run that starts at 1e-6 may triple meaning nothing).
    recent = f"max by ({RUN_KEY}, pool) (avg_over_time({KL}[15m]))"
    early = f"min_over_time(max by ({RUN_KEY}, pool) (avg_over_time({KL}[15m]))[12h:5m])"
    return f"{recent} >= ({t.kl_growth:g} * {early}) and {recent} > {t.kl_floor:g}"


def format_error_expr(t: CollapseSpec) -> str:
    return f"avg by ({RUN_KEY}) (avg_over_time({RUN_FORMAT_ERRORS}[15m])) > {t.format_error_share:g}"


KL_SCOPE = (
    f'{{{{ if eq $labels.pool "{RUN_POOL}" }}}}the run (all pools){{{{ else }}}}pool {{{{ $labels.pool }}}}'
    "{{ end }}"
)
"""What a KL alert is about, in its summary (a Prometheus template): a pool, or the run."""


def alert(name: str, expr: str, duration: str, summary: str, description: str) -> Obj:
    return {
        "alert": name,
        "expr": expr,
        "for": duration,
        "labels": {"severity": "warning", "signal": "collapse"},
        "annotations": {"summary": summary, "description": description},
    }


def collapse_rule_groups(t: CollapseSpec = DEFAULT_THRESHOLDS) -> list[Obj]:
    """``spec.groups`` of the chart's PrometheusRule, for the thresholds ``t`` (the chart: defaults)."""
    return [
        {
            "name": "mixrl-collapse",
            "rules": [
                alert(
                    "MixrlRewardFalling",
                    reward_falling_expr(t),
                    "15m",
                    f"Run {{{{ $labels.namespace }}}}/{{{{ $labels.run }}}}: reward fell {t.reward_drop:.0%} below its best",
                    f"The run's 15-minute mean training reward is more than {t.reward_drop:.0%} below its best "
                    "15-minute mean of the last 6 hours. With a rising KL this is how mismatch-driven "
                    "collapse begins.",
                ),
                alert(
                    "MixrlKLGrowing",
                    kl_growing_expr(t),
                    "15m",
                    f"Run {{{{ $labels.namespace }}}}/{{{{ $labels.run }}}}: sampler-trainer KL of {KL_SCOPE} grew {t.kl_growth:g}x",
                    f'The KL (k3) of a pool, or of the run\'s whole batch (pool "{RUN_POOL}"), is at least '
                    f"{t.kl_growth:g}x its early level (lowest 15-minute mean of the last 12 hours). Check "
                    "the pools' precision and kernels; consider MIS or a narrower range.",
                ),
                alert(
                    "MixrlFormatErrorEpisodes",
                    format_error_expr(t),
                    "10m",
                    f"Run {{{{ $labels.namespace }}}}/{{{{ $labels.run }}}}: over {t.format_error_share:.0%} of episodes end on "
                    "repeated format errors",
                    f"Over the last 15 minutes, more than {t.format_error_share:.0%} of the episodes in the "
                    "trainer's batches (on average) ended after consecutive replies without a tool call: "
                    "the policy is losing its output format.",
                ),
            ],
        }
    ]


# ----------------------------------------------------------------------------- dashboard


def panel(title: str, exprs: list[tuple[str, str]], x: int, y: int, unit: str = "short") -> Obj:
    return {
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(exprs)
        ],
    }


def dashboard() -> Obj:
    """A Grafana dashboard for one run (variable ``run``): learning, mismatch per pool, serving."""
    run = 'run="$run"'
    sel = f"{{{run}}}"
    whole_batch = f'{{{run},pool="{RUN_POOL}"}}'  # the trainer's series for the run, not a pool's
    # Engine series carry run and pool from the pod labels (the PodMonitor's relabelings); each
    # spelling of a colon name gets the matchers (promql_any_spelling).
    queue = promql_any_spelling(SGLANG_NUM_QUEUE_REQS.name, run)
    running = promql_any_spelling(SGLANG_NUM_RUNNING_REQS.name, run)
    throughput = promql_any_spelling(SGLANG_GEN_THROUGHPUT.name, run)
    panels = [
        panel("Reward", [(f"avg by (run) ({REWARD}{whole_batch})", "reward")], 0, 0),
        panel("Trainer step", [(f"max by (run) ({MIXRL_TRAINER_STEP.name}{sel})", "step")], 12, 0),
        panel("Sampler-trainer KL (k3) per pool", [(f"max by (pool) ({KL}{sel})", "{{pool}}")], 0, 8),
        panel(
            "Extreme-ratio share per pool",
            [(f"max by (pool) ({MIXRL_TRAINER_EXTREME_RATIO_SHARE.name}{sel})", "{{pool}}")],
            12,
            8,
            "percentunit",
        ),
        panel(
            "Trained episodes ending on format errors (per pool; all: the batch)",
            [(f"max by (pool) ({MIXRL_TRAINER_FORMAT_ERROR_ENDINGS.name}{sel})", "{{pool}}")],
            0,
            16,
            "percentunit",
        ),
        panel("Gradient norm", [(f"max({MIXRL_TRAINER_GRAD_NORM.name}{sel})", "grad norm")], 12, 16),
        panel(
            "Ready replicas per pool",
            [(f"sum by (pool) ({MIXRL_ROUTER_REPLICAS_READY.name}{sel})", "{{pool}}")],
            0,
            24,
        ),
        panel(
            "Traffic share per pool",
            [(f"sum by (pool) ({MIXRL_ROUTER_TRAFFIC_SHARE.name}{sel})", "{{pool}}")],
            12,
            24,
            "percentunit",
        ),
        panel(
            "Engine load per pool (queued + running)",
            [(f"sum by (pool) ({queue}) + sum by (pool) ({running})", "{{pool}}")],
            0,
            32,
        ),
        panel(
            "Router queue depth per pool",
            [(f"sum by (pool) ({MIXRL_ROUTER_QUEUE_DEPTH.name}{sel})", "{{pool}}")],
            12,
            32,
        ),
        panel(
            "Generation throughput per pool",
            [(f"sum by (pool) ({throughput})", "{{pool}}")],
            0,
            40,
            "tok/s",
        ),
        panel(
            "Staleness of trained tokens (p50, p95)",
            [
                (
                    f"histogram_quantile(0.5, sum by (le) (rate({MIXRL_BUFFER_STALENESS.name}_bucket{sel}[10m])))",
                    "p50",
                ),
                (
                    f"histogram_quantile(0.95, sum by (le) (rate({MIXRL_BUFFER_STALENESS.name}_bucket{sel}[10m])))",
                    "p95",
                ),
            ],
            12,
            40,
        ),
        panel(
            "GPU cost per hour by pool",
            [(f"sum by (pool) (rate({MIXRL_COST_DOLLARS_TOTAL.name}{sel}[1h])) * 3600", "{{pool}}")],
            0,
            48,
            "currencyUSD",
        ),
        panel(
            "Sampler cost per trainer update (last hour)",
            [
                (
                    # Both sides aggregated to no labels: ``sum(...) / delta(step)`` matches the sum's
                    # empty label set with the step's run, pool, pod ... one to one and is always empty.
                    f"sum(increase({MIXRL_COST_DOLLARS_TOTAL.name}{sel}[1h])) / "
                    f"clamp_min(max(delta({MIXRL_TRAINER_STEP.name}{whole_batch}[1h])), 1)",
                    "samplers",
                )
            ],
            0,
            64,
            "currencyUSD",
        ),
        panel(
            "Weight version: published and served per pool",
            [
                (f"max({MIXRL_TRAINER_WEIGHT_VERSION.name}{sel})", "published"),
                (f"max by (pool) ({MIXRL_ROUTER_WEIGHT_VERSION.name}{sel})", "{{pool}}"),
            ],
            12,
            48,
        ),
        panel(
            "Fresh (staleness-0) KL (k3) per pool",
            [(f"max by (pool) ({MIXRL_TRAINER_KL_FRESH.name}{sel})", "{{pool}}")],
            0,
            56,
        ),
        panel(
            "Pool health (mismatch-aware routing)",
            [(f"max by (pool) ({MIXRL_ROUTER_POOL_HEALTH.name}{sel})", "{{pool}}")],
            12,
            56,
        ),
    ]
    for index, item in enumerate(panels, start=1):
        item["id"] = index
    return {
        "title": "mixrl run",
        "uid": "mixrl-run",
        "tags": ["mixrl"],
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                {
                    "name": "run",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": f"label_values({MIXRL_TRAINER_STEP.name}, run)",
                    "refresh": 2,
                },
            ]
        },
        "panels": panels,
    }
