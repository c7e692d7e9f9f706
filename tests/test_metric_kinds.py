"""The typed metric constructors of mixrl/rl/metrics.py: each returns its kind, and a spec of
another kind is refused before anything is registered."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mixrl.rl import metrics


def test_each_constructor_returns_its_kind_and_refuses_another_before_registering() -> None:
    registry = CollectorRegistry()
    assert isinstance(metrics.gauge(metrics.MIXRL_TRAINER_STEP, registry), Gauge)
    assert isinstance(metrics.counter(metrics.MIXRL_TRAINER_TOKENS_TOTAL, registry), Counter)
    assert isinstance(metrics.histogram(metrics.MIXRL_ROUTER_REQUEST_LATENCY, registry), Histogram)
    with pytest.raises(TypeError, match="is a gauge, not a counter"):
        metrics.counter(metrics.MIXRL_TRAINER_REWARD, registry)
    # nothing of the refused spec was registered: the gauge it names can still be created
    assert isinstance(metrics.gauge(metrics.MIXRL_TRAINER_REWARD, registry), Gauge)
