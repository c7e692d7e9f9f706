"""The collapse alerts, evaluated by Prometheus' own rule engine (promtool) on synthetic series."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.models import CollapseSpec
from mixrl.operator.builders.monitoring import (
    collapse_rule_groups,
    format_error_expr,
    kl_growing_expr,
    reward_falling_expr,
)

# promtool comes in Debian's prometheus package with the server: without it these tests fail
# (tests/conftest.py), never skip.
PROMTOOL = shutil.which("promtool") or "promtool"
pytestmark = pytest.mark.needs_prometheus

RULES = {rule["alert"]: rule for group in collapse_rule_groups() for rule in group["rules"]}


# The one conditional the annotations use: {{ if eq $labels.X "v" }}A{{ else }}B{{ end }}.
CONDITIONAL = re.compile(r'\{\{ if eq \$labels\.(\w+) "([^"]*)" \}\}(.*?)\{\{ else \}\}(.*?)\{\{ end \}\}')


def render(text: str, labels: dict[str, str]) -> str:
    """An annotation as we expect Prometheus to render it (promtool then checks that it does)."""
    text = CONDITIONAL.sub(lambda m: m[3] if labels.get(m[1]) == m[2] else m[4], text)
    for name, value in labels.items():
        text = text.replace(f"{{{{ $labels.{name} }}}}", value)
    assert "{{" not in text, f"a template this test cannot render: {text}"
    return text


def expected(alert: str, **labels: str) -> dict[str, Any]:
    """The alert as Prometheus renders it: the rule's labels plus the series', annotations filled in."""
    rule = RULES[alert]
    annotations = {key: render(text, labels) for key, text in rule["annotations"].items()}
    return {"exp_labels": {**rule["labels"], **labels}, "exp_annotations": annotations}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def write_rules(tmp_path: Path, thresholds: CollapseSpec | None = None) -> Path:
    path = tmp_path / "rules.yaml"
    groups = collapse_rule_groups() if thresholds is None else collapse_rule_groups(thresholds)
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    return write_rules(tmp_path)


def test_rules_are_valid_promql(rules_file: Path) -> None:
    checked = promtool("check", "rules", rules_file.name, cwd=rules_file.parent)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 3 rules found" in checked.stdout


Series = list[dict[str, str]]
Check = dict[str, Any]
"""One entry of promtool's ``alert_rule_test``."""


def run_rule_tests(rules_file: Path, series: Series, checks: list[Check]) -> subprocess.CompletedProcess[str]:
    """promtool's unit test of the rules: ``series`` one point a minute, then the ``checks``."""
    test = {"interval": "1m", "input_series": series, "alert_rule_test": checks}
    spec = {"rule_files": [rules_file.name], "evaluation_interval": "1m", "tests": [test]}
    (rules_file.parent / "tests.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return promtool("test", "rules", "tests.yaml", cwd=rules_file.parent)


def fires(alert: str, at: str, **labels: str) -> Check:
    """At ``at``, ``alert`` fires once, for the series with ``labels``."""
    return {"eval_time": at, "alertname": alert, "exp_alerts": [expected(alert, **labels)]}


def silent(alert: str, at: str) -> Check:
    """At ``at``, ``alert`` fires for no series (it may be pending)."""
    return {"eval_time": at, "alertname": alert, "exp_alerts": []}


def test_kl_tripling_in_one_pool_fires_only_for_that_pool(rules_file: Path) -> None:
    series = [
        # two hours at its early level, then 4x
        {"series": 'mixrl_trainer_kl{namespace="ns",run="a",pool="h100"}', "values": "0.001x120 0.004x120"},
        {"series": 'mixrl_trainer_kl{namespace="ns",run="a",pool="b200"}', "values": "0.001x240"},  # steady
        {
            "series": 'mixrl_trainer_kl{namespace="ns",run="b",pool="cpu"}',
            "values": "0.000001x120 0.000005x120",
        },  # noise
    ]
    checks = [
        silent("MixrlKLGrowing", "125m"),  # still pending
        fires("MixrlKLGrowing", "200m", namespace="ns", run="a", pool="h100"),
    ]
    result = run_rule_tests(rules_file, series, checks)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_runs_own_kl_is_judged_too_and_named_as_the_run(rules_file: Path) -> None:
    """`mixrl run` judges the KL per pool and for the run (the trainer's pool="all" series): so do
    the rules, and the summary names the run, not a pool called "all"."""
    series = [
        {"series": 'mixrl_trainer_kl{namespace="ns",run="a",pool="all"}', "values": "0.001x120 0.004x120"},
        {"series": 'mixrl_trainer_kl{namespace="ns",run="a",pool="h100"}', "values": "0.001x240"},  # steady
    ]
    result = run_rule_tests(
        rules_file, series, [fires("MixrlKLGrowing", "200m", namespace="ns", run="a", pool="all")]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert expected("MixrlKLGrowing", namespace="ns", run="a", pool="all")["exp_annotations"]["summary"] == (
        "Run ns/a: sampler-trainer KL of the run (all pools) grew 3x"
    )
    assert expected("MixrlKLGrowing", namespace="ns", run="a", pool="h100")["exp_annotations"]["summary"] == (
        "Run ns/a: sampler-trainer KL of pool h100 grew 3x"
    )
    # Every series of the KL, the run's and each pool's, each on its own: no pool filter.
    assert "max by (namespace, run, pool) (avg_over_time(mixrl_trainer_kl[15m]))" in kl_growing_expr(
        CollapseSpec()
    )


def test_a_kl_that_only_doubles_does_not_fire(rules_file: Path) -> None:
    series = [
        {"series": 'mixrl_trainer_kl{namespace="ns",run="a",pool="h100"}', "values": "0.001x120 0.002x120"}
    ]
    result = run_rule_tests(rules_file, series, [silent("MixrlKLGrowing", "230m")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_falling_reward_fires_and_a_flat_one_does_not(rules_file: Path) -> None:
    series = [
        {"series": 'mixrl_trainer_reward{namespace="ns",run="a",pool="all"}', "values": "0.8x180 0.4x120"},
        {"series": 'mixrl_trainer_reward{namespace="ns",run="b",pool="all"}', "values": "0.5x300"},
        {
            "series": 'mixrl_trainer_reward{namespace="ns",run="c",pool="all"}',
            "values": "0.8x180 0.7x120",
        },  # -12 %: fine
    ]
    checks = [
        silent("MixrlRewardFalling", "185m"),
        fires("MixrlRewardFalling", "280m", namespace="ns", run="a"),
    ]
    result = run_rule_tests(rules_file, series, checks)
    assert result.returncode == 0, result.stdout + result.stderr


def test_runs_of_one_name_in_two_namespaces_are_judged_apart(rules_file: Path) -> None:
    """Grouped by run alone, a falling run and a steady one of the same name in another namespace
    were averaged into one series that fell too little to fire."""
    series = [
        {
            "series": 'mixrl_trainer_reward{namespace="team-a",run="r",pool="all"}',
            "values": "0.8x180 0.4x120",
        },
        {"series": 'mixrl_trainer_reward{namespace="team-b",run="r",pool="all"}', "values": "0.8x300"},
    ]
    check = fires("MixrlRewardFalling", "280m", namespace="team-a", run="r")
    result = run_rule_tests(rules_file, series, [check])
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_reward_judged_is_the_runs_not_the_pools(rules_file: Path) -> None:
    """The trainer exports the run's reward (pool="all") beside each pool's; `mixrl run` judges the
    run's alone, and so do the rules: a pool's falling reward under a steady run moves nothing, and
    a falling run fires however steady one pool's looks."""
    series = [
        # run a: steady overall; pool h100's own reward falls (its share of the batch shrank).
        # Averaged with it (the old rule) the run's "reward" fell 0.65 -> 0.35, below 0.7 x 0.65.
        {"series": 'mixrl_trainer_reward{namespace="ns",run="a",pool="all"}', "values": "0.5x300"},
        {"series": 'mixrl_trainer_reward{namespace="ns",run="a",pool="h100"}', "values": "0.8x180 0.2x120"},
        # run b: falls 0.8 -> 0.4 while its pools' series stay high (averaged: -14 %, no alert).
        {"series": 'mixrl_trainer_reward{namespace="ns",run="b",pool="all"}', "values": "0.8x180 0.4x120"},
        {"series": 'mixrl_trainer_reward{namespace="ns",run="b",pool="b200"}', "values": "1x300"},
        {"series": 'mixrl_trainer_reward{namespace="ns",run="b",pool="h100"}', "values": "1x300"},
    ]
    result = run_rule_tests(
        rules_file, series, [fires("MixrlRewardFalling", "280m", namespace="ns", run="b")]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert '{pool="all"}' in reward_falling_expr(CollapseSpec())


def test_most_trained_episodes_ending_on_format_errors_fires(rules_file: Path) -> None:
    """The alert judges what ``mixrl run`` judges: the trainer's batches (pool "all"), not the
    rollout workers' counters (held-out episodes, dropped groups) nor a pool's share alone."""
    series = [
        {
            "series": 'mixrl_trainer_format_error_endings{namespace="ns",run="a",pool="all"}',
            "values": "0.6x60",
        },
        {
            "series": 'mixrl_trainer_format_error_endings{namespace="ns",run="b",pool="all"}',
            "values": "0.2x60",
        },
        {
            "series": 'mixrl_trainer_format_error_endings{namespace="ns",run="b",pool="h100"}',
            "values": "0.9x60",
        },
        {"series": 'mixrl_rollout_episodes_total{namespace="ns",run="b",pool="h100"}', "values": "0+10x60"},
        {
            "series": 'mixrl_rollout_format_error_episodes_total{namespace="ns",run="b",pool="h100"}',
            "values": "0+9x60",
        },
    ]
    result = run_rule_tests(
        rules_file, series, [fires("MixrlFormatErrorEpisodes", "50m", namespace="ns", run="a")]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert '{pool="all"}' in format_error_expr(CollapseSpec())


def test_the_rule_tests_have_teeth(rules_file: Path) -> None:
    """A wrong expectation fails: promtool really evaluates the rules."""
    series = [{"series": 'mixrl_trainer_kl{namespace="ns",run="a",pool="h100"}', "values": "0.001x240"}]
    result = run_rule_tests(
        rules_file, series, [fires("MixrlKLGrowing", "200m", namespace="ns", run="a", pool="h100")]
    )
    assert result.returncode != 0


def values(points: list[float]) -> str:
    """A promtool series written out point by point (one per minute)."""
    return " ".join(f"{value:.6g}" for value in points)


def noisy_healthy_run(alerts: list[str]) -> tuple[Series, list[Check]]:
    """Six hours of noise: reward 0.5 ± 0.15, KL 0.002 ± 40 % with one 20x minute, 30 % format
    errors; expecting none of ``alerts`` every 15 minutes."""
    rng = random.Random(0)
    minutes = 360
    reward = [rng.uniform(0.35, 0.65) for _ in range(minutes)]
    kl = [0.002 * rng.uniform(0.6, 1.4) for _ in range(minutes)]
    kl[200] *= 20
    errors = [rng.randint(0, 6) / 10 for _ in range(minutes)]  # a batch's share: 3 of 10 on average
    series = [
        {"series": 'mixrl_trainer_reward{namespace="ns",run="a",pool="all"}', "values": values(reward)},
        {"series": 'mixrl_trainer_kl{namespace="ns",run="a",pool="h100"}', "values": values(kl)},
        {
            "series": 'mixrl_trainer_format_error_endings{namespace="ns",run="a",pool="all"}',
            "values": values(errors),
        },
    ]
    return series, [silent(name, f"{minute}m") for minute in range(30, minutes, 15) for name in alerts]


def test_a_noisy_healthy_run_fires_no_alert(rules_file: Path) -> None:
    result = run_rule_tests(rules_file, *noisy_healthy_run(list(RULES)))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("alert", "tight"),
    [
        ("MixrlRewardFalling", CollapseSpec(reward_drop=0.05)),
        ("MixrlKLGrowing", CollapseSpec(kl_growth=1.1)),
        ("MixrlFormatErrorEpisodes", CollapseSpec(format_error_share=0.2)),
    ],
)
def test_the_noisy_run_is_live_tight_thresholds_fire_on_it(
    tmp_path: Path, alert: str, tight: CollapseSpec
) -> None:
    """The quiet of the test above is the thresholds', not a series the rules never read."""
    result = run_rule_tests(write_rules(tmp_path, tight), *noisy_healthy_run([alert]))
    assert result.returncode != 0 and alert in result.stdout + result.stderr


def test_the_rules_follow_the_thresholds_they_are_generated_from(tmp_path: Path) -> None:
    """The chart's rules are collapse_rule_groups() with spec.health.collapse's defaults; others move them."""
    assert collapse_rule_groups() == collapse_rule_groups(CollapseSpec())
    series = [
        {"series": 'mixrl_trainer_kl{namespace="ns",run="a",pool="h100"}', "values": "0.001x120 0.004x120"}
    ]  # 4x
    for growth, check in (
        (3.0, fires("MixrlKLGrowing", "200m", namespace="ns", run="a", pool="h100")),
        (5.0, silent("MixrlKLGrowing", "200m")),
    ):
        result = run_rule_tests(write_rules(tmp_path, CollapseSpec(kl_growth=growth)), series, [check])
        assert result.returncode == 0, f"klGrowth {growth}: " + result.stdout + result.stderr
