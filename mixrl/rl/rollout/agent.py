"""The agent loop: one multi-turn episode, token-in-token-out, and held-out evaluation (pass@k).

The context is a list of token ids that only grows: the prompt, then every generated token (with
its sampler record) and every environment token (loss-masked), each encoded once when appended.
What the engine receives for turn n is exactly ``prompt_ids + tokens`` after turn n-1, so the
trainer, which sees the same two lists, never re-tokenizes anything.

An episode ends
- on ``submit``: reward 1 if the answer passes the task's check in a fresh environment, else 0;
- at ``max_turns`` assistant replies, or when the context reaches ``max_context_tokens`` (reward 0);
- after ``format_error_limit`` consecutive replies without a tool call (reward 0,
  finish_reason ``format_errors``: the paper's collapse signature).

``generate`` is any async callable ``(input_ids, max_new_tokens) -> GenerateResult``: the router
client (one session per episode), an engine client, or the in-process sampler.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mixrl.api.resolve import SamplingParams
from mixrl.api.trajectory import Trajectory
from mixrl.rl.engine.protocol import GenerateResult, PoolInfo, TurnFinish
from mixrl.rl.rollout.env import FileTreeEnv, check, parse_tool_call
from mixrl.rl.rollout.tasks import TOOL_SUBMIT, TOOLS, Task
from mixrl.rl.rollout.tokenizer import Tokenizer

FinishReason = Literal["submitted", "max_turns", "context_limit", "format_errors", "aborted"]
MAX_ABORTED_CONTINUATIONS = 8
"""An engine may abort a request (a weight update with abort_all_requests); the turn then continues
from the tokens it already produced.  More aborts than this in one turn end the episode."""


Generate = Callable[[list[int], int], Awaitable[GenerateResult]]
"""``(input_ids, max_new_tokens) -> GenerateResult``; sampling parameters are bound by the client."""


class EpisodeAborted(RuntimeError):
    """The engine kept aborting a turn; the episode cannot be completed."""


@dataclass(frozen=True)
class EpisodeSettings:
    """Everything an episode needs besides the task and the generator."""

    sampling: SamplingParams
    max_turns: int
    max_context_tokens: int
    format_error_limit: int = 3

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_context_tokens", "format_error_limit"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")


async def run_episode(
    generate: Generate,
    task: Task,
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    max_turns: int,
    max_context_tokens: int,
    format_error_limit: int = 3,
    pool_info: PoolInfo | None = None,
    *,
    run: str = "",
    prompt_id: str | None = None,
    sample_index: int = 0,
    tools: Collection[str] = TOOLS,
) -> Trajectory:
    """Play one episode of ``task`` and return its trajectory (reward and finish reason set).

    ``tools``: the tools offered; a call to any other counts as a reply without a tool call.
    """
    settings = EpisodeSettings(sampling, max_turns, max_context_tokens, format_error_limit)
    pool = pool_info or PoolInfo()
    trajectory = Trajectory(
        run=run,
        prompt_id=prompt_id or task.id,
        sample_index=sample_index,
        pool=pool.pool,
        gpu_type=pool.gpu_type,
        precision=pool.precision,
        prompt_ids=tokenizer.prompt_ids(task.question),
        split=task.split,
    )
    env = FileTreeEnv(task)
    replies_without_call = 0
    while True:
        if trajectory.num_turns >= settings.max_turns:
            return _finish(trajectory, "max_turns", 0.0)
        room = settings.max_context_tokens - _context_length(trajectory)
        if room <= 0:
            return _finish(trajectory, "context_limit", 0.0)
        budget = min(settings.sampling.max_new_tokens, room)
        reply, finish = await _generate_turn(generate, trajectory, budget)
        trajectory.num_turns += 1
        if finish == "length" and budget == room:
            return _finish(trajectory, "context_limit", 0.0)
        if not reply or reply[-1] not in tokenizer.stop_token_ids:
            # The reply was cut by max_new_tokens (or the engine trimmed the stop token): close the
            # turn with a loss-masked <|end|> so the next turn starts from a well-formed chat.
            trajectory.append_observation([tokenizer.end_id])
        call = parse_tool_call(tokenizer.reply_text(reply), tools)
        if call is not None and call.tool == TOOL_SUBMIT:
            return _finish(trajectory, "submitted", 1.0 if check(task, call.argument) else 0.0)
        if call is None:
            replies_without_call += 1
            if replies_without_call >= settings.format_error_limit:
                return _finish(trajectory, "format_errors", 0.0)
            observation = env.no_tool_call()
        else:
            replies_without_call = 0
            observation = env.run_tool(call)
        observation_ids = tokenizer.observation_ids(observation.role, observation.text)
        if _context_length(trajectory) + len(observation_ids) > settings.max_context_tokens:
            return _finish(trajectory, "context_limit", 0.0)
        trajectory.append_observation(observation_ids)


def _context_length(trajectory: Trajectory) -> int:
    return len(trajectory.prompt_ids) + len(trajectory.tokens)


def _finish(trajectory: Trajectory, reason: FinishReason, reward: float) -> Trajectory:
    trajectory.finish_reason = reason
    trajectory.reward = reward
    return trajectory


async def _generate_turn(
    generate: Generate, trajectory: Trajectory, budget: int
) -> tuple[list[int], TurnFinish]:
    """One assistant reply, appended to the trajectory; continues across engine aborts."""
    reply: list[int] = []
    for _ in range(MAX_ABORTED_CONTINUATIONS + 1):
        result = await generate(trajectory.prompt_ids + trajectory.tokens, budget - len(reply))
        if result.pool.pool and not trajectory.pool:
            trajectory.pool = result.pool.pool
            trajectory.gpu_type = result.pool.gpu_type
            trajectory.precision = result.pool.precision
        if len(reply) + len(result.records) > budget:
            raise ValueError(
                f"generate returned {len(result.records)} tokens for max_new_tokens {budget - len(reply)}"
            )
        for record in result.records:
            trajectory.append_generated(record)
            reply.append(record.token_id)
        if result.finish_reason != "abort":
            return reply, result.finish_reason
        if len(reply) == budget:
            return reply, "length"
    raise EpisodeAborted(f"the engine aborted one turn {MAX_ABORTED_CONTINUATIONS + 1} times")


# ----------------------------------------------------------------------------- evaluation


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n:
        raise ValueError(f"c: must be between 0 and n={n}, got {c}")
    if not 0 < k <= n:
        raise ValueError(f"k: must be between 1 and n={n}, got {k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


EpisodeFn = Callable[[Task, int], Awaitable[Trajectory]]
"""``(task, sample_index) -> Trajectory``: plays one episode, opening and closing its own session."""


async def evaluate(
    episode: EpisodeFn,
    tasks: Sequence[Task],
    samples_per_task: int,
    pass_k: Sequence[int],
    concurrency: int = 32,
) -> dict[str, Any]:
    """Held-out evaluation: ``samples_per_task`` episodes per task, pass@k averaged over tasks.

    Returns ``{"pass_at_k": {"1": ...}, "tasks", "episodes", "mean_reward", "finish_reasons",
    "weight_version"}``, where weight_version is the oldest version that produced any token.
    """
    if samples_per_task <= 0:
        raise ValueError(f"samples_per_task: must be positive, got {samples_per_task}")
    bad = [k for k in pass_k if not 0 < k <= samples_per_task]
    if bad:
        raise ValueError(
            f"pass_k: each k must be between 1 and samples_per_task={samples_per_task}, got {bad}"
        )
    if not tasks:
        raise ValueError("tasks: evaluation needs at least one task")
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task, index: int) -> Trajectory:
        async with gate:
            return await episode(task, index)

    async with asyncio.TaskGroup() as group:
        futures = [[group.create_task(one(task, i)) for i in range(samples_per_task)] for task in tasks]
    trajectories = [[f.result() for f in per_task] for per_task in futures]
    return summarize_evaluation(trajectories, pass_k)


def summarize_evaluation(
    trajectories: Sequence[Sequence[Trajectory]], pass_k: Sequence[int]
) -> dict[str, Any]:
    """pass@k and episode statistics from per-task lists of finished trajectories."""
    scores: dict[str, float] = {}
    for k in pass_k:
        per_task = [
            pass_at_k(len(group), sum(1 for t in group if (t.reward or 0.0) > 0.5), k)
            for group in trajectories
        ]
        scores[str(k)] = sum(per_task) / len(per_task)
    flat = [t for group in trajectories for t in group]
    versions = [t.oldest_version() for t in flat if t.num_generated]
    return {
        "pass_at_k": scores,
        "tasks": len(trajectories),
        "episodes": len(flat),
        "mean_reward": sum(t.reward or 0.0 for t in flat) / len(flat),
        "finish_reasons": dict(Counter(t.finish_reason for t in flat)),
        "weight_version": min(versions) if versions else -1,
    }
