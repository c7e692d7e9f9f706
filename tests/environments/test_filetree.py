"""The filetree task family: determinism, disjoint splits, the checker, the environment and tool parsing."""

from __future__ import annotations

import hashlib

import pytest

from mixrl.rl.environments.filetree import (
    EXTENSIONS,
    HELDOUT_BUCKETS,
    NO_SUCH_FILE,
    Difficulty,
    FileTreeEnvironment,
    FileTreeEpisode,
    FileTreeTask,
    check,
    generate_tasks,
)
from mixrl.rl.environments.tools import ToolCall

ENV = FileTreeEnvironment()


def parse_tool_call(reply: str, tools: tuple[str, ...] = ("ls", "cat", "submit")) -> ToolCall | None:
    return ENV.parser.parse(reply, [tool for tool in ENV.tools() if tool.name in tools])


def answer_tuple(task: FileTreeTask) -> tuple[str, str, str, str]:
    path = next(p for p in task.files if p.rsplit(".", 1)[0] == task.section)
    key, value = task.answer.split()
    return task.section, path[len(task.section) :], key, value


def test_generation_is_deterministic_and_prefix_stable() -> None:
    first = generate_tasks(7, 50, "train")
    assert first == generate_tasks(7, 50, "train")
    assert generate_tasks(7, 20, "train") == first[:20]
    assert generate_tasks(8, 50, "train") != first
    assert len({t.id for t in first}) == 50


def test_splits_never_share_a_task_or_an_answer() -> None:
    train = generate_tasks(0, 3000, "train")
    heldout = generate_tasks(0, 300, "heldout")
    assert all(t.split == "train" for t in train) and all(t.split == "heldout" for t in heldout)
    assert not {t.id for t in train} & {t.id for t in heldout}
    # stronger: what determines an answer (section, extension, key, value) is never shared
    assert not {answer_tuple(t) for t in train} & {answer_tuple(t) for t in heldout}
    # and the split is the documented hash rule, recomputed here independently
    for task in heldout[:50] + train[:50]:
        digest = hashlib.sha256("|".join(answer_tuple(task)).encode()).digest()
        assert (digest[0] % HELDOUT_BUCKETS == 0) == (task.split == "heldout")


def test_tree_shape_follows_difficulty() -> None:
    for difficulty in (Difficulty(), Difficulty(files=5, lines=3, extensions=1)):
        for task in generate_tasks(1, 30, "train", difficulty):
            assert len(task.files) == difficulty.files
            assert all(len(text.split("\n")) == difficulty.lines for text in task.files.values())
            assert {p[p.index(".") :] for p in task.files} <= set(EXTENSIONS[: difficulty.extensions])
            assert sum(p.rsplit(".", 1)[0] == task.section for p in task.files) == 1
            assert task.question == f"what is {task.key} in {task.section} ?"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"files": 0}, "files: must be between 1 and 12, got 0"),
        ({"lines": 13}, "lines: must be between 1 and 12, got 13"),
        ({"extensions": 5}, "extensions: must be between 1 and 4, got 5"),
    ],
)
def test_bad_difficulty_gets_one_line(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Difficulty(**kwargs)


def test_bad_generation_arguments() -> None:
    with pytest.raises(ValueError, match="split: expected one of train, heldout, got 'test'"):
        generate_tasks(0, 1, "test")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n: must be non-negative"):
        generate_tasks(0, -1, "train")
    # a single file with one line: few distinct trees exist; asking for more says so
    with pytest.raises(ValueError, match=r"n: only \d+ distinct heldout tasks exist"):
        generate_tasks(0, 10_000, "heldout", Difficulty(files=1, lines=1, extensions=1))


def test_checker_accepts_exactly_the_asked_line() -> None:
    task = generate_tasks(0, 1, "train", Difficulty(files=3, lines=3))[0]
    key, value = task.answer.split()
    assert check(task, f"{key} {value}")
    assert check(task, f"  {key}   {value} ")  # whitespace is not part of the answer
    assert not check(task, value)  # the key is part of the answer
    assert not check(task, f"{key} {int(value) + 1}")
    assert not check(task, f"{key} {value} extra")
    elsewhere = {
        line
        for path, text in task.files.items()
        if path.rsplit(".", 1)[0] != task.section
        for line in text.split("\n")
    }
    assert elsewhere - {task.answer} and not any(check(task, line) for line in elsewhere - {task.answer})


def test_checker_rebuilds_a_fresh_environment() -> None:
    """The checker reads the files of a new environment, so nothing an episode did can matter."""
    task = generate_tasks(0, 1, "train")[0]
    used = FileTreeEpisode(task)
    used._files.clear()  # an episode's environment, however damaged
    assert check(task, task.answer)
    assert FileTreeEpisode(task).list_files() == sorted(task.files)
    # the checker derives the answer from the tree, not from task.answer
    key, value = task.answer.split()
    forged = task.model_copy(update={"answer": f"{key} {int(value) + 1}"})
    assert check(forged, task.answer) and not check(forged, forged.answer)


@pytest.mark.parametrize(
    ("reply", "call"),
    [
        ("ls", ToolCall("ls")),
        ("  ls  ", ToolCall("ls")),
        ("cat net.cfg", ToolCall("cat", {"path": "net.cfg"})),
        ("submit port 42", ToolCall("submit", {"answer": "port 42"})),
        ("submit  port   42 ", ToolCall("submit", {"answer": "port 42"})),
        ("ls net.cfg", None),
        ("cat", None),
        ("cat a.cfg b.cfg", None),
        ("submit", None),
        ("", None),
        ("what is port", None),
        ("rm net.cfg", None),
    ],
)
def test_tool_call_parsing(reply: str, call: ToolCall | None) -> None:
    assert parse_tool_call(reply) == call


def test_tools_not_offered_are_not_calls() -> None:
    assert parse_tool_call("ls", tools=("cat", "submit")) is None
    assert parse_tool_call("cat a.cfg", tools=("cat", "submit")) == ToolCall("cat", {"path": "a.cfg"})


async def test_tool_outputs_and_rewards() -> None:
    task = generate_tasks(0, 1, "train")[0]
    messages, episode = await ENV.reset(task)
    assert [(m.role, m.content) for m in messages] == [("user", task.question)]
    listing = await episode.step(ToolCall("ls"))
    assert (listing.role, listing.observation, listing.done) == ("tool", " ".join(sorted(task.files)), False)
    path = sorted(task.files)[1]
    assert (await episode.step(ToolCall("cat", {"path": path}))).observation == task.files[path]
    assert (await episode.step(ToolCall("cat", {"path": "nope.cfg"}))).observation == NO_SUCH_FILE
    assert (ENV.no_tool_call.role, ENV.no_tool_call.content) == ("user", "no tool call")
    submitted = await episode.step(ToolCall("submit", {"answer": task.answer}))
    assert (submitted.done, submitted.finish_reason) == (True, "submitted")
    outcome = await episode.finish("submitted")
    assert (outcome.reward, outcome.finish_reason) == (1.0, "submitted")
    # a right answer counts only when the episode ended by submitting it
    assert (await episode.finish("max_turns")).reward == 0.0
    _, wrong = await ENV.reset(task)
    await wrong.step(ToolCall("submit", {"answer": "port 1000"}))
    assert (await wrong.finish("submitted")).reward == 0.0


def test_environment_args_are_the_difficulty() -> None:
    env = FileTreeEnvironment(files=5, lines=2)
    assert all(len(t.files) == 5 for t in env.generate_tasks("train", 10, 3))
    assert env.generate_tasks("train", 10, 3) == generate_tasks(3, 10, "train", Difficulty(files=5, lines=2))
    with pytest.raises(ValueError, match="files: must be between 1 and 12"):
        FileTreeEnvironment(files=13)


def test_tasks_read_from_rows_keep_their_fields_and_take_the_file_split() -> None:
    task = generate_tasks(0, 1, "train")[0]
    row = task.model_dump()
    assert ENV.task_from_record(row, "heldout", 0) == task.model_copy(update={"split": "heldout"})
    del row["id"]
    assert ENV.task_from_record(row, "train", 7).id == "ft-train-7"
    with pytest.raises(ValueError, match="row 3: question: Field required"):
        ENV.task_from_record({"files": {}, "section": "a", "key": "b", "answer": "c"}, "train", 3)
