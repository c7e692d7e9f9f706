"""The environment API: tool-call parsers, datasets, the registry, and the agent loop playing a user's
own environment (a package written to tmp_path, imported as the rollout worker imports it)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixrl.api.models import RolloutSpec
from mixrl.api.resolve import SamplingParams
from mixrl.rl.environments.base import Environment, Message, NoTaskGenerator, Task
from mixrl.rl.environments.datasets import DatasetError, load_tasks, read_records
from mixrl.rl.environments.filetree import FileTreeEnvironment
from mixrl.rl.environments.registry import (
    EnvironmentUnavailable,
    check_rollout,
    load_environment,
    offered_tools,
)
from mixrl.rl.environments.tools import JsonToolCallParser, PlainTextParser, Tool, ToolCall
from mixrl.rl.rollout.agent import ScoringFailed, run_episode
from mixrl.rl.rollout.tokenizer import Tokenizer

from .conftest import USER_ENVIRONMENT, USER_PACKAGE, ScriptedReplies, write_user_package, write_words

SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=16, top_logprobs_num=0, return_sampling_mask=False
)
READ = Tool(
    "read",
    "Read lines of a file.",
    {
        "type": "object",
        "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
        "required": ["path"],
    },
)
WRITE = Tool(
    "write",
    parameters={
        "type": "object",
        "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
        "required": ["path", "text"],
    },
)
STOP = Tool("stop")


@pytest.fixture
def user_package(tmp_path: Path) -> Iterator[Path]:
    root = write_user_package(tmp_path / "site")
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == USER_PACKAGE or m.startswith(USER_PACKAGE + ".")]:
            del sys.modules[name]


# ----------------------------------------------------------------------------- tools and parsers


@pytest.mark.parametrize(
    ("reply", "call"),
    [
        ("stop", ToolCall("stop", {})),
        ("read a.py 3", ToolCall("read", {"path": "a.py", "lines": 3})),
        ("read a.py three", None),  # not an integer
        ("read a.py", None),  # plain text fills every parameter
        ("write a.py x = 1", ToolCall("write", {"path": "a.py", "text": "x = 1"})),
        ("write a.py", None),
        ("stop now", None),
        ("run a.py", None),
        ("", None),
    ],
)
def test_plain_text_calls_fill_parameters_in_schema_order(reply: str, call: ToolCall | None) -> None:
    assert PlainTextParser(rest_of_reply=("write",)).parse(reply, [READ, WRITE, STOP]) == call


@pytest.mark.parametrize(
    ("reply", "call"),
    [
        (
            '<tool_call>{"name": "read", "arguments": {"path": "a.py"}}</tool_call>',
            ToolCall("read", {"path": "a.py"}),
        ),
        ('thinking... <tool_call>\n{"name": "stop"}\n</tool_call>', ToolCall("stop", {})),
        (
            '{"name": "read", "arguments": "{\\"path\\": \\"b\\", \\"lines\\": 2}"}',
            ToolCall("read", {"path": "b", "lines": 2}),
        ),
        ('<tool_call>{"name": "stop"}</tool_call><tool_call>{"name": "stop"}</tool_call>', None),
        ('{"name": "read", "arguments": {}}', None),  # a required argument missing
        ('{"name": "read", "arguments": {"path": "a", "mode": "w"}}', None),  # an unknown one
        ('{"name": "read", "arguments": {"path": "a", "lines": true}}', None),  # a bool is no integer
        ('{"name": "read", "arguments": {"path": 7}}', None),
        ('{"name": "rm", "arguments": {}}', None),
        ("<tool_call>not json</tool_call>", None),
        ("stop", None),
    ],
)
def test_json_calls_follow_the_hermes_convention(reply: str, call: ToolCall | None) -> None:
    assert JsonToolCallParser().parse(reply, [READ, WRITE, STOP]) == call


def test_a_tool_not_offered_is_no_call_and_tools_render_as_openai_functions() -> None:
    assert PlainTextParser().parse("stop", [READ]) is None
    assert READ.schema() == {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read lines of a file.",
            "parameters": dict(READ.parameters),
        },
    }
    with pytest.raises(ValueError, match="tool name: must be one word"):
        Tool("two words")
    with pytest.raises(ValueError, match="tool x: parameters must be a JSON Schema of type object"):
        Tool("x", parameters={"type": "string"})


# ----------------------------------------------------------------------------- datasets


def test_jsonl_and_parquet_give_the_same_rows(tmp_path: Path) -> None:
    rows = [{"id": f"t{i}", "word": w, "n": i} for i, w in enumerate(["apple", "pear", "fig"])]
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    parquet = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=1)  # several batches
    assert read_records(jsonl) == read_records(parquet) == rows
    assert read_records(jsonl, limit=2) == read_records(parquet, limit=2) == rows[:2]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '{"id": 1}\n{"id": \n', "bad.jsonl:2: not JSON"),
        ("list.jsonl", "[1, 2]\n", "list.jsonl:1: a row must be a JSON object, got list"),
        ("fake.parquet", "not parquet", "fake.parquet: not a Parquet file"),
        ("tasks.csv", "a,b\n", "tasks.csv: a dataset is a .jsonl or .parquet file"),
    ],
)
def test_a_bad_dataset_file_gets_one_line(tmp_path: Path, name: str, content: str, message: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(DatasetError, match=message.replace(".", r"\.")):
        read_records(tmp_path / name)
    with pytest.raises(DatasetError, match="no such file"):
        read_records(tmp_path / "missing.jsonl")


class Minimal(Environment[Task]):
    """Only what the API requires: tools and reset; tasks come from files."""

    def tools(self) -> list[Tool]:
        return [STOP]

    async def reset(self, task: Task) -> tuple[list[Any], Any]:
        raise NotImplementedError  # never played here


def test_tasks_from_rows_get_ids_and_a_duplicate_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 7, "q": "a"}\n{"q": "b"}\n{"q": "c"}\n')
    tasks = load_tasks(Minimal(), "heldout", 2, seed=0, path=path)
    assert tasks[0].id == "7" and tasks[1].id.startswith("heldout-1-")
    assert [(t.split, t.data["q"]) for t in tasks] == [("heldout", "a"), ("heldout", "b")]
    path.write_text('{"id": "x"}\n{"id": "x"}\n')
    with pytest.raises(DatasetError, match="task id 'x' appears twice"):
        load_tasks(Minimal(), "train", 10, seed=0, path=path)
    with pytest.raises(NoTaskGenerator):
        load_tasks(Minimal(), "train", 10, seed=0)
    # filetree reads its own tasks from rows, and names the row it cannot read
    path.write_text('{"files": {}}\n')
    with pytest.raises(
        DatasetError, match="FileTreeEnvironment cannot read a row: row 0: question: Field required"
    ):
        load_tasks(FileTreeEnvironment(), "train", 1, seed=0, path=path)


# ----------------------------------------------------------------------------- the registry


def test_the_built_in_resolves_by_name_and_a_users_by_import_path(user_package: Path) -> None:
    assert isinstance(load_environment("filetree", {"files": 2}), FileTreeEnvironment)
    env = load_environment(USER_ENVIRONMENT, {"prefix": "echo"})
    assert [t.name for t in offered_tools(env, None)] == ["say", "look"]
    assert [t.name for t in offered_tools(env, ["look"])] == ["look"]
    with pytest.raises(
        EnvironmentUnavailable,
        match=r"spec\.rollout\.tools: \['bash'\] not offered by EchoEnv \(it has say, look\)",
    ):
        offered_tools(env, ["say", "bash"])


@pytest.mark.parametrize(
    ("environment", "args", "line"),
    [
        (
            "swebench",
            {},
            "spec.rollout.environment: unknown environment 'swebench'; built in: filetree, coding, coding-plain",
        ),
        ("nowhere.envs:X", {}, "spec.rollout.environment: cannot import 'nowhere.envs' (ModuleNotFoundError"),
        (
            f"{USER_PACKAGE}.echo:Missing",
            {},
            f"spec.rollout.environment: module '{USER_PACKAGE}.echo' has no 'Missing'",
        ),
        (
            f"{USER_PACKAGE}.echo:NotAnEnvironment",
            {},
            "is not a subclass of mixrl.rl.environments.base.Environment",
        ),
        (
            f"{USER_PACKAGE}.echo:EchoEpisode",
            {},
            "is not a subclass of mixrl.rl.environments.base.Environment",
        ),
        (USER_ENVIRONMENT, {"prefx": "a"}, "spec.rollout.environmentArgs: my_envs.echo:EchoEnv refused them"),
    ],
)
def test_an_environment_that_cannot_be_used_is_one_line(
    user_package: Path, environment: str, args: dict[str, Any], line: str
) -> None:
    with pytest.raises(EnvironmentUnavailable) as caught:
        load_environment(environment, args)
    assert line in str(caught.value) and "\n" not in str(caught.value)


def test_an_abstract_environment_names_what_it_lacks(tmp_path: Path, user_package: Path) -> None:
    (user_package / USER_PACKAGE / "half.py").write_text(
        "from mixrl.rl.environments.base import Environment\n\nclass Half(Environment):\n"
        "    def tools(self):\n        return ()\n"
    )
    with pytest.raises(EnvironmentUnavailable, match=r"my_envs\.half:Half does not implement reset"):
        load_environment(f"{USER_PACKAGE}.half:Half")


def test_check_rollout_wants_tasks_for_both_splits(tmp_path: Path, user_package: Path) -> None:
    spec = RolloutSpec(environment=USER_ENVIRONMENT)
    assert check_rollout(spec) == [
        f"spec.rollout.dataset.{split}: {USER_ENVIRONMENT} generates no tasks; name a JSONL or Parquet file"
        for split in ("train", "heldout")
    ]
    train = write_words(tmp_path / "train.jsonl", ["apple"])
    named = RolloutSpec(
        environment=USER_ENVIRONMENT,
        dataset={"train": str(train), "heldout": str(tmp_path / "heldout.jsonl")},
    )
    assert check_rollout(named) == [
        f"spec.rollout.dataset.heldout: no such file {tmp_path / 'heldout.jsonl'}"
    ]
    assert check_rollout(named, check_files=False) == []
    assert check_rollout(RolloutSpec()) == []


# ----------------------------------------------------------------------------- the agent loop


async def play_echo(env: Environment[Any], script: list[str], **settings: Any) -> tuple[Any, ScriptedReplies]:
    tokenizer = Tokenizer.from_words(env.vocabulary() or ())
    generate = ScriptedReplies(tokenizer, script)
    task = Task("w0", "train", {"word": "pear"})
    trajectory = await run_episode(generate, env, task, tokenizer, SAMPLING, 6, 512, 2, **settings)
    return trajectory, generate


async def test_a_users_environment_plays_its_episode_and_is_closed(user_package: Path) -> None:
    env = load_environment(USER_ENVIRONMENT, {"prefix": "echo"})
    trajectory, generate = await play_echo(env, ["look", "what", "say pear"], max_observation_tokens=5)
    assert (trajectory.finish_reason, trajectory.reward, trajectory.num_turns) == ("said", 1.0, 3)
    tokenizer = generate.tokenizer
    assert generate.received[0] == tokenizer.chat_prompt_ids([Message("user", "echo pear")])
    # the 50-word observation was cut to 5 tokens; the nudge is the environment's own
    observations = generate.received[1][len(generate.received[0]) + 2 :]
    assert observations == tokenizer.observation_ids("tool", " ".join(["look"] * 5))
    assert (
        tokenizer.decode(generate.received[2][len(generate.received[1]) + 2 :])
        == "<|user|> say a word <|end|> <|assistant|>"
    )
    assert env.closed == ["closed"]


async def test_mixrl_ends_what_the_environment_does_not(user_package: Path) -> None:
    env = load_environment(USER_ENVIRONMENT)
    trajectory, _ = await play_echo(env, ["hello", "hello"])
    assert (trajectory.finish_reason, trajectory.reward) == ("format_errors", 0.0)
    trajectory, _ = await play_echo(env, ["look"] * 6)
    assert (trajectory.finish_reason, trajectory.reward) == ("max_turns", 0.0)
    # a tool the spec does not offer is no call
    say_only = offered_tools(env, ["say"])
    trajectory, _ = await play_echo(env, ["look", "look"], tools=say_only)
    assert trajectory.finish_reason == "format_errors"
    assert env.closed == ["closed"] * 3


async def test_a_bad_finish_reason_is_refused_and_the_episode_still_closed(user_package: Path) -> None:
    env = load_environment(USER_ENVIRONMENT)
    module = sys.modules[f"{USER_PACKAGE}.echo"]
    original = module.EchoEpisode.finish

    async def shouting(self: Any, reason: str) -> Any:
        return module.Outcome(1.0, "SAID IT")

    module.EchoEpisode.finish = shouting
    try:
        with pytest.raises(  # the episode fails (its group dropped), never the worker
            ScoringFailed,
            match="EchoEnv: scoring task 'w0': finish reason 'SAID IT' is not a short lower-case word",
        ):
            await play_echo(env, ["say pear"])
    finally:
        module.EchoEpisode.finish = original
    assert env.closed == ["closed"]


def test_the_rollout_worker_refuses_an_unusable_environment_or_dataset_with_one_line(
    tmp_path: Path, user_package: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mixrl.rl.rollout.worker import main

    from ..rollout.test_worker import resolved_run

    def start(**rollout: Any) -> str:
        config = tmp_path / "resolved.json"
        config.write_text(resolved_run(**rollout).model_dump_json())
        args = ["--config", str(config), "--router", "http://x", "--buffer", "http://y", "--insecure-no-auth"]
        assert main(args) == 2
        return capsys.readouterr().err.strip()

    assert start(environment="nowhere.envs:X").startswith(
        "mixrl rollout: spec.rollout.environment: cannot import 'nowhere.envs' (ModuleNotFoundError"
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "a", "word": "fig"}\n')
    files = {"train": str(rows), "heldout": str(tmp_path / "none.jsonl")}
    assert start(environment=USER_ENVIRONMENT, dataset=files) == (
        f"mixrl rollout: spec.rollout.dataset.heldout: no such file {tmp_path / 'none.jsonl'}"
    )
    rows.write_text('{"id": "a"}\n{"id": "a"}\n')
    files["heldout"] = str(rows)
    assert start(environment=USER_ENVIRONMENT, dataset=files) == (
        f"mixrl rollout: {rows}: task id 'a' appears twice"
    )


def test_an_environment_whose_own_code_raises_anything_is_one_line(user_package: Path) -> None:
    # Not only the TypeError/ValueError of a refusal: any exception, which would otherwise be a
    # traceback that stops mixrl validate before the files after this one.
    (user_package / USER_PACKAGE / "crash.py").write_text(
        "from mixrl.rl.environments.base import Environment, Task\n"
        "from mixrl.rl.environments.tools import Tool\n\n"
        "class Crash(Environment):\n"
        "    def __init__(self, fail_in=''):\n"
        "        if fail_in == 'init':\n"
        "            raise AttributeError('no attribute NoSuch')\n"
        "        self.fail_in = fail_in\n"
        "    def tools(self):\n"
        "        if self.fail_in == 'tools':\n"
        "            raise RuntimeError()\n"
        "        return (Tool('stop'),)\n"
        "    async def reset(self, task):\n"
        "        raise NotImplementedError\n"
        "    def generate_tasks(self, split, n, seed):\n"
        "        if self.fail_in == 'tasks':\n"
        "            raise KeyError(split)\n"
        "        return [Task(f'{split}-{i}', split, {}) for i in range(n)]\n"
        "    def rollout_problems(self, rollout):\n"
        "        if self.fail_in == 'check':\n"
        "            raise OSError('cannot\\nlook')\n"
        "        return ['spec.rollout.maxTurns: crash wants fewer'] if rollout.max_turns > 16 else []\n"
    )
    name = f"{USER_PACKAGE}.crash:Crash"

    def check(fail_in: str, **rollout: Any) -> list[str]:
        return check_rollout(RolloutSpec(environment=name, environment_args={"fail_in": fail_in}, **rollout))

    assert check("init") == [
        f"spec.rollout.environmentArgs: {name} refused them: AttributeError: no attribute NoSuch"
    ]
    assert check("tools") == ["spec.rollout.environment: Crash.tools() failed: RuntimeError"]
    assert check("tasks") == [
        f"spec.rollout.dataset.{split}: {name} cannot generate a task: KeyError: '{split}'"
        for split in ("train", "heldout")
    ]
    assert check("check") == [
        f"spec.rollout.environment: {name} failed checking the spec: OSError: cannot look"
    ]
    # the environment's own check of the spec (registry.ChecksRollout) adds its lines
    assert check("", max_turns=17) == ["spec.rollout.maxTurns: crash wants fewer"]
    assert check("") == []
