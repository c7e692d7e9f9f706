"""Demonstrations and the supervised loss: the same token layout as the agent loop, the loss against float64."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from mixrl.rl.environments.filetree import (
    Difficulty,
    FileTreeEnvironment,
    FileTreeEpisode,
    check,
    generate_tasks,
)
from mixrl.rl.rollout.demos import (
    asked_file,
    careless_choice,
    demonstration_tokens,
    expert_replies,
    masked_next_token_loss,
    warm_start,
)
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model

from .conftest import TOKENIZER, ScriptedGenerate
from .test_agent import SAMPLING

TASKS = generate_tasks(2, 20, "train", Difficulty(files=3, lines=2))


@pytest.mark.parametrize("index", range(5))
async def test_demonstration_is_what_the_agent_loop_builds(index: int) -> None:
    from mixrl.rl.rollout.agent import run_episode

    task = TASKS[index]
    ids, mask = demonstration_tokens(task, TOKENIZER)
    trajectory = await run_episode(
        ScriptedGenerate(), FileTreeEnvironment(), task, TOKENIZER, SAMPLING, 8, 256, 3
    )
    assert trajectory.reward == 1.0
    assert ids == trajectory.prompt_ids + trajectory.tokens
    assert mask == [0] * len(trajectory.prompt_ids) + trajectory.loss_mask


def test_careless_demonstrations_open_the_first_file_and_report_it() -> None:
    for task in TASKS:
        first = FileTreeEpisode(task).list_files()[0]
        replies = expert_replies(task, first)
        assert replies[:2] == ["ls", f"cat {first}"]
        line = replies[2].removeprefix("submit ")
        assert line.split()[0] in {ln.split()[0] for ln in task.files[first].split("\n")}
        assert check(task, line) == (first == asked_file(task))
        ids, mask = demonstration_tokens(task, TOKENIZER, first)
        generated = TOKENIZER.decode(i for i, m in zip(ids, mask, strict=True) if m)
        assert generated.split("<|end|>")[1].strip() == f"cat {first}"
    with pytest.raises(ValueError, match=r"opened: 'nope\.cfg' is not a file of task"):
        expert_replies(TASKS[0], "nope.cfg")


def test_careless_share_follows_the_rate() -> None:
    tasks = generate_tasks(0, 2000, "train")
    rng = random.Random(0)
    choices = [careless_choice(task, 0.85, rng) for task in tasks]
    careless = [(t, c) for t, c in zip(tasks, choices, strict=True) if c is not None]
    assert len(careless) / len(tasks) == pytest.approx(0.85, abs=0.03)
    assert all(c == FileTreeEpisode(t).list_files()[0] for t, c in careless)
    assert all(careless_choice(t, 0.0, rng) is None for t in tasks[:50])


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(
        Path(tmp_path_factory.mktemp("tiny")) / "m", "qwen3", TOKENIZER.vocab_size, seed=1
    )


def test_masked_loss_matches_a_float64_reference(tiny_path: str) -> None:
    model = load_model(tiny_path)
    batch = [demonstration_tokens(task, TOKENIZER) for task in TASKS[:3]]
    loss = float(masked_next_token_loss(model, batch, TOKENIZER.pad_id))
    total, count = 0.0, 0
    for ids, mask in batch:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double().tolist()
        for t in range(1, len(ids)):
            if mask[t]:
                row = logits[t - 1]
                top = max(row)
                log_norm = top + math.log(sum(math.exp(z - top) for z in row))
                total += log_norm - row[ids[t]]
                count += 1
    assert count == sum(sum(m) for _, m in batch)
    assert loss == pytest.approx(total / count, rel=1e-5)


def test_warm_start_arguments_are_checked(tiny_path: str) -> None:
    model = load_model(tiny_path)
    with pytest.raises(ValueError, match="steps: must be positive"):
        warm_start(model, TOKENIZER, TASKS, 0)
    with pytest.raises(ValueError, match="tasks: the warm start needs demonstration tasks"):
        warm_start(model, TOKENIZER, [], 5)
    with pytest.raises(ValueError, match="probe_tasks: needed to stop at target_success"):
        warm_start(model, TOKENIZER, TASKS, 5, target_success=0.3)
    with pytest.raises(ValueError, match=r"mistake_rate: must be between 0 and 1, got 1\.5"):
        warm_start(model, TOKENIZER, TASKS, 5, mistake_rate=1.5)


def test_a_few_steps_lower_the_loss(tiny_path: str) -> None:
    model = load_model(tiny_path)
    batch = [demonstration_tokens(task, TOKENIZER) for task in TASKS]
    before = float(masked_next_token_loss(model, batch, TOKENIZER.pad_id))
    lines: list[str] = []
    report = warm_start(model, TOKENIZER, TASKS, 30, lr=3e-3, probe_every=10, progress=lines.append)
    after = float(masked_next_token_loss(model, batch, TOKENIZER.pad_id))
    assert report.steps == 30 and after < before - 1.0
    assert len(lines) == 3 and "steps/s" in lines[0] and "ETA" in lines[0]
    assert not model.training and not any(p.requires_grad for p in model.parameters())
