"""The agent loop against a scripted stand-in policy: every way an episode ends, loss masks, token-in-token-out."""

from __future__ import annotations

import itertools
import math

import pytest

from mixrl.api.resolve import SamplingParams
from mixrl.api.trajectory import NO_VERSION, Trajectory
from mixrl.rl.environments.base import Outcome
from mixrl.rl.environments.filetree import FileTreeEnvironment, FileTreeTask, generate_tasks
from mixrl.rl.rollout.agent import (
    EnvironmentFailed,
    EpisodeAborted,
    ResetFailed,
    ScoringFailed,
    TaskFailed,
    evaluate,
    pass_at_k,
    printable,
    run_episode,
)
from mixrl.rl.rollout.worker import EPISODE_FAILURES

from .conftest import TOKENIZER, ScriptedGenerate

SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=16, top_logprobs_num=2, return_sampling_mask=False
)
TASK = generate_tasks(0, 1, "train")[0]
ENV = FileTreeEnvironment()
NO_TOOL_CALL = ENV.no_tool_call.content


async def play(generate: ScriptedGenerate, task: FileTreeTask = TASK, **kwargs: object) -> Trajectory:
    settings: dict[str, object] = {"max_turns": 8, "max_context_tokens": 256, "format_error_limit": 3}
    settings.update(kwargs)
    return await run_episode(generate, ENV, task, TOKENIZER, SAMPLING, **settings)  # type: ignore[arg-type]


def replies(trajectory: Trajectory) -> list[list[int]]:
    """The generated runs of the trajectory (consecutive loss-masked tokens)."""
    runs: list[list[int]] = []
    previous = 0
    for token, mask in zip(trajectory.tokens, trajectory.loss_mask, strict=True):
        if mask and not previous:
            runs.append([])
        if mask:
            runs[-1].append(token)
        previous = mask
    return runs


def assert_token_in_token_out(trajectory: Trajectory, generate: ScriptedGenerate) -> None:
    """Every context the engine saw is a prefix of the final sequence: nothing was re-tokenized."""
    final = trajectory.prompt_ids + trajectory.tokens
    for seen in generate.received:
        assert final[: len(seen)] == seen
    assert generate.received[0] == TOKENIZER.prompt_ids(TASK.question)
    for earlier, later in itertools.pairwise(generate.received):
        assert later[: len(earlier)] == earlier and len(later) > len(earlier)


async def test_expert_episode_submits_and_earns_one() -> None:
    generate = ScriptedGenerate()
    trajectory = await play(generate, run="r", prompt_id="p", sample_index=5)
    assert (trajectory.finish_reason, trajectory.reward, trajectory.num_turns) == ("submitted", 1.0, 3)
    assert (trajectory.run, trajectory.prompt_id, trajectory.sample_index, trajectory.split) == (
        "r",
        "p",
        5,
        "train",
    )
    assert (trajectory.pool, trajectory.gpu_type, trajectory.precision) == ("scripted", "cpu", "bf16")
    path = next(p for p in TASK.files if p.startswith(TASK.section + "."))
    texts = [TOKENIZER.reply_text(run) for run in replies(trajectory)]
    assert texts == ["ls", f"cat {path}", f"submit {TASK.answer}"]
    assert all(run[-1] == TOKENIZER.end_id for run in replies(trajectory))
    # the masked tokens are exactly the two tool turns, each followed by the next generation prompt
    masked = [t for t, m in zip(trajectory.tokens, trajectory.loss_mask, strict=True) if not m]
    assert masked == TOKENIZER.observation_ids(
        "tool", " ".join(sorted(TASK.files))
    ) + TOKENIZER.observation_ids("tool", TASK.files[path])
    # per-token records: the stand-in's log-probs are -0.01 * (position in the reply + 1)
    for i, (mask, logprob, version, cands) in enumerate(
        zip(
            trajectory.loss_mask,
            trajectory.logprobs,
            trajectory.weight_version,
            trajectory.cand_ids,
            strict=True,
        )
    ):
        if mask:
            assert version == 3 and len(cands) == 2 and cands[0] == trajectory.tokens[i] and logprob < 0
        else:
            assert (version, logprob, cands) == (NO_VERSION, 0.0, [])
    first = replies(trajectory)[0]
    assert trajectory.logprobs[: len(first)] == pytest.approx([-0.01 * (j + 1) for j in range(len(first))])
    assert_token_in_token_out(trajectory, generate)


async def test_wrong_answer_earns_zero() -> None:
    trajectory = await play(ScriptedGenerate("wrong"))
    assert (trajectory.finish_reason, trajectory.reward, trajectory.num_turns) == ("submitted", 0.0, 3)


async def test_turn_limit_ends_the_episode() -> None:
    generate = ScriptedGenerate("looper")
    trajectory = await play(generate, max_turns=4)
    assert (trajectory.finish_reason, trajectory.reward, trajectory.num_turns) == ("max_turns", 0.0, 4)
    assert len(generate.received) == 4
    assert_token_in_token_out(trajectory, generate)


async def test_context_limit_ends_the_episode() -> None:
    prompt = len(TOKENIZER.prompt_ids(TASK.question))
    for limit in range(prompt + 1, prompt + 40):
        generate = ScriptedGenerate()
        trajectory = await play(generate, max_context_tokens=limit)
        total = len(trajectory.prompt_ids) + len(trajectory.tokens)
        assert total <= limit, limit
        # every request asked for no more tokens than the context had room for
        for seen, budget in zip(generate.received, generate.budgets, strict=True):
            assert len(seen) + budget <= limit
        if trajectory.finish_reason != "submitted":
            assert (trajectory.finish_reason, trajectory.reward) == ("context_limit", 0.0), limit
    # with enough room the same episode succeeds
    assert (await play(ScriptedGenerate(), max_context_tokens=prompt + 60)).reward == 1.0


async def test_three_replies_without_a_tool_call_end_the_episode() -> None:
    generate = ScriptedGenerate("silent")
    trajectory = await play(generate)
    assert (trajectory.finish_reason, trajectory.reward, trajectory.num_turns) == ("format_errors", 0.0, 3)
    nudge = TOKENIZER.observation_ids("user", NO_TOOL_CALL)
    masked = [t for t, m in zip(trajectory.tokens, trajectory.loss_mask, strict=True) if not m]
    assert masked == nudge + nudge  # the third reply ends the episode: no nudge after it
    assert_token_in_token_out(trajectory, generate)


async def test_a_tool_call_resets_the_format_error_count() -> None:
    script = ["hello", "what", "ls", "is", "port", "in"]
    trajectory = await play(ScriptedGenerate(script=script), max_turns=10)
    assert (trajectory.finish_reason, trajectory.num_turns) == ("format_errors", 6)
    script = ["hello", "what", "ls", "is", "ls", "in", "ls"]
    trajectory = await play(ScriptedGenerate(script=script), max_turns=7)
    assert trajectory.finish_reason == "max_turns"
    limited = await play(ScriptedGenerate(script=["ls", "hello", "ls"]), format_error_limit=1)
    assert (limited.finish_reason, limited.num_turns) == ("format_errors", 2)


async def test_a_reply_cut_by_max_new_tokens_is_closed_and_counted() -> None:
    sampling = SAMPLING.model_copy(update={"max_new_tokens": 5})
    generate = ScriptedGenerate("chatty")
    trajectory = await run_episode(generate, ENV, TASK, TOKENIZER, sampling, 8, 256, 3)
    assert (trajectory.finish_reason, trajectory.num_turns) == ("format_errors", 3)
    assert generate.budgets == [5, 5, 5]
    # each cut reply is followed by a loss-masked <|end|> the model did not write
    first = 5
    assert trajectory.loss_mask[:first] == [1] * first
    assert (trajectory.tokens[first], trajectory.loss_mask[first]) == (TOKENIZER.end_id, 0)
    assert_token_in_token_out(trajectory, generate)


async def test_an_engine_that_trims_the_stop_token_still_yields_a_well_formed_chat() -> None:
    generate = ScriptedGenerate(include_stop=False)
    trajectory = await play(generate)
    assert (trajectory.finish_reason, trajectory.reward) == ("submitted", 1.0)
    ends = [i for i, t in enumerate(trajectory.tokens) if t == TOKENIZER.end_id]
    assert all(trajectory.loss_mask[i] == 0 for i in ends)
    assert_token_in_token_out(trajectory, generate)


async def test_an_aborted_turn_continues_from_its_tokens() -> None:
    generate = ScriptedGenerate(abort_first_after=1)
    trajectory = await play(generate)
    assert (trajectory.finish_reason, trajectory.reward, trajectory.num_turns) == ("submitted", 1.0, 3)
    prompt = TOKENIZER.prompt_ids(TASK.question)
    assert generate.received[1] == prompt + trajectory.tokens[:1]  # the continuation request
    assert generate.budgets[:2] == [16, 15]
    assert_token_in_token_out(trajectory, generate)


async def test_engine_misbehaviour_is_reported() -> None:
    class Aborting(ScriptedGenerate):
        async def __call__(self, input_ids: list[int], max_new_tokens: int):  # type: ignore[no-untyped-def]
            self._aborted = False
            return await super().__call__(input_ids, max_new_tokens)

    with pytest.raises(EpisodeAborted, match="aborted one turn 9 times"):
        await play(Aborting(abort_first_after=0))

    class TooLong(ScriptedGenerate):
        async def __call__(self, input_ids: list[int], max_new_tokens: int):  # type: ignore[no-untyped-def]
            result = await super().__call__(input_ids, 64)
            return result

    with pytest.raises(ValueError, match="generate returned 2 tokens for max_new_tokens 1"):
        await run_episode(
            TooLong(), ENV, TASK, TOKENIZER, SAMPLING.model_copy(update={"max_new_tokens": 1}), 8, 256
        )


async def test_an_environment_raising_on_model_input_ends_the_episode_as_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each path an environment can raise from (its parser, a tool call, its observation: here a
    lone surrogate such as a non-UTF-8 file name becomes, escaped) ends that episode with
    EnvironmentFailed, which the rollout worker counts as a failed episode, not its own crash."""

    def broken_parse(self: object, text: str, tools: object) -> None:
        raise TypeError("the parser chokes on this reply")

    with monkeypatch.context() as patched:
        patched.setattr(type(ENV.parser), "parse", broken_parse)
        with pytest.raises(
            EnvironmentFailed, match="FileTreeEnvironment: parsing a reply: TypeError: the parser chokes"
        ):
            await play(ScriptedGenerate())

    async def broken_step(self: object, call: object) -> None:
        raise KeyError("missing-file")

    episode_class = type((await ENV.reset(TASK))[1])
    with monkeypatch.context() as patched:
        patched.setattr(episode_class, "step", broken_step)
        with pytest.raises(EnvironmentFailed, match=r"tool call 'ls': KeyError: 'missing-file'"):
            await play(ScriptedGenerate())
    assert printable("bad\udcffname") == "bad\\udcffname" and printable("plain") == "plain"
    assert EnvironmentFailed in EPISODE_FAILURES


@pytest.mark.parametrize(
    ("finish", "line"),
    [
        (KeyError("no such case"), "KeyError: 'no such case'"),
        (OSError(28, "No space left on device"), "OSError: [Errno 28] No space left on device"),
        (Outcome(float("nan"), "submitted"), "reward nan is not a finite number"),
        (Outcome(1.0, "Not A Reason"), "finish reason 'Not A Reason' is not a short lower-case word"),
        ("1.0", "Episode.finish must return an Outcome, got str"),
    ],
)
async def test_scoring_that_raises_or_gives_no_outcome_ends_the_episode_as_a_failure(
    monkeypatch: pytest.MonkeyPatch, finish: object, line: str
) -> None:
    """Episode.finish (the scoring: a sandboxed test run in the coding environment) raising, or
    giving no valid outcome, ends that episode with ScoringFailed naming the environment and the
    task, after close ran: an EnvironmentFailed, so the worker drops the group rather than dying."""
    episode_class = type((await ENV.reset(TASK))[1])
    closed: list[bool] = []

    async def broken_finish(self: object, reason: str) -> object:
        if isinstance(finish, BaseException):
            raise finish
        return finish

    async def close(self: object) -> None:
        closed.append(True)

    monkeypatch.setattr(episode_class, "finish", broken_finish)
    monkeypatch.setattr(episode_class, "close", close)
    with pytest.raises(ScoringFailed) as failed:
        await play(ScriptedGenerate())
    assert str(failed.value) == f"FileTreeEnvironment: scoring task {TASK.id!r}: {line}"
    assert failed.value.task_id == TASK.id and closed == [True]
    assert (failed.value.__cause__ is finish) == isinstance(finish, BaseException)
    assert isinstance(failed.value, EnvironmentFailed) and isinstance(failed.value, EPISODE_FAILURES)


async def test_a_reset_that_raises_ends_the_episode_before_it_began(monkeypatch: pytest.MonkeyPatch) -> None:
    """Environment.reset raising (a task the environment cannot start) is a TaskFailed naming the
    environment and the task, with its cause chained: the worker drops that group rather than
    dying (before, the bare exception left the worker's task group)."""
    cause = FileNotFoundError(2, "No such file or directory", "/seed/tests.json")

    async def broken_reset(self: object, task: object) -> object:
        raise cause

    generate = ScriptedGenerate()
    monkeypatch.setattr(FileTreeEnvironment, "reset", broken_reset)
    with pytest.raises(ResetFailed) as failed:
        await play(generate)
    assert str(failed.value) == (
        f"FileTreeEnvironment: starting task {TASK.id!r}: FileNotFoundError: "
        "[Errno 2] No such file or directory: '/seed/tests.json'"
    )
    assert failed.value.__cause__ is cause and failed.value.task_id == TASK.id
    assert isinstance(failed.value, TaskFailed) and isinstance(failed.value, EPISODE_FAILURES)
    assert generate.received == []  # nothing was generated for it


@pytest.mark.parametrize("scoring", ["scores", "raises"])
async def test_a_close_that_raises_is_logged_and_changes_no_outcome(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, scoring: str
) -> None:
    """Episode.close runs however the episode ended; its own failure is one ERROR line naming the
    task and replaces nothing: a scored trajectory is kept, a scoring failure stays the one raised."""
    episode_class = type((await ENV.reset(TASK))[1])

    async def broken_close(self: object) -> None:
        raise PermissionError(13, "Permission denied", "/tmp/episode")

    async def broken_finish(self: object, reason: str) -> Outcome:
        raise KeyError("no such case")

    monkeypatch.setattr(episode_class, "close", broken_close)
    if scoring == "raises":
        monkeypatch.setattr(episode_class, "finish", broken_finish)
    with caplog.at_level("ERROR", logger="mixrl.rollout"):
        if scoring == "raises":
            with pytest.raises(ScoringFailed, match="KeyError: 'no such case'"):
                await play(ScriptedGenerate())
        else:
            trajectory = await play(ScriptedGenerate())
            assert trajectory.reward is not None and trajectory.finish_reason
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (
        f"FileTreeEnvironment: closing the episode of task {TASK.id!r}: PermissionError: "
        "[Errno 13] Permission denied: '/tmp/episode'"
    )


@pytest.mark.parametrize("bad", [{"max_turns": 0}, {"max_context_tokens": -1}, {"format_error_limit": 0}])
async def test_bad_settings_get_one_line(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(bad))}: must be positive"):
        await play(ScriptedGenerate(), **bad)


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (c of them correct) that contain a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(1 for s in subsets if any(samples[i] for i in s)) / len(subsets)


def test_pass_at_k_matches_enumeration() -> None:
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert math.isclose(pass_at_k(n, c, k), brute_force_pass_at_k(n, c, k), abs_tol=1e-12)
    with pytest.raises(ValueError, match="k: must be between 1 and n=4, got 5"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c: must be between 0 and n=4, got 5"):
        pass_at_k(4, 5, 1)


async def test_evaluate_averages_pass_at_k_over_tasks() -> None:
    tasks = generate_tasks(1, 6, "heldout")
    wrong_on = {tasks[1].id, tasks[4].id}

    async def episode(task: FileTreeTask, index: int) -> Trajectory:
        # one task in three fails always; on the others, only sample 0 succeeds
        behaviour = "wrong" if task.id in wrong_on or index > 0 else "expert"
        return await run_episode(
            ScriptedGenerate(behaviour), ENV, task, TOKENIZER, SAMPLING, 8, 256, 3, sample_index=index
        )

    result = await evaluate(episode, tasks, samples_per_task=4, pass_k=[1, 2, 4], concurrency=5)
    assert result["tasks"] == 6 and result["episodes"] == 24
    solved = 4 / 6  # tasks with one right sample out of four
    assert result["pass_at_k"] == pytest.approx({"1": solved / 4, "2": solved / 2, "4": solved})
    assert result["mean_reward"] == pytest.approx(4 / 24)
    assert result["finish_reasons"] == {"submitted": 24}
    assert result["weight_version"] == 3
    with pytest.raises(
        ValueError, match="pass_k: each k must be between 1 and samples_per_task=2, got \\[4\\]"
    ):
        await evaluate(episode, tasks, samples_per_task=2, pass_k=[1, 4])


async def test_an_engine_overrunning_its_budget_fails_the_episode_not_the_worker() -> None:
    """More tokens than max_new_tokens is the engine's malformed answer: the episode (and its
    group) is dropped like any other, not a ValueError the worker dies of with a traceback."""

    class TooLong(ScriptedGenerate):
        async def __call__(self, input_ids: list[int], max_new_tokens: int):  # type: ignore[no-untyped-def]
            return await super().__call__(input_ids, 64)

    with pytest.raises(EPISODE_FAILURES, match="generate returned 2 tokens for max_new_tokens 1"):
        await run_episode(
            TooLong(), ENV, TASK, TOKENIZER, SAMPLING.model_copy(update={"max_new_tokens": 1}), 8, 256
        )
