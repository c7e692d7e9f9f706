"""Every metric name and label the operator queries (the dashboard, the collapse alerts, the live
status, the autoscaler's PromQL) is one the catalogue (mixrl/rl/metrics.py) declares and the
components export: the right name with its kind's suffix (``_total`` for a counter, ``_bucket``,
``_sum``, ``_count`` for a histogram), each label matched or grouped on carried by the series, and
``rate``/``increase`` only over counters, ``delta``/``deriv`` only over gauges.

A misspelt name or a label the series lacks is not a PromQL error: the query just answers nothing,
and the panel or alert stays empty for good.  So it is checked here, without a Prometheus, by
reading the expressions (mixrl writes them all in one small dialect) and the exporters' output.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.operator.autoscaling import promql
from mixrl.operator.builders.monitoring import collapse_rule_groups, dashboard
from mixrl.operator.builders.resources import POOL_RELABELINGS
from mixrl.operator.controller import live_status
from mixrl.rl import metrics as m
from mixrl.rl.buffer.server import BufferCollector
from mixrl.rl.buffer.store import TrajectoryBuffer
from mixrl.rl.engine.stats import EngineStats, FinishedRequest
from mixrl.rl.metrics import MetricSpec
from mixrl.rl.router.config import PoolConfig
from mixrl.rl.router.exporter import make_registry
from mixrl.rl.router.state import RouterState
from mixrl.rl.trainer.telemetry import TrainerTelemetry

from ..api.conftest import ROOT
from ..buffer.conftest import group_of

CATALOGUE: tuple[MetricSpec, ...] = (*m.ENGINE_METRICS, *m.MIXRL_METRICS, m.DCGM_FI_DEV_GPU_UTIL)

TARGET_LABELS = frozenset({"namespace", "pod", "container", "endpoint", "instance", "job"})
"""What Prometheus adds to every series of a scraped pod (PodMonitor or the kubernetes-pods job)."""
RELABELED = frozenset(target for _, target in POOL_RELABELINGS)
"""The pod's labels as series labels, where a series has none of its own (honorLabels): only the
engines' (SGLang's names) lack them; a mixrl series that lacks ``pool`` has none (its pod has no
pool label)."""

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
COUNTER_ONLY = frozenset({"rate", "irate", "increase", "resets"})
GAUGE_ONLY = frozenset({"delta", "idelta", "deriv", "predict_linear"})
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", *GROUPING})


# ----------------------------------------------------------------------------- the expressions


def expressions() -> Iterator[tuple[str, str]]:
    """(where, expression) of every PromQL expression the operator builds or ships."""
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            yield f"dashboard {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard()["templating"]["list"]:
        query = variable.get("query", "")
        if query.startswith("label_values("):  # label_values(metric, label): a series and a label
            metric, label = query.removeprefix("label_values(").removesuffix(")").split(", ")
            yield f"dashboard variable {variable['name']}", f"count by ({label}) ({metric})"
    for group in collapse_rule_groups():
        for rule in group["rules"]:
            yield f"alert {rule['alert']}", rule["expr"]
    for name, query in live_status.run_queries("ns", "r").items():
        yield f"live status {name}", query
    yield "live status history", live_status.history_query("ns", "r")
    load = promql.default_load_query("ns", "r-a")
    yield "autoscaler default load", load
    yield "autoscaler paused", promql.paused_query("ns", "r-a")
    yield "autoscaler gpu models", promql.gpu_models_query("ns", "r-a")
    router_load = promql.substitute(
        promql.ROUTER_LOAD_QUERY, pool="a", namespace="ns", run="r", object_name="r-a"
    )
    yield "autoscaler router load template", router_load
    for name, query in promql.trainer_queries("ns", "r").items():
        yield f"trainer objective {name}", query
    yield "pool throughput", promql.pool_throughput_query("ns", "r", "a")
    yield "pool rate per replica", promql.pool_rate_per_replica_query("ns", "r", "a")
    yield "pool busy", promql.pool_busy_query(load, "ns", "r", "a", 4)
    yield "pool capacity", promql.pool_capacity_query("ns", "r", "a")


TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>"(?:[^"\\]|\\.)*")
    | (?P<braces>\{[^{}]*\})
    | (?P<range>\[[^\]]*\])
    | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<punct>[()+\-*/%^,]|[<>=!]=?)
    )""",
    re.VERBOSE,
)
MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')


def tokens(expr: str) -> list[tuple[str, str]]:
    out, position = [], 0
    expr = expr.rstrip()
    while position < len(expr):
        match = TOKEN.match(expr, position)
        assert match and match.end() > position, f"cannot read {expr[position:]!r} in {expr!r}"
        kind = match.lastgroup
        assert kind is not None
        out.append((kind, match[kind]))
        position = match.end()
    return out


def matchers(braces: str) -> list[tuple[str, str, str]]:
    body, out = braces[1:-1], []
    while body.strip():
        match = MATCHER.match(body)
        assert match, f"cannot read the matchers {braces!r}"
        out.append((match[1], match[2], match[3].replace("\\\\", "\\")))
        body = body[match.end() :]
    return out


@dataclass(frozen=True)
class Selector:
    names: tuple[str, ...]
    """The metric names it selects (several through ``__name__=~"a|b"``)."""
    labels: tuple[str, ...]
    """The labels it matches on."""
    start: int
    """Its token index."""


def selectors(toks: list[tuple[str, str]]) -> list[Selector]:
    out = []
    for i, (kind, text) in enumerate(toks):
        following = toks[i + 1] if i + 1 < len(toks) else ("", "")
        previous = toks[i - 1] if i else ("", "")
        aggregation = following[1] in GROUPING  # sum by (...) (...)
        if kind == "ident" and following[1] != "(" and text not in KEYWORDS and not aggregation:
            if previous[0] == "punct" and previous[1] in ("(", ",") and _in_grouping(toks, i):
                continue
            found = matchers(following[1]) if following[0] == "braces" else []
            out.append(Selector((text,), tuple(label for label, _, _ in found), i))
        elif kind == "braces" and previous[0] != "ident":
            found = matchers(text)
            names = [value for label, _, value in found if label == "__name__"]
            assert len(names) == 1, f"a selector without a name: {text}"
            alternatives = tuple(re.sub(r"\\(.)", r"\1", name) for name in names[0].split("|"))
            labels = tuple(label for label, _, _ in found if label != "__name__")
            out.append(Selector(alternatives, labels, i))
    return out


def _in_grouping(toks: list[tuple[str, str]], index: int) -> bool:
    """Whether the identifier at ``index`` is a label inside ``by (...)`` (or on, without ...)."""
    i = index
    while i >= 0 and toks[i][1] != "(":
        i -= 1
    return i > 0 and toks[i - 1][1] in GROUPING


def closing(toks: list[tuple[str, str]], opening: int) -> int:
    depth = 0
    for i in range(opening, len(toks)):
        depth += {"(": 1, ")": -1}.get(toks[i][1], 0)
        if depth == 0:
            return i
    raise AssertionError("unbalanced parentheses")


def groupings(toks: list[tuple[str, str]]) -> Iterator[tuple[tuple[str, ...], range]]:
    """(labels, the token span of the expression they group) of each prefix ``agg by (...) (...)``."""
    for i, (_, text) in enumerate(toks):
        if text in ("by", "without") and toks[i + 1][1] == "(":
            end = closing(toks, i + 1)
            labels = tuple(t for kind, t in toks[i + 2 : end] if kind == "ident")
            assert toks[end + 1][1] == "(", "mixrl writes `agg by (labels) (expr)`"
            yield labels, range(end + 1, closing(toks, end + 1) + 1)


def functions(toks: list[tuple[str, str]]) -> Iterator[tuple[str, range]]:
    """(name, the token span of its arguments) of each function call."""
    for i, (kind, text) in enumerate(toks):
        if kind == "ident" and i + 1 < len(toks) and toks[i + 1][1] == "(" and text not in KEYWORDS:
            yield text, range(i + 1, closing(toks, i + 1) + 1)


# ----------------------------------------------------------------------------- the catalogue


@dataclass(frozen=True)
class Series:
    spec: MetricSpec
    suffix: str
    """"" for a gauge or counter, else the histogram series' suffix."""

    @property
    def labels(self) -> frozenset[str]:
        """The labels the series carries once scraped."""
        own = set(self.spec.labels) | {"le"} if self.suffix == "_bucket" else set(self.spec.labels)
        if self.spec is m.DCGM_FI_DEV_GPU_UTIL:  # scraped by its own job, labelled by the exporter
            return frozenset(own | {"instance", "job"})
        if self.spec in m.ENGINE_METRICS:
            own |= RELABELED
        return frozenset(own | TARGET_LABELS)


def series(name: str) -> Series | None:
    """The catalogue's series of ``name`` as a query spells it (a colon may be an underscore)."""
    for spec in CATALOGUE:
        for spelling in {spec.name, spec.name.replace(":", "_")}:
            if spec.kind != "histogram" and name == spelling:
                return Series(spec, "")
            if spec.kind == "histogram" and name.startswith(spelling):
                suffix = name.removeprefix(spelling)
                if suffix in HISTOGRAM_SUFFIXES:
                    return Series(spec, suffix)
    return None


def problems(expr: str) -> list[str]:
    toks = tokens(expr)
    found = selectors(toks)
    out = []
    resolved: dict[int, list[Series]] = {}
    for selector in found:
        for name in selector.names:
            s = series(name)
            if s is None:
                out.append(f"{name}: no such series in mixrl/rl/metrics.py (kind suffix?)")
                continue
            resolved.setdefault(selector.start, []).append(s)
            missing = set(selector.labels) - s.labels
            if missing:
                out.append(f"{name} is matched on {sorted(missing)}, which it does not carry")
    for labels, span in groupings(toks):
        for selector in found:
            if selector.start not in span:
                continue
            for s in resolved.get(selector.start, []):
                missing = set(labels) - s.labels
                if missing:
                    out.append(
                        f"{s.spec.name}{s.suffix} is grouped by {sorted(missing)}, which it does not carry"
                    )
    for function, span in functions(toks):
        for selector in found:
            if selector.start not in span:
                continue
            for s in resolved.get(selector.start, []):
                kind = "counter" if s.suffix else s.spec.kind
                if function in COUNTER_ONLY and kind != "counter":
                    out.append(f"{function}() over {s.spec.name}{s.suffix}, a {s.spec.kind}")
                if function in GAUGE_ONLY and kind != "gauge":
                    out.append(f"{function}() over {s.spec.name}{s.suffix}, a {s.spec.kind}")
    return out


EXPRESSIONS = list(expressions())


@pytest.mark.parametrize(("where", "expr"), EXPRESSIONS, ids=[where for where, _ in EXPRESSIONS])
def test_every_query_names_catalogued_series_with_their_labels_and_kind(where: str, expr: str) -> None:
    assert not problems(expr), f"{where}: {expr}\n" + "\n".join(problems(expr))


def test_the_check_has_teeth() -> None:
    """The mistakes it exists for are caught: a wrong suffix, a missing one, a label the series
    lacks (in a matcher and in a grouping), and rate over a gauge."""
    assert problems("sum(rate(mixrl_router_generated_tokens[1m]))")  # a counter without _total
    assert problems("rate(mixrl_buffer_staleness[5m])")  # a histogram without its suffix
    assert problems('mixrl_buffer_groups_ready{pool="a"}')  # a whole-buffer series has no pool
    assert problems('mixrl_trainer_step{pool_name="all"}')
    assert problems('sum by (pool) (mixrl_buffer_batches_total{run="r"})')
    assert problems('sum(rate(mixrl_trainer_step{run="r"}[5m]))')  # a gauge
    assert problems('delta(mixrl_cost_dollars_total{run="r"}[1h])')  # a counter
    assert problems('sum({__name__=~"mixrl_router_queue_depth|mixrl_router_queue",run="r"})')
    assert not problems('sum by (pool) ((sglang:num_queue_reqs{run="r"} or sglang_num_queue_reqs{run="r"}))')
    assert not problems(
        'histogram_quantile(0.5, sum by (le) (rate(mixrl_buffer_staleness_bucket{run="r"}[5m])))'
    )


def test_every_spec_of_the_module_is_in_a_catalogue_tuple() -> None:
    """A spec left out of ENGINE_METRICS / MIXRL_METRICS escapes every check that iterates them."""
    declared = {value for value in vars(m).values() if isinstance(value, MetricSpec)}
    assert declared == set(CATALOGUE)
    assert len({spec.name for spec in CATALOGUE}) == len(CATALOGUE)
    for spec in CATALOGUE:
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        assert (spec.buckets is not None) == (spec.kind == "histogram"), spec.name


# ----------------------------------------------------------------------------- the exporters


def exposition(registry: CollectorRegistry) -> dict[str, set[frozenset[str]]]:
    """Sample name -> the label-name sets of its samples, as a scraper reads them."""
    out: dict[str, set[frozenset[str]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).add(frozenset(sample.labels))
    return out


def exported(tmp_path: Path) -> dict[str, set[frozenset[str]]]:
    """What the router, the buffer, the trainer and an engine expose, each with some traffic."""
    out: dict[str, set[frozenset[str]]] = {}

    def add(registry: CollectorRegistry) -> None:
        for name, labels in exposition(registry).items():
            out.setdefault(name, set()).update(labels)

    state = RouterState(
        [PoolConfig(name="a", gpu_type="h100", precision="fp8", capacity=1.0, replicas=("http://a0:1",))]
    )
    state.set_ready("a", "http://a0:1", True)
    for _ in range(12):  # trusted: its measured capacity is exported
        state.record_throughput("a", "http://a0:1", 100.0, queued=True)
    state.pools["a"].weight_version = 3
    router, latency = make_registry(state, "r")
    latency.labels("r", "a", "h100", "fp8").observe(1.0)
    add(router)

    with TrajectoryBuffer(tmp_path / "buffer", prompts_per_update=1, samples_per_prompt=2) as buffer:
        buffer.append(group_of("p", 2, versions=(0, 1)))
        buffer.batch(1)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(BufferCollector(buffer, "r"))
        # The trainer's wait and busy time are created from their specs by the buffer's server.
        m.counter(m.MIXRL_BUFFER_TRAINER_WAIT_SECONDS_TOTAL, registry).labels("r").inc(1)
        m.gauge(m.MIXRL_BUFFER_TRAINER_BUSY_SECONDS, registry).labels("r").set(1)
        add(registry)

    run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    trainer = TrainerTelemetry(run, port=0, registry=CollectorRegistry())
    pool = run.pools[0].name
    stats = {"reward": 0.5, "kl_k3": 0.01, "kl_k3_fresh": 0.01, "extreme_ratio": 0.0, "entropy": 1.0}
    trainer.observe(
        {
            "step": 1,
            "weight_version": 1,
            "grad_norm": 1.0,
            "tokens": 10,
            "format_error_endings": 0.0,
            **stats,
            "pools": {pool: {**stats, "format_error_endings": 0.0}},
        }
    )
    add(trainer.registry)

    engine = EngineStats("model", max_total_tokens=100)
    engine.request_finished(FinishedRequest(False, 0.0, 0.1, 0.2, 3, 2, 1, False))
    add(engine.registry)
    return out


QUERIED = sorted(
    {
        (s.spec.name, s.suffix)
        for _, expr in EXPRESSIONS
        for selector in selectors(tokens(expr))
        for name in selector.names
        if (s := series(name)) is not None and s.spec is not m.DCGM_FI_DEV_GPU_UTIL
    }
)


def test_every_queried_series_is_exported_with_the_catalogues_labels(tmp_path: Path) -> None:
    """The other half: a query can only find a series some component writes, with the labels the
    catalogue names (a colon is kept: what Prometheus 3 stores; the underscore spelling is the
    same series written by an older scraper)."""
    out = exported(tmp_path)
    for name, suffix in QUERIED:
        spec = next(spec for spec in CATALOGUE if spec.name == name)
        sample = f"{name}{suffix}"
        assert sample in out, f"{sample} is queried but no component exports it"
        expected = set(spec.labels) | ({"le"} if suffix == "_bucket" else set())
        assert out[sample] == {frozenset(expected)}, (
            f"{sample}: exported with {out[sample]}, catalogued {expected}"
        )
