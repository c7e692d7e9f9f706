"""The fleet simulator: conservation, cost accounting against an independent sum, determinism, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mixrl.operator.autoscaling.policy import PolicyConfig
from mixrl.sim.fleet import FleetPool, Strategy, Workload, simulate
from mixrl.sim.simulate import fleet_from_spec, keda_configs, main, step_sessions

POOLS = [
    FleetPool("fast", "B200", 3.2, 1, 6.0, 1, 12, cold_start_s=120),
    FleetPool("slow", "A100", 0.5, 2, 1.2, 0, 10, cold_start_s=200),
]


def configs(poll: float = 15.0) -> dict[str, PolicyConfig]:
    return {
        p.name: PolicyConfig(
            min_replicas=p.min_replicas,
            max_replicas=p.max_replicas,
            target_per_replica=16 * p.capacity,
            poll_interval_s=poll,
            scale_up_period_s=poll,
        )
        for p in POOLS
    }


def small_workload(seconds: int = 3600) -> Workload:
    return Workload(sessions=step_sessions(100, 4.0, seconds // 3, seconds - seconds // 3), warmup_s=600)


def test_sessions_are_conserved() -> None:
    result = simulate(POOLS, small_workload(), Strategy("mixrl", configs=configs()), seed=3)
    assert result.sessions_started > 0 and result.sessions_finished > 0
    assert (
        result.sessions_alive_end
        == result.sessions_alive_start + result.sessions_started - result.sessions_finished
    )
    # The closed loop keeps exactly the scheduled number of sessions alive (it only ever tops up).
    assert result.sessions_alive[-1] >= 400 - 1


def test_costs_add_up_from_gpu_seconds_and_prices() -> None:
    result = simulate(POOLS, small_workload(), Strategy("mixrl", configs=configs()), seed=4)
    by_price = sum(result.gpu_seconds_by_pool[p.name] * p.cost_per_gpu_hour / 3600 for p in POOLS)
    assert result.cost == pytest.approx(by_price, rel=1e-12)
    assert result.cost == pytest.approx(sum(result.cost_by_pool.values()), rel=1e-12)


def test_static_cost_is_replicas_times_price_times_duration() -> None:
    workload = small_workload(1800)
    result = simulate(POOLS, workload, Strategy("static", static_replicas={"fast": 3, "slow": 2}), seed=5)
    seconds = len(workload.sessions)
    expected = (3 * 1 * 6.0 + 2 * 2 * 1.2) * seconds / 3600
    assert result.cost == pytest.approx(expected, rel=1e-12)
    assert result.actions == []


def test_runs_are_deterministic_for_a_seed() -> None:
    a = simulate(POOLS, small_workload(), Strategy("mixrl", configs=configs()), seed=7)
    b = simulate(POOLS, small_workload(), Strategy("mixrl", configs=configs()), seed=7)
    c = simulate(POOLS, small_workload(), Strategy("mixrl", configs=configs()), seed=8)
    assert (
        a.actions == b.actions and a.tokens == b.tokens and np.array_equal(a.wait_histogram, b.wait_histogram)
    )
    assert a.tokens != c.tokens


def test_step_is_met_within_one_poll_and_keda_like_takes_longer() -> None:
    """The issue's benchmark in miniature: 4× step, requested capacity within one poll interval."""
    workload = small_workload()
    step_at = len(workload.sessions) // 3
    ours = simulate(POOLS, workload, Strategy("mixrl", configs=configs()), seed=1)
    keda = simulate(
        POOLS,
        workload,
        Strategy("keda", configs=keda_configs(POOLS, configs()), sustained_window_s=None, reads_pods=False),
        seed=1,
    )
    needed = 0.9 * ours.requested_capacity[ours.times >= step_at + 900].min()

    def first_reaching(result) -> float:
        after = (result.times >= step_at) & (result.requested_capacity >= needed)
        return float(result.times[after][0] - step_at)

    assert first_reaching(ours) <= 15 + 15  # one poll plus one scrape of metric age
    assert first_reaching(keda) > first_reaching(ours)


def test_wait_quantiles_match_a_plain_percentile() -> None:
    result = simulate(
        POOLS,
        small_workload(),
        Strategy("keda", configs=keda_configs(POOLS, configs()), reads_pods=False),
        seed=2,
    )
    waits = np.repeat(np.arange(len(result.wait_histogram)), result.wait_histogram)
    assert result.requests == len(waits)
    for q in (0.5, 0.95, 0.99):
        assert result.wait_quantile(q) == pytest.approx(np.quantile(waits, q, method="inverted_cdf"))
    assert result.wait_mean_s == pytest.approx(waits.mean())


def test_fleet_from_the_mixed_example() -> None:
    pools, _, policies, name = fleet_from_spec("examples/rlrun-mixed.yaml")
    assert name == "qwen3-moe-coding" and len(pools) == 8
    assert policies["b200-nvfp4"].target_per_replica == pytest.approx(16 * 3.2)


def test_a_pool_without_a_price_is_priced_as_the_loop_prices_it(tmp_path: Path) -> None:
    """No costPerGpuHour: the default table of its GPU type (mixrl.api.gpus.price_per_gpu_hour,
    the rule the autoscaling loop prices its fill by), not a refusal; a stated price still wins."""
    from mixrl.api.gpus import default_price

    text = Path("examples/rlrun-mixed.yaml").read_text()
    unpriced = "minReplicas: 0, maxReplicas: 8, costPerGpuHour: 1.2}"  # a100-bf16
    assert text.count(unpriced) == 1
    text = text.replace(unpriced, "minReplicas: 0, maxReplicas: 8}")
    text = text.replace("costPerGpuHour: 6.0}", "costPerGpuHour: 7.25}")  # b200-nvfp4
    spec = tmp_path / "rlrun.yaml"
    spec.write_text(text)
    prices = {p.name: p.cost_per_gpu_hour for p in fleet_from_spec(str(spec))[0]}
    assert prices["a100-bf16"] == default_price("A100")
    assert prices["b200-nvfp4"] == 7.25
    assert (
        main(
            [
                str(spec),
                "--scenario",
                "step",
                "--sessions",
                "40",
                "--hours",
                "0.1",
                "--quiet",
                "--strategies",
                "mixrl",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )


def test_cli_writes_summary_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["--scenario", "step", "--sessions", "150", "--hours", "0.5", "--out", str(tmp_path), "--quiet"]
    )
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    strategies = [row["strategy"] for row in summary["results"]]
    assert strategies == ["mixrl", "keda", "static"]
    for png in ("timeline.png", "summary.png"):
        data = (tmp_path / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) < 200_000
    out = capsys.readouterr().out
    assert "$/Mtok" in out and "p95" in out


def test_cli_runs_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default spec is the checkout's example wherever the command is started; output lands in
    the working directory."""
    monkeypatch.chdir(tmp_path)
    code = main(["--scenario", "step", "--sessions", "150", "--hours", "0.5", "--no-plots", "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("qwen3-moe-coding: 8 pools")
    summary = json.loads((tmp_path / "sim-out" / "summary.json").read_text())
    assert [row["strategy"] for row in summary["results"]] == ["mixrl", "keda", "static"]


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--strategies", "mixrl,hpa"]) == 2
    assert "--strategies: unknown ['hpa']" in capsys.readouterr().err
    assert main(["--sessions", "0"]) == 2
    assert "--sessions: must be > 0" in capsys.readouterr().err
