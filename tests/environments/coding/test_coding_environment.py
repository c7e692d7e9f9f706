"""The coding environment on the real sandbox: the oracle scores 1.0, a wrong solution the share of
cases it gets right, three replies without a call end the episode at 0, escapes are contained.

Real: bubblewrap sandboxes, the generated tasks' hidden tests, the agent loop with the word
tokenizer built from the environment's vocabulary.  Stand-in, named: ``Scripted``, an in-process
``generate`` answering each turn with the next text of a script.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mixrl.api.resolve import SamplingParams
from mixrl.api.trajectory import TokenRecord
from mixrl.rl.engine.protocol import GenerateResult, PoolInfo
from mixrl.rl.environments.coding import (
    CodingEnvironment,
    CodingEpisode,
    PlainCodingEnvironment,
    generate_tasks,
)
from mixrl.rl.environments.coding.tasks import SOLUTION_FILE, CodingTask
from mixrl.rl.environments.datasets import load_tasks
from mixrl.rl.environments.registry import check_rollout, load_environment
from mixrl.rl.environments.tools import ToolCall
from mixrl.rl.rollout.agent import run_episode
from mixrl.rl.rollout.tokenizer import Tokenizer

pytestmark = pytest.mark.needs_bwrap
SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=64, top_logprobs_num=0, return_sampling_mask=False
)
AFFINE = re.compile(r"return (\d+) times x plus (\d+)")
CLAMP = re.compile(r"limited to the range (-?\d+) to (-?\d+)")


@dataclass
class Scripted:
    """Stand-in ``generate``: the next reply of the script, encoded with the word tokenizer."""

    tokenizer: Tokenizer
    script: list[str]
    turns: int = 0
    contexts: list[list[int]] = field(default_factory=list)

    async def __call__(self, input_ids: list[int], max_new_tokens: int) -> GenerateResult:
        self.contexts.append(list(input_ids))
        text = self.script[min(self.turns, len(self.script) - 1)]
        self.turns += 1
        ids = [*self.tokenizer.encode(text), self.tokenizer.end_id][:max_new_tokens]
        records = [
            TokenRecord(
                token_id=t, logprob=-0.5, cand_ids=[t], cand_logprobs=[-0.5], support_size=0, weight_version=1
            )
            for t in ids
        ]
        return GenerateResult(records, "stop", PoolInfo("scripted", "cpu", "bf16"))


def task_of(family: str, split: str = "train") -> CodingTask:
    return next(t for t in generate_tasks(split, 60, seed=0, levels=(1,)) if t.id.startswith(family + "-"))  # type: ignore[arg-type]


def function_name(task: CodingTask) -> str:
    match = re.match(r"def (\w+)\(", task.files[SOLUTION_FILE])
    assert match is not None
    return match.group(1)


def affine_solution(task: CodingTask) -> str:
    """The reply that writes the right solution of an affine task (its coefficients read from the problem)."""
    a, b = AFFINE.search(task.problem).groups()  # type: ignore[union-attr]
    return f"write_file solution.py def {function_name(task)} ( x ) : return {a} * x + {b}"


def hidden_cases(task: CodingTask) -> list[tuple[list[Any], Any]]:
    """The hidden cases: their inputs read back from the generated runner, their answers the task's
    (kept on the host: no expected output enters the sandbox)."""
    match = re.search(r"json\.loads\((.*)\)\n", next(iter(task.hidden_tests.values())))
    assert match is not None
    inputs = json.loads(ast.literal_eval(match.group(1)))
    return [(args, json.loads(answer)) for args, answer in zip(inputs, task.answers, strict=True)]


async def play(env: PlainCodingEnvironment, task: CodingTask, script: list[str]) -> tuple[Any, Scripted]:
    tokenizer = Tokenizer.from_words(env.vocabulary())
    generate = Scripted(tokenizer, script)
    trajectory = await run_episode(
        generate, env, task, tokenizer, SAMPLING, 8, 4096, 3, max_observation_tokens=256
    )
    return trajectory, generate


async def test_the_oracle_scores_one_through_the_agent_loop() -> None:
    env = PlainCodingEnvironment()
    task = task_of("affine")
    script = ["list_files", affine_solution(task), "run python test_solution.py", "submit"]
    trajectory, generate = await play(env, task, script)
    assert trajectory.finish_reason == "submitted" and trajectory.reward == 1.0
    assert trajectory.num_turns == 4
    observation = env_text(generate, 3)
    assert "exit code 0 ( ok )" in observation and "examples pass" in observation


def env_text(generate: Scripted, turn: int) -> str:
    """What the agent had seen before turn ``turn`` (decoded)."""
    return generate.tokenizer.decode(generate.contexts[turn])


async def test_a_wrong_solution_scores_the_share_of_cases_it_gets_right() -> None:
    env = PlainCodingEnvironment()
    task = task_of("clamp")
    lo, hi = (int(v) for v in CLAMP.search(task.problem).groups())  # type: ignore[union-attr]
    fn = function_name(task)
    right = sum(
        max(args[0], lo) == expected for args, expected in hidden_cases(task)
    )  # forgets the upper bound
    assert 0 < right < len(hidden_cases(task)), "the task must tell a wrong solution from a right one"
    trajectory, _ = await play(
        env, task, [f"write_file solution.py def {fn} ( x ) : return max ( x , {lo} )", "submit"]
    )
    assert trajectory.finish_reason == "submitted"
    assert trajectory.reward == pytest.approx(right / len(hidden_cases(task)))
    assert hi > lo


async def test_the_untouched_stub_scores_zero_and_work_counts_without_submit() -> None:
    env = PlainCodingEnvironment()
    task = task_of("affine")
    stub, _ = await play(env, task, ["list_files"])  # max turns, nothing written
    assert (stub.finish_reason, stub.reward) == ("max_turns", 0.0)
    worked, _ = await play(env, task, [affine_solution(task), "list_files"])
    assert (worked.finish_reason, worked.reward) == ("max_turns", 1.0)


async def test_three_replies_without_a_tool_call_end_the_episode_at_zero() -> None:
    env = PlainCodingEnvironment()
    task = task_of("affine")
    script = [affine_solution(task), "hello", "what", "hmm", "submit"]
    trajectory, _ = await play(env, task, script)
    assert (trajectory.finish_reason, trajectory.reward, trajectory.num_turns) == ("format_errors", 0.0, 4)


async def test_the_json_environment_runs_real_multi_line_code() -> None:
    env = CodingEnvironment()
    task = next(t for t in generate_tasks("train", 30, seed=1, levels=(3,)))
    messages, episode = await env.reset(task)
    assert isinstance(episode, CodingEpisode) and "solution.py" in messages[0].content
    reply = (
        "<tool_call>"
        + json.dumps(
            {
                "name": "write_file",
                "arguments": {"path": SOLUTION_FILE, "content": task.reference[SOLUTION_FILE]},
            }
        )
        + "</tool_call>"
    )
    call = env.parser.parse(reply, env.tools())
    assert call is not None
    assert (await episode.step(call)).observation.startswith("wrote ")
    ran = await episode.step(
        ToolCall("run", {"command": "python3 test_solution.py && sed -i 's/^/# /' README.md"})
    )
    assert "examples pass" in ran.observation
    assert episode.files["README.md"].startswith(b"# #")  # what a command changes comes back
    outcome = await episode.finish("submitted")
    assert outcome.reward == 1.0 and episode.score is not None and episode.score.source == "mixrl"


async def test_escaping_replies_are_contained(tmp_path: Path) -> None:
    env = CodingEnvironment(limits={"wall_s": 2.0, "cpu_s": 1, "processes": 16})
    task = task_of("affine")
    _, episode = await env.reset(task)
    assert isinstance(episode, CodingEpisode)
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    outside = tmp_path / "outside"
    wrote = await episode.step(ToolCall("write_file", {"path": f"../../..{outside}", "content": "x"}))
    assert wrote.observation.startswith("error: files: path") and not outside.exists()
    absolute = await episode.step(ToolCall("write_file", {"path": str(outside), "content": "x"}))
    assert "is absolute" in absolute.observation and not outside.exists()
    read = await episode.step(ToolCall("read_file", {"path": f"../../..{secret}"}))
    assert read.observation == f"error: no such file: ../../..{secret}"
    ran = await episode.step(ToolCall("run", {"command": f"cat {secret}; echo x > {outside}; sleep 100"}))
    assert ran.observation.startswith("exit code - (timeout: wall clock limit 2.0 s)")
    assert "host secret" not in ran.observation and not outside.exists()
    # `exec`: the wait after the bomb needs no fork of its own (CI saw the shell, unable to fork
    # `sleep` while the bomb held every process slot, end at once: "Cannot fork", exit code 2)
    bomb = await episode.step(ToolCall("run", {"command": "bomb() { bomb | bomb & }; bomb; exec sleep 100"}))
    assert "(timeout" in bomb.observation
    flood = await episode.step(ToolCall("run", {"command": "yes"}))
    assert "(output_limit" in flood.observation and len(flood.observation) < env.max_observation_chars + 100
    assert (await episode.finish("submitted")).reward == 0.0  # still the stub


async def test_the_test_run_is_sandboxed_too() -> None:
    env = CodingEnvironment(test_limits={"wall_s": 2.0})
    task = task_of("affine")
    _, episode = await env.reset(task)
    fn = function_name(task)
    await episode.step(
        ToolCall(
            "write_file",
            {"path": SOLUTION_FILE, "content": f"import time\ndef {fn}(x):\n    time.sleep(100)\n"},
        )
    )
    outcome = await episode.finish("submitted")
    assert outcome.reward == 0.0
    assert isinstance(episode, CodingEpisode) and episode.test_result is not None
    assert episode.test_result.finish_reason == "timeout"


async def test_a_solution_that_prints_a_forged_result_line_is_not_believed() -> None:
    env = CodingEnvironment()
    task = task_of("affine")
    _, episode = await env.reset(task)
    forged = "print('mixrl-tests 0 8 8')\nimport sys\nprint('mixrl-tests', sys.argv[-1], 8, 8)\ndef f(x):\n    return 0\n"
    await episode.step(ToolCall("write_file", {"path": SOLUTION_FILE, "content": forged}))
    assert (await episode.finish("submitted")).reward == 0.0


def test_the_registry_builds_it_and_loads_tasks_from_a_directory(tmp_path: Path) -> None:
    from mixrl.api.models import RolloutSpec

    env = load_environment("mixrl.rl.environments.coding:PlainCodingEnvironment", {"levels": [1, 2]})
    assert {t.level for t in load_tasks(env, "train", 10, 0)} == {1, 2}
    rollout = RolloutSpec.model_validate({"environment": "mixrl.rl.environments.coding:CodingEnvironment"})
    assert check_rollout(rollout) == []
    bad = RolloutSpec.model_validate(
        {
            "environment": "mixrl.rl.environments.coding:CodingEnvironment",
            "environmentArgs": {"limits": {"wall": 1}},
        }
    )
    assert check_rollout(bad) == [
        "spec.rollout.environmentArgs: mixrl.rl.environments.coding:CodingEnvironment refused them: "
        "limits: unknown ['wall']; known: " + str(sorted(CodingEnvironment().limits.__dataclass_fields__))
    ]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ({"limits": {"cpu_s": 10**40}}, "limits: limits.cpu_s: must be positive and at most 2**62, got 1"),
        (
            {"limits": {"wall_s": float("nan")}},
            "limits: limits.wall_s: must be positive and at most 2**62, got nan",
        ),
        ({"max_concurrent": 10**40}, "max_concurrent: a whole number from 1 to 2**31, got 1"),
        (
            {"max_observation_chars": float("inf")},
            "max_observation_chars: a whole number from 1 to 2**31, got inf",
        ),
        (
            {"max_observation_chars": "abc"},
            "max_observation_chars: a whole number from 1 to 2**31, got 'abc'",
        ),
        ({"levels": 5}, "levels: a list of levels among [1, 2, 3], got 5"),
    ],
)
def test_out_of_range_arguments_are_refused_in_one_line(args: dict, line: str) -> None:
    with pytest.raises(ValueError) as refused:
        CodingEnvironment(**args)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


def test_without_bubblewrap_the_environment_refuses_to_start() -> None:
    with pytest.raises(
        ValueError,
        match=r"runs every command in a sandbox: bubblewrap .* is not installed: apt-get install bubblewrap",
    ):
        CodingEnvironment(bwrap="/nonexistent/bwrap")
    with pytest.raises(
        ValueError,
        match="sandbox: bubblewrap could not build the sandbox: bwrap: Can't find source path /nope",
    ):
        CodingEnvironment(ro_paths=["/nope"])


def test_the_word_vocabulary_covers_an_oracle_one_liner() -> None:
    env = PlainCodingEnvironment()
    tokenizer = Tokenizer.from_words(env.vocabulary())
    task = task_of("affine")
    line = f"write_file solution.py def {function_name(task)} ( x ) : return 7 * x + 3"
    assert tokenizer.unk_id not in tokenizer.encode(line)
    assert os.path.basename(SOLUTION_FILE) in tokenizer.decode(tokenizer.encode(line))


async def test_many_episodes_at_once_keep_their_own_snapshots() -> None:
    env = CodingEnvironment(max_concurrent=4)
    tasks = generate_tasks("train", 6, seed=5)

    async def episode_of(task: CodingTask, solve: bool) -> float:
        _, episode = await env.reset(task)
        if solve:
            await episode.step(
                ToolCall("write_file", {"path": SOLUTION_FILE, "content": task.reference[SOLUTION_FILE]})
            )
        await episode.step(ToolCall("run", {"command": "python test_solution.py > ran.txt 2>&1"}))
        assert isinstance(episode, CodingEpisode) and "ran.txt" in episode.files
        return (await episode.finish("submitted")).reward

    rewards = await asyncio.gather(*(episode_of(task, solve=i % 2 == 0) for i, task in enumerate(tasks)))
    assert rewards == [1.0, 0.0] * 3


async def test_no_path_can_stand_in_the_hidden_tests_way() -> None:
    """The scoring copies the hidden tests over the snapshot, so a file named like a hidden test's
    directory, or one under a hidden test's path, would make both a file and a directory of one
    name: ``write_file`` refuses it in one line (as it refuses a clash among the snapshot's own
    files), and what a ``run`` leaves in their way gives way at scoring.  Either way the episode is
    scored, never a traceback."""
    env = CodingEnvironment()
    task = task_of("affine")
    assert list(task.hidden_tests) == ["test_hidden.py"]
    _, episode = await env.reset(task)
    assert isinstance(episode, CodingEpisode)
    refused = await episode.step(ToolCall("write_file", {"path": "test_hidden.py/x", "content": "x"}))
    assert refused.observation == (
        "error: test_hidden.py/x cannot exist: test_hidden.py is kept for the hidden tests "
        "(one would be the other's directory)"
    )
    assert "test_hidden.py/x" not in episode.files
    same = await episode.step(ToolCall("write_file", {"path": "./test_hidden.py", "content": "x"}))
    assert same.observation == "wrote 1 bytes to test_hidden.py"  # replaced by the hidden tests
    await episode.step(
        ToolCall("write_file", {"path": SOLUTION_FILE, "content": task.reference[SOLUTION_FILE]})
    )
    del episode.files["test_hidden.py"]
    ran = await episode.step(
        ToolCall("run", {"command": "mkdir test_hidden.py && echo x > test_hidden.py/x"})
    )
    assert ran.observation.startswith("exit code 0") and "test_hidden.py/x" in episode.files
    outcome = await episode.finish("submitted")
    assert outcome.reward == 1.0 and episode.score is not None and episode.score.source == "mixrl"

    nested = CodingTask(
        id="nested-0",
        split="train",
        problem="p",
        files={"README.md": "r", "tests/conftest.py": ""},
        hidden_tests={"tests/unit/test_a.py": "import sys\nsys.exit(0)\n"},
        test_command="python3 tests/unit/test_a.py",
    )
    _, episode = await env.reset(nested)
    assert isinstance(episode, CodingEpisode)
    for path in ("tests/unit", "tests/unit/test_a.py/b"):
        refused = await episode.step(ToolCall("write_file", {"path": path, "content": ""}))
        assert refused.observation.startswith(f"error: {path} cannot exist: tests/unit/test_a.py is kept")
    wrote = await episode.step(ToolCall("write_file", {"path": "tests/unit/other.py", "content": ""}))
    assert wrote.observation == "wrote 0 bytes to tests/unit/other.py"  # beside it: no clash
    await episode.step(ToolCall("run", {"command": "rm -r tests/unit && echo x > tests/unit"}))
    assert episode.files.get("tests/unit") == b"x\n"
    assert (await episode.finish("submitted")).reward == 1.0


async def test_an_argument_no_command_or_file_can_hold_is_answered_not_raised() -> None:
    """JSON lets a model send a NUL or a lone surrogate: the call gets an ``error:`` line like any
    bad call (it raised ValueError or UnicodeEncodeError and failed the whole episode)."""
    env = CodingEnvironment()
    task = task_of("affine")
    _, episode = await env.reset(task)
    assert isinstance(episode, CodingEpisode)
    before = dict(episode.files)
    for reply, line in (
        ('{"name": "run", "arguments": {"command": "echo a\\u0000b"}}', "error: command: holds a NUL"),
        (
            '{"name": "write_file", "arguments": {"path": "x.py", "content": "\\ud800"}}',
            "error: content: holds a lone surrogate",
        ),
        ('{"name": "read_file", "arguments": {"path": "\\udc80"}}', "error: path: holds a lone surrogate"),
        (
            '{"name": "run", "arguments": {"command": "echo \\ud800"}}',
            "error: command: holds a lone surrogate",
        ),
    ):
        call = env.parser.parse(f"<tool_call>{reply}</tool_call>", env.tools())
        assert call is not None, reply
        result = await episode.step(call)
        assert result.observation.startswith(line) and not result.done, result.observation
        result.observation.encode("utf-8")  # nothing a tokenizer cannot encode goes back
    assert episode.files == before


def test_levels_holding_fewer_tasks_than_the_sizes_ask_for_are_refused_at_once() -> None:
    from mixrl.api.models import RolloutSpec

    def check(dataset: dict[str, int]) -> list[str]:
        rollout = RolloutSpec.model_validate(
            {"environment": "coding-plain", "environmentArgs": {"levels": [1]}, "dataset": dataset}
        )
        return check_rollout(rollout)

    started = time.monotonic()
    # the default trainSize, 4096: the worker would refuse it only after minutes of generating tasks
    assert check({"heldoutSize": 8}) == [
        "spec.rollout.dataset.trainSize: 4096 is more than the 1536 train tasks levels [1] hold; "
        "at most 1536, or add levels"
    ]
    assert time.monotonic() - started < 2.0
    assert check({"trainSize": 64}) == [
        "spec.rollout.dataset.heldoutSize: 256 is more than the 228 heldout tasks levels [1] hold; "
        "at most 228, or add levels"
    ]
    assert check({"trainSize": 64, "heldoutSize": 8}) == []
    assert check({"trainSize": 1536, "heldoutSize": 228}) == []


@pytest.mark.parametrize(
    ("tools", "problems"),
    [
        # (an empty list mixrl.api refuses by itself)
        (
            ["list_files", "read_file", "submit"],
            ["spec.rollout.tools: without write_file or run no episode can earn a reward"],
        ),
        (["run"], []),  # the work done counts without submit
        (["write_file", "submit"], []),
        (None, []),
    ],
)
def test_tools_that_cannot_change_the_repository_are_refused(
    tools: list[str] | None, problems: list[str]
) -> None:
    from mixrl.api.models import RolloutSpec

    rollout = RolloutSpec.model_validate(
        {"environment": "coding", "tools": tools, "dataset": {"trainSize": 64, "heldoutSize": 8}}
    )
    assert check_rollout(rollout) == problems
