"""The trajectory contract: what every trajectory of a run must satisfy before anyone trains on it.

One function, :func:`trajectory_problem`, run in three places: the rollout worker before it posts
a group (a bad record is caught where it was made), the buffer before it acknowledges a post (a
refusal is a 400 naming the trajectory, the field and the position; nothing of that post is
stored), and the trainer on every batch it reads (a batch that fails is quarantined, never trained:
docs/buffer.md, "Quarantine").  The checks, beyond the field types of
:class:`~mixrl.api.trajectory.Trajectory` (strict: ``"7"``, ``7.0`` and ``true`` are not token ids):

- it belongs to the run (``run``), its sample index is below ``samplesPerPrompt``;
- a prompt, at least one token after it, and no more than ``model.maxContextTokens`` in all;
- every id (prompt, tokens, candidates) in ``[0, vocabulary)``; candidates distinct, at most K;
- ``loss_mask`` 0 or 1; a generated token (1) carries its sampler's record: a finite
  log-probability ≤ 0, candidates' log-probabilities ≤ 0 (−inf allowed: a token the sampler's
  logits ruled out), a support size within its candidates and holding the sampled token, a weight
  version ≥ 0 and no newer than the latest published; a tool token (0) carries none
  (``logprob`` 0, no candidates, support 0, version :data:`~mixrl.api.trajectory.NO_VERSION`);
- a finite reward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mixrl.api.resolve import ResolvedRun
from mixrl.api.trajectory import NO_VERSION, Trajectory


@dataclass(frozen=True)
class TrajectoryLimits:
    """What a trajectory is checked against: the resolved run, and what the checker knows of the model."""

    run: str
    samples_per_prompt: int
    candidates: int
    """K: the most candidates a token may carry (``sampling.topLogprobsNum`` of the run)."""
    max_context_tokens: int
    vocab_size: int | None
    """The model's vocabulary (its embedding rows); None where the checker cannot read the model
    (ids are then only checked to be ≥ 0, and the trainer, which can, checks them on read)."""
    latest_version: int | None = None
    """The newest weight version that can exist; None: versions only checked to be ≥ 0."""


def limits_of_run(run: ResolvedRun, vocab_size: int | None) -> TrajectoryLimits:
    """The limits of ``run``'s trajectories (versions unbounded: the checker bounds them if it can)."""
    return TrajectoryLimits(
        run=run.name,
        samples_per_prompt=run.trainer.samples_per_prompt,
        candidates=run.sampling.top_logprobs_num,
        max_context_tokens=run.model.max_context_tokens,
        vocab_size=vocab_size,
    )


def _first(values: Sequence[float | int], bad: object) -> int:
    return next(i for i, v in enumerate(values) if bad(v))  # type: ignore[operator]


def _ids_problem(field: str, ids: Sequence[int], vocab: int | None) -> str | None:
    if not ids:
        return None
    low, high = min(ids), max(ids)
    if low < 0:
        i = _first(ids, lambda v: v < 0)
        return f"{field}[{i}]: token id {ids[i]} is negative"
    if vocab is not None and high >= vocab:
        i = _first(ids, lambda v: v >= vocab)
        return f"{field}[{i}]: token id {ids[i]} is outside the vocabulary (0..{vocab - 1})"
    return None


def _not_a_logprob(value: float) -> bool:
    """NaN, +inf or positive (NaN fails every comparison, so ``not value <= 0`` catches it)."""
    return not value <= 0.0


def trajectory_problem(trajectory: Trajectory, limits: TrajectoryLimits) -> str | None:
    """The first way ``trajectory`` breaks the contract, as ``field[position]: reason``; None if it keeps it."""
    t, k = trajectory, limits.candidates
    if t.run != limits.run:
        return f"run: {t.run!r} is not this run ({limits.run!r})"
    if t.sample_index >= limits.samples_per_prompt:
        return f"sample_index: {t.sample_index} is not below samplesPerPrompt ({limits.samples_per_prompt})"
    if t.reward is None:
        return "reward: missing; post a trajectory when its episode has ended"
    if not math.isfinite(t.reward):
        return f"reward: {t.reward} is not a finite number"
    if not t.prompt_ids:
        return "prompt_ids: empty (a generated token needs a context to be predicted from)"
    if not t.tokens:
        return "tokens: empty (nothing after the prompt to train on)"
    length = len(t.prompt_ids) + len(t.tokens)
    if length > limits.max_context_tokens:
        return f"tokens: {length} tokens with the prompt exceed model.maxContextTokens ({limits.max_context_tokens})"
    for field, ids in (("prompt_ids", t.prompt_ids), ("tokens", t.tokens)):
        problem = _ids_problem(field, ids, limits.vocab_size)
        if problem is not None:
            return problem
    if any(m not in (0, 1) for m in t.loss_mask):
        i = _first(t.loss_mask, lambda m: m not in (0, 1))
        return f"loss_mask[{i}]: {t.loss_mask[i]} is neither 0 (tool token) nor 1 (generated)"
    for i, generated in enumerate(t.loss_mask):
        problem = _generated_problem(t, i, k, limits) if generated else _tool_token_problem(t, i)
        if problem is not None:
            return problem
    return None


def _generated_problem(t: Trajectory, i: int, k: int, limits: TrajectoryLimits) -> str | None:
    logprob, ids, logprobs = t.logprobs[i], t.cand_ids[i], t.cand_logprobs[i]
    if _not_a_logprob(logprob) or logprob == -math.inf:
        return f"logprobs[{i}]: {logprob} is not the log-probability of a sampled token (finite, ≤ 0)"
    if len(ids) != len(logprobs):
        return f"cand_logprobs[{i}]: {len(logprobs)} entries for {len(ids)} candidate ids"
    if len(ids) > k:
        return f"cand_ids[{i}]: {len(ids)} candidates, the run records at most {k}"
    problem = _ids_problem(f"cand_ids[{i}]", ids, limits.vocab_size)
    if problem is not None:
        return problem
    if len(set(ids)) != len(ids):
        return f"cand_ids[{i}]: a candidate id appears twice"
    if any(_not_a_logprob(v) for v in logprobs):
        j = _first(logprobs, _not_a_logprob)
        return f"cand_logprobs[{i}][{j}]: {logprobs[j]} is not a log-probability (≤ 0 or -inf)"
    support = t.support_size[i]
    if support < 0 or support > len(ids):
        return f"support_size[{i}]: {support} is outside 0..{len(ids)} (its candidates)"
    if support and t.tokens[i] not in ids[:support]:
        return f"tokens[{i}]: sampled token {t.tokens[i]} is outside its own support of {support}"
    version = t.weight_version[i]
    if version < 0:
        return f"weight_version[{i}]: {version}; a generated token comes from a version ≥ 0"
    if limits.latest_version is not None and version > limits.latest_version:
        return f"weight_version[{i}]: {version} is newer than the latest version ({limits.latest_version})"
    return None


def _tool_token_problem(t: Trajectory, i: int) -> str | None:
    if t.logprobs[i] != 0.0:
        return f"logprobs[{i}]: {t.logprobs[i]} on a tool token (loss_mask 0 carries 0)"
    if t.cand_ids[i] or t.cand_logprobs[i]:
        return f"cand_ids[{i}]: candidates on a tool token (loss_mask 0 carries none)"
    if t.support_size[i] != 0:
        return f"support_size[{i}]: {t.support_size[i]} on a tool token (loss_mask 0 carries 0)"
    if t.weight_version[i] != NO_VERSION:
        return (
            f"weight_version[{i}]: {t.weight_version[i]} on a tool token (loss_mask 0 carries {NO_VERSION})"
        )
    return None


def group_problem(prompt_id: str, trajectories: Sequence[Trajectory], limits: TrajectoryLimits) -> str | None:
    """The first way a group breaks the contract (``trajectories[i].field: reason``), or None: every
    trajectory keeps it, all are of ``prompt_id``, and the sample indices are 0..n-1 once each."""
    for index, trajectory in enumerate(trajectories):
        if trajectory.prompt_id != prompt_id:
            return f"trajectories[{index}].prompt_id: {trajectory.prompt_id!r} in the group of {prompt_id!r}"
        problem = trajectory_problem(trajectory, limits)
        if problem is not None:
            return f"trajectories[{index}].{problem}"
    indices = sorted(t.sample_index for t in trajectories)
    if indices != list(range(limits.samples_per_prompt)):
        return (
            f"group {prompt_id!r} needs sample indices 0..{limits.samples_per_prompt - 1} once each, "
            f"got {indices}"
        )
    return None
