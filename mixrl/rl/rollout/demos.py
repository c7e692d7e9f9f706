"""Warm start: a short supervised phase on demonstrations, to a moderate success rate.

RL needs a policy that sometimes succeeds: a random tiny model never submits a right answer, and
one trained to perfection leaves nothing to learn.  The warm start trains on demonstration
episodes (``ls``, ``cat`` a file, ``submit`` the line) with AdamW on the next-token loss of the
assistant tokens only.  The demonstrator is partly careless (:func:`careless_choice`): that, not an
early stop, is what sets the starting success rate (:class:`WarmStartRecipe`).  Success is
measured with the real agent loop on an in-process sampler (:func:`measure_success`) on probe
tasks from the training split, so the held-out split is never used to choose the starting point.

The warm start of a ``tiny:`` filetree model (:mod:`mixrl.rl.prepare_model`: ``mixrl run`` runs it, and the
trainer pod's ``model-init`` container); a real ``model.path`` is used as it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mixrl.api.resolve import SamplingParams
from mixrl.rl.environments.filetree import (
    TOOL_CAT,
    TOOL_LS,
    TOOL_SUBMIT,
    Difficulty,
    FileTreeEnvironment,
    FileTreeEpisode,
    FileTreeTask,
    generate_tasks,
    parse_config,
)
from mixrl.rl.environments.tools import ToolCall
from mixrl.rl.rollout.agent import run_episode
from mixrl.rl.rollout.local_sampler import LocalSampler
from mixrl.rl.rollout.tokenizer import Tokenizer


def expert_replies(task: FileTreeTask, opened: str | None = None) -> list[str]:
    """The demonstrator's three replies: list the tree, read a file, submit the asked key's line.

    ``opened`` is the file it reads: by default the asked section's file (the right answer); a
    careless demonstrator reads another file and reports the line it finds there (a wrong answer).
    """
    env = FileTreeEpisode(task)
    path = opened if opened is not None else asked_file(task)
    text = env.read_file(path)
    if text is None:
        raise ValueError(f"opened: {path!r} is not a file of task {task.id}")
    settings = parse_config(text)
    key = task.key if task.key in settings else next(iter(settings))
    line = f"{key} {settings[key]}"
    return [TOOL_LS, f"{TOOL_CAT} {path}", f"{TOOL_SUBMIT} {line}"]


def asked_file(task: FileTreeTask) -> str:
    return next(p for p in FileTreeEpisode(task).list_files() if p.rsplit(".", 1)[0] == task.section)


def careless_choice(task: FileTreeTask, mistake_rate: float, rng: random.Random) -> str | None:
    """The file a careless demonstrator opens: with probability ``mistake_rate`` the first one ``ls``
    lists (which is sometimes the asked one), else None (the asked file)."""
    if rng.random() < mistake_rate:
        return FileTreeEpisode(task).list_files()[0]
    return None


def demonstration_tokens(
    task: FileTreeTask, tokenizer: Tokenizer, opened: str | None = None
) -> tuple[list[int], list[int]]:
    """A demonstration episode as ``(input_ids, loss_mask)``; the mask is 1 on the assistant's tokens.

    The layout is exactly what the agent loop builds (prompt, reply + ``<|end|>``, tool turn +
    generation prompt, ...), so what is learned here is what the rollout asks for.  ``opened``
    as in :func:`expert_replies`.
    """
    env = FileTreeEpisode(task)
    ids = tokenizer.prompt_ids(task.question)
    mask = [0] * len(ids)
    replies = expert_replies(task, opened)
    for n, reply in enumerate(replies):
        reply_ids = [*tokenizer.encode(reply), tokenizer.end_id]
        ids += reply_ids
        mask += [1] * len(reply_ids)
        if n == len(replies) - 1:
            break
        words = reply.split()
        call = ToolCall(TOOL_LS) if words[0] == TOOL_LS else ToolCall(TOOL_CAT, {"path": words[1]})
        step = env.run_tool(call)
        observation_ids = tokenizer.observation_ids(step.role, step.observation)
        ids += observation_ids
        mask += [0] * len(observation_ids)
    return ids, mask


def masked_next_token_loss(
    model: torch.nn.Module, batch: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> torch.Tensor:
    """Mean cross-entropy of the tokens whose mask is 1, each predicted from the tokens before it."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, (ids, loss_mask) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = torch.tensor(loss_mask, dtype=torch.bool)
    logits = model(input_ids=input_ids).logits[:, :-1]
    targets = input_ids[:, 1:]
    token_loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none"
    ).view_as(targets)
    weights = mask[:, 1:].float()
    return (token_loss * weights).sum() / weights.sum()


async def measure_success(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    tasks: Sequence[FileTreeTask],
    sampling: SamplingParams,
    max_turns: int = 6,
    max_context_tokens: int = 256,
    format_error_limit: int = 3,
    samples_per_task: int = 1,
    seed: int = 0,
) -> float:
    """Share of episodes that submit a right answer, with the real agent loop on the in-process sampler."""
    was_training = model.training
    model.eval()
    try:
        async with LocalSampler(
            model,
            tokenizer.stop_token_ids,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=seed,
            pad_id=tokenizer.pad_id,
        ) as sampler:
            environment = FileTreeEnvironment()
            episodes = [
                run_episode(
                    sampler.generate,
                    environment,
                    task,
                    tokenizer,
                    sampling,
                    max_turns,
                    max_context_tokens,
                    format_error_limit,
                    sample_index=i,
                )
                for task in tasks
                for i in range(samples_per_task)
            ]
            trajectories = await asyncio.gather(*episodes)
    finally:
        model.train(was_training)
    return sum(t.reward or 0.0 for t in trajectories) / len(trajectories)


def measure_success_sync(*args: object, **kwargs: object) -> float:
    """:func:`measure_success` from synchronous code (starts its own event loop)."""
    return asyncio.run(measure_success(*args, **kwargs))  # type: ignore[arg-type]


@dataclass
class WarmStartReport:
    steps: int = 0
    seconds: float = 0.0
    final_loss: float = math.nan
    probes: list[tuple[int, float]] = field(default_factory=list)
    """(step, probe success rate) at every probe."""
    reached_target: bool = False

    @property
    def success(self) -> float:
        return self.probes[-1][1] if self.probes else math.nan


def warm_start(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    tasks: Sequence[FileTreeTask],
    steps: int,
    lr: float = 3e-3,
    target_success: float | None = None,
    probe_tasks: Sequence[FileTreeTask] = (),
    probe_every: int = 50,
    sampling: SamplingParams | None = None,
    batch_size: int = 32,
    mistake_rate: float = 0.0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> WarmStartReport:
    """Supervised steps on demonstrations of ``tasks``; the model is trained in place (float32).

    ``mistake_rate``: share of careless demonstrations (see :func:`careless_choice`).  With probe
    tasks, the success rate on them is measured every ``probe_every`` steps and after the last
    step (``report.probes``); with ``target_success`` too, training stops at the first probe that
    reaches it.  Without probe tasks a progress line is printed every ``probe_every`` steps.
    """
    if steps <= 0:
        raise ValueError(f"steps: must be positive, got {steps}")
    if not tasks:
        raise ValueError("tasks: the warm start needs demonstration tasks")
    if target_success is not None and not probe_tasks:
        raise ValueError("probe_tasks: needed to stop at target_success")
    if not 0.0 <= mistake_rate <= 1.0:
        raise ValueError(f"mistake_rate: must be between 0 and 1, got {mistake_rate}")
    sampling = sampling or DEFAULT_PROBE_SAMPLING
    order = random.Random(seed)
    demos = [
        demonstration_tokens(task, tokenizer, careless_choice(task, mistake_rate, order)) for task in tasks
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    report = WarmStartReport()
    started = time.monotonic()
    model.train()
    model.requires_grad_(True)

    def say(step: int, probe: float | None = None) -> None:
        if progress is None:
            return
        elapsed = max(time.monotonic() - started, 1e-9)
        rate = step / elapsed
        probed = f", probe success {probe:.2f}" if probe is not None else ""
        progress(
            f"warm start step {step}/{steps}: loss {report.final_loss:.3f}{probed}, "
            f"{rate:.1f} steps/s, ETA {(steps - step) / max(rate, 1e-9):.0f}s"
        )

    def probe(step: int) -> float:
        success = measure_success_sync(model, tokenizer, probe_tasks, sampling, seed=seed + step)
        report.probes.append((step, success))
        say(step, success)
        return success

    for step in range(1, steps + 1):
        batch = order.sample(demos, min(batch_size, len(demos)))
        loss = masked_next_token_loss(model, batch, tokenizer.pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        report.steps = step
        report.final_loss = float(loss.detach())
        if step % probe_every == 0:
            if not probe_tasks:
                say(step)
            elif probe(step) >= (target_success if target_success is not None else math.inf):
                report.reached_target = True
                break
    if probe_tasks and (not report.probes or report.probes[-1][0] != report.steps):
        probe(report.steps)
    model.eval()
    model.requires_grad_(False)
    report.seconds = time.monotonic() - started
    return report


DEFAULT_PROBE_SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=16, top_logprobs_num=0, return_sampling_mask=False
)


@dataclass(frozen=True)
class WarmStartRecipe:
    """The tuned warm start of the tiny model (measurements in docs/rollout.md).

    A careful demonstrator alone would take the tiny model to ~100 % success within a few hundred
    steps.  Here 85 % of demonstrations come from a careless one that opens the first file ``ls``
    shows, which is the asked file only about a third of the time; imitation converges to a policy
    that mixes both habits and succeeds ~40 % of the time, with every skill (reading ``ls``,
    naming the file, copying the line) learned.  What RL then has to learn is to prefer the
    careful habit: a sharp credit-assignment signal at one decision, which a tiny model picks up
    in tens of steps.
    """

    steps: int = 500
    lr: float = 3e-3
    batch_size: int = 32
    demonstrations: int = 4096
    probe_tasks: int = 128
    mistake_rate: float = 0.85
    target_success: float | None = None
    probe_every: int = 100

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def warm_start_recipe(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    dataset_seed: int,
    sampling: SamplingParams | None = None,
    recipe: WarmStartRecipe | None = None,
    difficulty: Difficulty | None = None,
    progress: Callable[[str], None] | None = None,
) -> WarmStartReport:
    """Run ``recipe`` on the training split of ``dataset_seed`` (the held-out split is never used).

    Demonstrations are the first ``recipe.demonstrations`` training tasks, probes the next
    ``recipe.probe_tasks``.
    """
    recipe = recipe or WarmStartRecipe()
    tasks = generate_tasks(dataset_seed, recipe.demonstrations + recipe.probe_tasks, "train", difficulty)
    return warm_start(
        model,
        tokenizer,
        tasks[: recipe.demonstrations],
        recipe.steps,
        lr=recipe.lr,
        target_success=recipe.target_success,
        probe_tasks=tasks[recipe.demonstrations :],
        probe_every=recipe.probe_every,
        sampling=sampling,
        batch_size=recipe.batch_size,
        mistake_rate=recipe.mistake_rate,
        seed=dataset_seed,
        progress=progress,
    )
