"""Every PromQL expression the chart ships (the dashboard's panels, the collapse alerts) parses, as
Prometheus' own parser (promtool) reads it, and promql_any_spelling puts matchers where PromQL
allows them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from mixrl.operator.builders.monitoring import RUN_POOL, collapse_rule_groups, dashboard
from mixrl.operator.builders.resources import POOL_RELABELINGS
from mixrl.operator.controller import live_status
from mixrl.rl.metrics import (
    ENGINE_METRICS,
    MIXRL_COST_DOLLARS_TOTAL,
    MIXRL_ROUTER_GENERATED_TOKENS_TOTAL,
    MIXRL_TRAINER_STEP,
    SGLANG_NUM_QUEUE_REQS,
    promql_any_spelling,
)

from ..metrics.test_queries_match_exporters import selectors, series, tokens

# promtool comes in Debian's prometheus package with the server (scripts/setup.sh): without it
# these tests fail (tests/conftest.py), never skip.
PROMTOOL = shutil.which("promtool") or "promtool"


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title and refId, expression) of every target of the dashboard."""
    return [
        (f"{panel['title']} {target['refId']}", target["expr"])
        for panel in dashboard()["panels"]
        for target in panel["targets"]
    ]


def check_rules(tmp_path: Path, exprs: list[str]) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` on one recording rule per expression: promtool parses each."""
    rules = [{"record": f"mixrl:check:expr{i}", "expr": expr} for i, expr in enumerate(exprs)]
    path = tmp_path / "exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "exprs", "rules": rules}]}, sort_keys=False))
    return subprocess.run(
        [PROMTOOL, "check", "rules", path.name], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


@pytest.mark.needs_prometheus
def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    exprs = dashboard_exprs()
    checked = check_rules(tmp_path, [expr for _, expr in exprs])
    assert checked.returncode == 0, "\n".join(f"{where}: {expr}" for where, expr in exprs) + (
        "\n" + checked.stdout + checked.stderr
    )
    assert f"SUCCESS: {len(exprs)} rules found" in checked.stdout


@pytest.mark.needs_prometheus
def test_every_alert_expression_parses(tmp_path: Path) -> None:
    exprs = [rule["expr"] for group in collapse_rule_groups() for rule in group["rules"]]
    checked = check_rules(tmp_path, exprs)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in checked.stdout


@pytest.mark.needs_prometheus
def test_the_parse_check_has_teeth(tmp_path: Path) -> None:
    """Matchers after a parenthesized ``or`` (what the engine panels once were) are refused."""
    checked = check_rules(
        tmp_path, ['sum by (pool) ((sglang:num_queue_reqs or sglang_num_queue_reqs){run="a"})']
    )
    assert checked.returncode != 0
    assert 'unexpected "{"' in checked.stdout + checked.stderr


def test_any_spelling_puts_the_matchers_on_each_alternative() -> None:
    name = SGLANG_NUM_QUEUE_REQS.name
    assert promql_any_spelling(name) == "(sglang:num_queue_reqs or sglang_num_queue_reqs)"
    assert promql_any_spelling(name, 'run="a",pool="b"') == (
        '(sglang:num_queue_reqs{run="a",pool="b"} or sglang_num_queue_reqs{run="a",pool="b"})'
    )
    assert promql_any_spelling("mixrl_trainer_step", 'run="a"') == 'mixrl_trainer_step{run="a"}'
    assert promql_any_spelling("mixrl_trainer_step") == "mixrl_trainer_step"


def test_the_engine_panels_select_the_run_in_both_spellings() -> None:
    engine = [expr for _, expr in dashboard_exprs() if "sglang" in expr]
    assert len(engine) == 2  # load (queued + running) and generation throughput
    for expr in engine:
        assert "){" not in expr, expr
        selected = re.findall(r"(sglang[:_])\w+(\{[^}]*\})?", expr)
        assert {spelling for spelling, _ in selected} == {"sglang:", "sglang_"}, expr
        assert all(matchers == '{run="$run"}' for _, matchers in selected), expr


def panel_input_series() -> list[dict[str, str]]:
    """One series (a point a minute, rising) of every catalogued series the dashboard reads, for the
    run ``r``: per-pool ones for pool ``a`` and for the trainer's whole batch (``all``), with the
    labels its exporter and the scrape give it (the engines' run and pool from the pod's labels)."""
    out: dict[str, dict[str, str]] = {}
    for _, expr in dashboard_exprs():
        for selector in selectors(tokens(expr)):
            for name in selector.names:
                found = series(name)
                assert found is not None, name
                spec = found.spec
                labels = {label: "x" for label in spec.labels} | {"namespace": "ns", "pod": "p"}
                if spec in ENGINE_METRICS:
                    labels |= {target: "x" for _, target in POOL_RELABELINGS}
                if "run" in labels:
                    labels["run"] = "r"
                pools = ("a", RUN_POOL) if "pool" in labels else (None,)
                bounds = ("1.0", "+Inf") if found.suffix == "_bucket" else (None,)
                for pool, le in ((pool, le) for pool in pools for le in bounds):
                    these = labels | ({"pool": pool} if pool else {}) | ({"le": le} if le else {})
                    text = ",".join(f'{key}="{value}"' for key, value in sorted(these.items()))
                    series_text = f"{name}{{{text}}}"
                    out[series_text] = {"series": series_text, "values": "0+1x120"}
    return list(out.values())


def empty_panel_checks(
    tmp_path: Path,
    exprs: list[str],
    empty: list[bool],
    input_series: list[dict[str, str]] | None = None,
    at: str = "90m",
) -> subprocess.CompletedProcess[str]:
    """promtool's rule test: an alert ``absent(expr)`` per expression, which fires (``at``, into the
    series: ``input_series``, by default :func:`panel_input_series`) exactly where ``empty`` says
    the expression answers nothing.  Evaluated every 30 s over points a minute apart: reads
    between two scrapes, as a live Prometheus makes them."""
    rules = [{"alert": f"Empty{i}", "expr": f"absent({expr})"} for i, expr in enumerate(exprs)]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    checks = [
        {"eval_time": at, "alertname": f"Empty{i}", "exp_alerts": [{"exp_labels": {}}] if is_empty else []}
        for i, is_empty in enumerate(empty)
    ]
    inputs = panel_input_series() if input_series is None else input_series
    test = {"interval": "1m", "input_series": inputs, "alert_rule_test": checks}
    (tmp_path / "test.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "30s", "tests": [test]})
    )
    return subprocess.run(
        [PROMTOOL, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


@pytest.mark.needs_prometheus
def test_every_panel_shows_data_when_every_component_exports(tmp_path: Path) -> None:
    """A panel whose two sides never match (a sum with no labels divided by a series with run, pool
    and pod: what the sampler-cost-per-update panel once was) parses and stays empty for good.
    Evaluated by Prometheus' own engine on series shaped as the exporters write them; the last
    expression, that broken panel, shows the check has teeth."""
    exprs = [expr.replace("$run", "r") for _, expr in dashboard_exprs()]
    never_matches = (
        f'sum(increase({MIXRL_COST_DOLLARS_TOTAL.name}{{run="r"}}[1h])) / '
        f'clamp_min(delta({MIXRL_TRAINER_STEP.name}{{run="r",pool="{RUN_POOL}"}}[1h]), 1)'
    )
    checked = empty_panel_checks(tmp_path, [*exprs, never_matches], [False] * len(exprs) + [True])
    assert checked.returncode == 0, "\n".join(f"Empty{i}: {e}" for i, e in enumerate(exprs)) + (
        "\n" + checked.stdout + checked.stderr
    )


@pytest.mark.needs_prometheus
def test_the_live_token_rate_has_data_at_prometheus_default_scrape(tmp_path: Path) -> None:
    """A point a minute, Prometheus's default scrape (annotations mode), read half a minute after a
    scrape: rate() needs two points in its window, and one minute holds one (``tokensPerSecond``
    came and went with the status's timing)."""
    query = live_status.run_queries("ns", "r")["tokens_per_second"]
    assert f"[{live_status.RATE_WINDOW}]" in query
    one_minute = query.replace(f"[{live_status.RATE_WINDOW}]", "[1m]")
    generated = f'{MIXRL_ROUTER_GENERATED_TOKENS_TOTAL.name}{{namespace="ns",run="r",pool="a",pod="p"}}'
    checked = empty_panel_checks(
        tmp_path,
        [query, one_minute],
        [False, True],
        [{"series": generated, "values": "0+100x120"}],
        at="90m30s",
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
