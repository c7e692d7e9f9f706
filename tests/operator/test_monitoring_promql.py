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

from mixrl.operator.builders.monitoring import collapse_rule_groups, dashboard
from mixrl.rl.metrics import SGLANG_NUM_QUEUE_REQS, promql_any_spelling

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
