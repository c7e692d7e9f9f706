"""False alarms of the reward sign on noisy healthy runs, by smoothing window.

Run: ``.venv/bin/python tests/health/false_alarms.py`` (the figures in docs/health.md).  A run is a
plateau of uniform noise, reward 0.5 ± 0.15 per step (about the quickstart's ±16 %), judged after
every step as ``mixrl run`` does; a false alarm is a run where the sign is raised at any step.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mixrl.api.models import CollapseSpec
from mixrl.rl.health.collapse import reward_sign


def raises_anywhere(spec: CollapseSpec, seed: int, steps: int) -> bool:
    rng = random.Random(seed)
    points = [(step, rng.uniform(0.35, 0.65)) for step in range(1, steps + 1)]
    return any(
        (sign := reward_sign(points[:end], spec)) is not None and sign.raised for end in range(1, steps + 1)
    )


def false_alarm_rate(spec: CollapseSpec, seeds: int = 200, steps: int = 300) -> float:
    return sum(raises_anywhere(spec, seed, steps) for seed in range(seeds)) / seeds


if __name__ == "__main__":
    for window in (5, 10, 15):
        rate = false_alarm_rate(CollapseSpec(reward_window=window))
        print(f"rewardWindow {window:2d}: {rate:.1%} of 200 noisy 300-step runs raise the reward sign")
