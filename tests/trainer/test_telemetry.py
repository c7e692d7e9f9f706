from __future__ import annotations

from prometheus_client import CollectorRegistry

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.rl.trainer.telemetry import TrainerTelemetry

from ..api.conftest import ROOT


def test_step_records_become_per_pool_series() -> None:
    run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    registry = CollectorRegistry()
    telemetry = TrainerTelemetry(run, port=0, registry=registry)
    record = {
        "step": 7,
        "weight_version": 7,
        "grad_norm": 0.5,
        "tokens": 1000,
        "staleness_mean": 1.25,
        "reward": 0.6,
        "kl_k3": 0.01,
        "extreme_ratio": 0.002,
        "entropy": 0.3,
        "pools": {"nvfp4": {"kl_k3": 0.03, "reward": 0.4}, "bf16": {"kl_k3": 0.001}},
    }
    telemetry.observe(record)
    telemetry.observe({**record, "step": 8, "tokens": 500})

    def value(name: str, pool: str) -> float | None:
        labels = {"run": "quickstart", "pool": pool}
        if pool != "all":
            labels |= {"gpu_type": "cpu", "precision": pool}
        else:
            labels |= {"gpu_type": "", "precision": ""}
        return registry.get_sample_value(name, labels)

    assert value("mixrl_trainer_step", "all") == 8
    assert value("mixrl_trainer_tokens_total", "all") == 1500
    assert value("mixrl_trainer_kl", "all") == 0.01
    assert value("mixrl_trainer_kl", "nvfp4") == 0.03 and value("mixrl_trainer_kl", "bf16") == 0.001
    assert value("mixrl_trainer_reward", "nvfp4") == 0.4 and value("mixrl_trainer_reward", "bf16") is None
    assert value("mixrl_trainer_staleness", "all") == 1.25
