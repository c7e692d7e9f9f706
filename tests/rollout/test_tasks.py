"""The filetree task family: determinism, disjoint splits, the checker, the environment and tool parsing."""

from __future__ import annotations

import hashlib

import pytest

from mixrl.rl.rollout.env import NO_SUCH_FILE, NO_TOOL_CALL, FileTreeEnv, ToolCall, check, parse_tool_call
from mixrl.rl.rollout.tasks import EXTENSIONS, HELDOUT_BUCKETS, Difficulty, Task, generate_tasks


def answer_tuple(task: Task) -> tuple[str, str, str, str]:
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
    used = FileTreeEnv(task)
    used._files.clear()  # an episode's environment, however damaged
    assert check(task, task.answer)
    assert FileTreeEnv(task).list_files() == sorted(task.files)
    # the checker derives the answer from the tree, not from task.answer
    key, value = task.answer.split()
    forged = task.model_copy(update={"answer": f"{key} {int(value) + 1}"})
    assert check(forged, task.answer) and not check(forged, forged.answer)


@pytest.mark.parametrize(
    ("reply", "call"),
    [
        ("ls", ToolCall("ls")),
        ("  ls  ", ToolCall("ls")),
        ("cat net.cfg", ToolCall("cat", "net.cfg")),
        ("submit port 42", ToolCall("submit", "port 42")),
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
    assert parse_tool_call("cat a.cfg", tools=("cat", "submit")) == ToolCall("cat", "a.cfg")


def test_tool_outputs() -> None:
    task = generate_tasks(0, 1, "train")[0]
    env = FileTreeEnv(task)
    listing = env.run_tool(ToolCall("ls"))
    assert listing.role == "tool" and listing.text == " ".join(sorted(task.files))
    path = sorted(task.files)[1]
    assert env.run_tool(ToolCall("cat", path)).text == task.files[path]
    assert env.run_tool(ToolCall("cat", "nope.cfg")).text == NO_SUCH_FILE
    assert env.no_tool_call().role == "user" and env.no_tool_call().text == NO_TOOL_CALL
    with pytest.raises(ValueError, match="submit ends the episode"):
        env.run_tool(ToolCall("submit", "x 1"))
