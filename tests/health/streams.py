"""Metric streams for the health tests: the recorded quickstart run and synthetic ones.

``data/quickstart_metrics.jsonl`` is the trainer's metrics.jsonl of one `mixrl run
examples/quickstart.yaml` (100 steps, four pools nvfp4/mxfp4/fp8/bf16 on CPU), trimmed to the
figures the health code and the progress line read: a real healthy run, noisy reward included.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
RECORDED = DATA / "quickstart_metrics.jsonl"
POOLS = ("a", "b")

Record = dict[str, Any]


def recorded() -> list[Record]:
    return [json.loads(line) for line in RECORDED.read_text().splitlines() if line.strip()]


def healthy(steps: int = 60, seed: int = 0) -> list[Record]:
    """A noisy healthy run: reward 0.5 ± 0.15 (uniform), KL 0.002 ± 40 % per pool, 10 % format errors."""
    rng = random.Random(seed)
    records = []
    for step in range(1, steps + 1):
        pools = {
            pool: {"kl_k3": 0.002 * rng.uniform(0.6, 1.4), "reward": rng.uniform(0.3, 0.7)} for pool in POOLS
        }
        records.append(
            {
                "step": step,
                "reward": rng.uniform(0.35, 0.65),
                "kl_k3": sum(p["kl_k3"] for p in pools.values()) / len(pools),
                "format_error_endings": rng.uniform(0.0, 0.2),
                "pools": pools,
            }
        )
    return records


def with_changes(records: list[Record], from_step: int, change: Any) -> list[Record]:
    """A copy of ``records`` with ``change(record)`` applied to every record from ``from_step`` on."""
    out = copy.deepcopy(records)
    for record in out:
        if record["step"] >= from_step:
            change(record)
    return out
