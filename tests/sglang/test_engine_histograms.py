"""The torch engine's SGLang histograms fill SGLang's own buckets: read from SGLang's source
(``srt/observability/metrics_collector.py`` of the pinned, test-only package), statically, since its
collectors need a whole server's configuration and a GPU build's imports to be constructed.

Before: the torch engine's latency histograms stopped at 120 s (an RL generation's minutes landed
in +Inf) and differed from SGLang's, so a run with pools of both engines could not sum them by
``le``."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from mixrl.api.resolve import SGLANG_VERSION
from mixrl.rl import metrics as m

from .conftest import sglang_env_dir

COLLECTOR = Path("sglang") / "srt" / "observability" / "metrics_collector.py"


def sglang_histogram_buckets(source: str) -> dict[str, list[float] | None]:
    """``name`` -> ``buckets`` of every ``Histogram(name=..., buckets=...)`` call in ``source``; a
    ``buckets`` given by a parameter resolves to its default (``if x is None: x = [...]``)."""
    tree = ast.parse(source)
    defaults: dict[str, Any] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
        ):
            for statement in node.body:
                if (
                    isinstance(statement, ast.Assign)
                    and isinstance(statement.targets[0], ast.Name)
                    and statement.targets[0].id == node.test.left.id
                ):
                    defaults[node.test.left.id] = ast.literal_eval(statement.value)
    found: dict[str, list[float] | None] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        name, buckets = keywords.get("name"), keywords.get("buckets")
        if isinstance(name, ast.Constant) and isinstance(name.value, str) and buckets is not None:
            if isinstance(buckets, ast.Name):
                found[name.value] = defaults.get(buckets.id)
            else:
                try:
                    found[name.value] = ast.literal_eval(buckets)
                except ValueError:  # computed at run time: not one this test compares
                    found[name.value] = None
    return found


@pytest.mark.parametrize(
    "spec",
    [
        m.SGLANG_TIME_TO_FIRST_TOKEN,
        m.SGLANG_INTER_TOKEN_LATENCY,
        m.SGLANG_E2E_REQUEST_LATENCY,
        m.SGLANG_QUEUE_TIME,
    ],
    ids=lambda spec: spec.name,
)
def test_each_histogram_has_sglangs_buckets(spec: m.MetricSpec) -> None:
    path = sglang_env_dir() / COLLECTOR
    if not path.is_file():
        pytest.fail(f"SGLang {SGLANG_VERSION}'s metrics collector is absent at {path}: run scripts/setup.sh")
    theirs = sglang_histogram_buckets(path.read_text(encoding="utf-8"))
    assert spec.kind == "histogram" and spec.buckets is not None
    assert spec.name in theirs, f"SGLang {SGLANG_VERSION} has no histogram {spec.name}"
    assert [float(b) for b in spec.buckets] == [float(b) for b in theirs[spec.name] or []]
