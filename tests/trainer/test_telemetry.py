from __future__ import annotations

import socket
import urllib.request

from prometheus_client import CollectorRegistry

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.rl.trainer.distributed import Ranks
from mixrl.rl.trainer.telemetry import TrainerTelemetry, trainer_telemetry

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


def test_one_rank_per_node_serves_metrics_on_the_port_torchrun_gives_every_rank() -> None:
    """launch.py gives torchrun one ``--metrics-port`` and every rank inherits it: a server per rank
    failed the second bind (EADDRINUSE) and the trainer crashed at its start."""
    run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    main = trainer_telemetry(run, port, Ranks(rank=0, world_size=2))
    assert main is not None and main.server is not None
    try:
        assert (
            trainer_telemetry(run, port, Ranks(rank=1, world_size=2, local_rank=1)) is None
        )  # no second bind
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert b"mixrl_trainer_finished{" in response.read()
    finally:
        main.server.shutdown()
        main.server.server_close()
    # One process (no torchrun) is rank 0 of 1 and serves as before; no port, no server on any rank.
    single = trainer_telemetry(run, port, Ranks())
    assert single is not None and single.server is not None
    single.server.shutdown()
    single.server.server_close()
    assert trainer_telemetry(run, 0, Ranks()) is None
    # The first rank of another node (its own pod) answers its pod's scrapes.
    other_node = trainer_telemetry(run, port, Ranks(rank=2, world_size=4, local_rank=0))
    assert other_node is not None and other_node.server is not None
    other_node.server.shutdown()
    other_node.server.server_close()
