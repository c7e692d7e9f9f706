"""The honest measurement: a tiny model, warm-started on a CPU, lands at a moderate success rate,
and the task is learnable well beyond it (bench/rollout_learnability.py also measures RL from there)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from mixrl.api.resolve import SamplingParams
from mixrl.rl.environments.filetree import generate_tasks
from mixrl.rl.rollout.demos import WarmStartRecipe, measure_success, warm_start_recipe
from mixrl.rl.rollout.tokenizer import Tokenizer
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model

TOKENIZER = Tokenizer.filetree()

# sampled as the quickstart samples
QUICKSTART = SamplingParams(
    temperature=1.0, top_p=0.95, top_k=32, max_new_tokens=16, top_logprobs_num=0, return_sampling_mask=False
)


@pytest.mark.slow
def test_warm_start_is_moderate_and_the_task_learnable(tmp_path: Path) -> None:
    heldout = generate_tasks(0, 64, "heldout")
    path = create_tiny_checkpoint(tmp_path / "m", "qwen3", TOKENIZER.vocab_size, seed=0)

    def trained(recipe: WarmStartRecipe) -> tuple[float, list[tuple[int, float]], float]:
        model = load_model(path)
        started = time.monotonic()
        report = warm_start_recipe(model, TOKENIZER, 0, QUICKSTART, recipe)
        seconds = time.monotonic() - started
        success = asyncio.run(
            measure_success(model, TOKENIZER, heldout, QUICKSTART, samples_per_task=4, seed=1)
        )
        return success, report.probes, seconds

    recipe = WarmStartRecipe()
    moderate, probes, seconds = trained(recipe)
    print(f"recipe: held-out success {moderate:.3f} after {seconds:.1f}s; probes {probes}")
    assert 0.2 <= moderate <= 0.6
    assert [step for step, _ in probes] == [100, 200, 300, 400, 500]
    assert probes[0][1] < probes[-1][1] - 0.05  # more supervised steps raised success
    assert seconds < 120  # typically 10-20 s on two cores

    careful, _, _ = trained(dataclasses.replace(recipe, mistake_rate=0.0))
    print(f"careful demonstrations: held-out success {careful:.3f}")
    assert careful >= moderate + 0.25  # the moderate start is the demonstrator's, not the model's limit
