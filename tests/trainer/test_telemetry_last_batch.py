"""The trainer's per-batch gauges describe the last batch, as their help says: a figure the last
batch has none of (no fresh token, a pool that sent no trajectory) is absent, not the value of some
earlier batch (docs/health.md#live-status: ``klFresh`` is absent in a step without fresh tokens)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.rl import metrics as m
from mixrl.rl.trainer.telemetry import ALL_POOLS, TrainerTelemetry

from ..api.conftest import ROOT


def test_a_figure_the_last_batch_lacks_is_absent_not_an_earlier_batchs() -> None:
    run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    registry = CollectorRegistry()
    telemetry = TrainerTelemetry(run, port=0, registry=registry)
    first, second = (pool.name for pool in run.pools[:2])
    base = {"weight_version": 1, "grad_norm": 0.5, "tokens": 10, "reward": 0.5, "kl_k3": 0.01}
    telemetry.observe(
        {
            **base,
            "step": 1,
            "kl_k3_fresh": 0.02,
            "pools": {
                first: {"kl_k3": 0.01, "kl_k3_fresh": 0.02, "reward": 0.5},
                second: {"kl_k3": 0.03, "reward": 0.2},
            },
        }
    )
    # Step 2: no fresh token at all, and only the first pool's trajectories.
    telemetry.observe({**base, "step": 2, "kl_k3": 0.04, "pools": {first: {"kl_k3": 0.04}}})

    def value(spec: m.MetricSpec, pool: str) -> float | None:
        labels = telemetry._labels(pool)
        return registry.get_sample_value(spec.name, labels)

    assert value(m.MIXRL_TRAINER_KL, ALL_POOLS) == 0.04
    assert value(m.MIXRL_TRAINER_KL, first) == 0.04
    assert value(m.MIXRL_TRAINER_KL_FRESH, ALL_POOLS) is None  # was 0.02, of step 1
    assert value(m.MIXRL_TRAINER_KL_FRESH, first) is None
    assert value(m.MIXRL_TRAINER_REWARD, first) is None  # step 2's record has no reward for it
    assert value(m.MIXRL_TRAINER_KL, second) is None  # no trajectory of it in step 2's batch
    assert value(m.MIXRL_TRAINER_REWARD, ALL_POOLS) == 0.5
    # A figure that comes back is written again.
    telemetry.observe({**base, "step": 3, "pools": {second: {"kl_k3": 0.05, "kl_k3_fresh": 0.06}}})
    assert value(m.MIXRL_TRAINER_KL_FRESH, second) == 0.06
    assert value(m.MIXRL_TRAINER_KL, first) is None
