"""The report's mismatch section: each pool's fresh KL and its share of samples against its share
of extreme-ratio tokens (the seed's table), from metrics.jsonl records."""

from __future__ import annotations

import json
from pathlib import Path

from mixrl.local.report import mismatch_lines, pool_shares, staleness_series, write_report


def record(step: int) -> dict:
    return {
        "step": step,
        "reward": 0.5,
        "by_staleness": {"0": {"kl_k3": 0.001, "tokens": 10}, "1": {"kl_k3": 0.004, "tokens": 30}},
        "pools": {
            # fp8 draws 10 % of the samples and, with 9x bf16's extreme rate, half the extreme tokens
            "fp8": {"trajectories": 1, "tokens": 100, "extreme_ratio": 0.09, "kl_k3_fresh": 0.003, "kl_k1_fresh": 0.0031},
            "bf16": {"trajectories": 9, "tokens": 900, "extreme_ratio": 0.01, "kl_k3": 0.001},
        },
    }  # fmt: skip


def test_shares_of_samples_and_of_extreme_tokens_per_pool() -> None:
    records = [record(step) for step in range(1, 5)]
    shares = pool_shares(records)
    assert shares["fp8"][0] == 0.1 and abs(shares["fp8"][1] - 0.5) < 1e-12
    assert abs(shares["bf16"][1] - 0.5) < 1e-12
    lines = mismatch_lines(records)
    assert "| fp8 | 0.003 | 0.0031 | 10.0% | 50.0% |" in lines
    assert "| bf16 | no fresh tokens | no fresh tokens | 90.0% | 50.0% |" in lines
    assert staleness_series(records, "kl_k3")["1"] == ([1, 2, 3, 4], [0.004] * 4)


def test_the_report_carries_the_section_and_its_plots(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record(s)) + "\n" for s in range(1, 6)))
    write_report(tmp_path)
    assert "## Mismatch per pool" in (tmp_path / "report.md").read_text()
    for name in ("kl_fresh", "kl_fresh_k1", "kl_by_staleness", "extreme_vs_samples"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000
