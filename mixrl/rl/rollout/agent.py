"""The agent loop: one multi-turn episode of any environment, token-in-token-out, and held-out
evaluation (pass@k).

The context is a list of token ids that only grows: the prompt (the environment's first
messages), then every generated token (with its sampler record) and every environment token
(loss-masked), each encoded once when appended.  What the engine receives for turn n is exactly
``prompt_ids + tokens`` after turn n-1, so the trainer, which sees the same two lists, never
re-tokenizes anything.

Each reply is parsed by the environment's parser against the offered tools; a valid call is
executed by the episode (``Episode.step``), anything else gets the environment's
``no_tool_call`` message.  An episode ends
- when a step says ``done`` (filetree: ``submit``), with the step's finish reason;
- at ``max_turns`` assistant replies, or when the context reaches ``max_context_tokens``;
- after ``format_error_limit`` consecutive replies without a tool call (finish_reason
  ``format_errors``: the paper's collapse signature).
Then ``Episode.finish(reason)`` gives the reward and the recorded finish reason (an exception
from it, or an outcome that is not a finite reward with a short finish reason, ends the episode
with :class:`ScoringFailed`), and ``Episode.close()`` runs however the episode ended (its own
failure is logged and replaces nothing: the trajectory, or the failure that ended the episode,
stands).  An ``Environment.reset`` that raises ends the episode before it began
(:class:`ResetFailed`).
Observations are cut to ``max_observation_tokens`` tokens.

``generate`` is any async callable ``(input_ids, max_new_tokens) -> GenerateResult``: the router
client (one session per episode), an engine client, or the in-process sampler.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mixrl.api.resolve import SamplingParams
from mixrl.api.trajectory import Trajectory
from mixrl.rl.engine.protocol import EngineResponseError, GenerateResult, PoolInfo, TurnFinish
from mixrl.rl.environments.base import Environment, Episode, Outcome, TaskLike
from mixrl.rl.environments.tools import Tool
from mixrl.rl.rollout.chat_tokenizer import ChatTokenizer

log = logging.getLogger("mixrl.rollout")

FINISH_REASON = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
"""What a finish reason may look like: it becomes a metric label and a key of evaluation results."""
MAX_ABORTED_CONTINUATIONS = 8
"""An engine may abort a request (a weight update with abort_all_requests); the turn then continues
from the tokens it already produced.  More aborts than this in one turn end the episode."""


Generate = Callable[[list[int], int], Awaitable[GenerateResult]]
"""``(input_ids, max_new_tokens) -> GenerateResult``; sampling parameters are bound by the client."""


class EpisodeAborted(RuntimeError):
    """The engine kept aborting a turn; the episode cannot be completed."""


class EnvironmentFailed(RuntimeError):
    """The environment raised on the model's input (parsing a reply, a tool call, its observation,
    scoring the episode): that episode ends, as a failed one; the worker goes on."""


class TaskFailed(EnvironmentFailed):
    """The environment failed on a task outside the model's turns: starting it or scoring it.  The
    cause is chained (``__cause__``; None for an invalid outcome): a sandbox that was not there
    (``SandboxUnavailable``) is the infrastructure's failure, anything else the environment's bug
    on that task, which playing it again would meet again (the rollout worker's
    ``environment_bug``)."""

    def __init__(self, message: str, task_id: str) -> None:
        super().__init__(message)
        self.task_id = task_id


class ResetFailed(TaskFailed):
    """``Environment.reset`` raised: the episode never began."""


class ScoringFailed(TaskFailed):
    """``Episode.finish`` (the scoring) raised, or gave no valid :class:`Outcome`."""


def printable(text: str) -> str:
    """``text`` with lone surrogates written out as escapes (``\\udcff``): a file name that is not
    UTF-8 comes back from the OS that way, and no tokenizer can encode it."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
    environment: Environment[Any],
    task: TaskLike,
    tokenizer: ChatTokenizer,
    sampling: SamplingParams,
    max_turns: int,
    max_context_tokens: int,
    format_error_limit: int = 3,
    pool_info: PoolInfo | None = None,
    *,
    run: str = "",
    prompt_id: str | None = None,
    sample_index: int = 0,
    tools: Sequence[Tool] | None = None,
    max_observation_tokens: int | None = None,
) -> Trajectory:
    """Play one episode of ``task`` in ``environment`` and return its trajectory (reward and finish
    reason set).

    ``tools``: the tools offered (default: all the environment's); a call to any other counts as a
    reply without a tool call.
    """
    settings = EpisodeSettings(sampling, max_turns, max_context_tokens, format_error_limit)
    offered = list(environment.tools()) if tools is None else list(tools)
    pool = pool_info or PoolInfo()
    try:
        messages, episode = await environment.reset(task)
    except Exception as exc:  # a sandbox that is not there, or a bug of the environment's
        where = f"{type(environment).__name__}: starting task {task.id!r}"
        raise ResetFailed(f"{where}: {type(exc).__name__}: {exc}", task.id) from exc
    try:
        trajectory = Trajectory(
            run=run,
            prompt_id=prompt_id or task.id,
            sample_index=sample_index,
            pool=pool.pool,
            gpu_type=pool.gpu_type,
            precision=pool.precision,
            prompt_ids=tokenizer.chat_prompt_ids(messages, offered),
            split=task.split,
        )
        reason = await _play(
            generate, environment, episode, tokenizer, settings, offered, trajectory, max_observation_tokens
        )
        outcome = await _finish(episode, reason, environment, task)
    finally:
        await _close(episode, environment, task)
    trajectory.finish_reason = outcome.finish_reason
    trajectory.reward = float(outcome.reward)
    return trajectory


async def _play(
    generate: Generate,
    environment: Environment[Any],
    episode: Episode,
    tokenizer: ChatTokenizer,
    settings: EpisodeSettings,
    offered: Sequence[Tool],
    trajectory: Trajectory,
    max_observation_tokens: int | None,
) -> str:
    """The turns of one episode; returns why it ended."""
    replies_without_call = 0
    while True:
        if trajectory.num_turns >= settings.max_turns:
            return "max_turns"
        room = settings.max_context_tokens - _context_length(trajectory)
        if room <= 0:
            return "context_limit"
        budget = min(settings.sampling.max_new_tokens, room)
        reply, finish = await _generate_turn(generate, trajectory, budget)
        trajectory.num_turns += 1
        if finish == "length" and budget == room:
            return "context_limit"
        if not reply or reply[-1] not in tokenizer.stop_token_ids:
            # The reply was cut by max_new_tokens (or the engine trimmed the stop token): close the
            # turn with a loss-masked <|end|> so the next turn starts from a well-formed chat.
            trajectory.append_observation([tokenizer.end_id])
        name = type(environment).__name__
        try:
            call = environment.parser.parse(tokenizer.reply_text(reply), offered)
        except Exception as exc:  # the model's text is anything: the parser's failure is the episode's
            raise EnvironmentFailed(f"{name}: parsing a reply: {type(exc).__name__}: {exc}") from exc
        if call is None:
            replies_without_call += 1
            if replies_without_call >= settings.format_error_limit:
                return "format_errors"
            role, text = environment.no_tool_call.role, environment.no_tool_call.content
        else:
            replies_without_call = 0
            try:
                step = await episode.step(call)
            except Exception as exc:
                raise EnvironmentFailed(
                    f"{name}: tool call {call.name!r}: {type(exc).__name__}: {exc}"
                ) from exc
            if step.done:
                return step.finish_reason
            role, text = step.role, step.observation
        try:
            observation_ids = tokenizer.observation_ids(role, printable(text), max_observation_tokens)
        except Exception as exc:
            raise EnvironmentFailed(f"{name}: its observation: {type(exc).__name__}: {exc}") from exc
        if _context_length(trajectory) + len(observation_ids) > settings.max_context_tokens:
            return "context_limit"
        trajectory.append_observation(observation_ids)


async def _finish(episode: Episode, reason: str, environment: Environment[Any], task: TaskLike) -> Outcome:
    """The episode's outcome; ScoringFailed, naming the environment and the task, when its scoring
    raises or gives no valid outcome."""
    where = f"{type(environment).__name__}: scoring task {task.id!r}"
    try:
        outcome = await episode.finish(reason)
    except Exception as exc:  # a sandbox that is not there, or a bug of the environment's
        raise ScoringFailed(f"{where}: {type(exc).__name__}: {exc}", task.id) from exc
    problem = _outcome_problem(outcome)
    if problem is not None:
        raise ScoringFailed(f"{where}: {problem}", task.id)
    return outcome


async def _close(episode: Episode, environment: Environment[Any], task: TaskLike) -> None:
    """``Episode.close()``; its failure is one ERROR line and nothing more: the episode's outcome
    was already decided (a scored trajectory is kept, a failure already on its way stays the one
    raised), and what it leaves behind is the environment's to clean up."""
    try:
        await episode.close()
    except Exception as exc:
        log.error(
            "%s: closing the episode of task %r: %s: %s",
            type(environment).__name__,
            task.id,
            type(exc).__name__,
            exc,
        )


def _outcome_problem(outcome: Outcome) -> str | None:
    if not isinstance(outcome, Outcome):
        return f"Episode.finish must return an Outcome, got {type(outcome).__name__}"
    if not isinstance(outcome.finish_reason, str) or not FINISH_REASON.match(outcome.finish_reason):
        return f"finish reason {outcome.finish_reason!r} is not a short lower-case word"
    try:
        finite = math.isfinite(float(outcome.reward))
    except (TypeError, ValueError):
        finite = False
    if not finite:
        return f"reward {outcome.reward!r} is not a finite number"
    return None


def _context_length(trajectory: Trajectory) -> int:
    return len(trajectory.prompt_ids) + len(trajectory.tokens)


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
            # The engine's malformed answer: its episode is dropped (an EPISODE_FAILURE), not the worker.
            raise EngineResponseError(
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


EpisodeFn = Callable[[Any, int], Awaitable[Trajectory]]
"""``(task, sample_index) -> Trajectory``: plays one episode, opening and closing its own session."""


async def evaluate(
    episode: EpisodeFn,
    tasks: Sequence[TaskLike],
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

    async def one(task: TaskLike, index: int) -> Trajectory:
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
