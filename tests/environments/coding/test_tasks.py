"""The generated coding tasks, the SWE-style loader and the scoring rules (no sandbox needed)."""

from __future__ import annotations

import ast
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from mixrl.rl.environments.coding import scoring
from mixrl.rl.environments.coding.scoring import score
from mixrl.rl.environments.coding.swe import TaskSetError, load_task_dir, task_from_record
from mixrl.rl.environments.coding.tasks import (
    FAMILIES,
    HIDDEN_CASES,
    HIDDEN_TEST_FILE,
    MAX_OUTPUT_CHARS,
    SOLUTION_FILE,
    capacity,
    generate_tasks,
)

Score = scoring.TestScore


def test_generation_is_deterministic_and_the_splits_do_not_share_a_task() -> None:
    train, again = generate_tasks("train", 40, seed=3), generate_tasks("train", 40, seed=3)
    heldout = generate_tasks("heldout", 20, seed=3)
    assert [t.id for t in train] == [t.id for t in again] and train == again
    assert len({t.id for t in train}) == 40 and not {t.id for t in train} & {t.id for t in heldout}
    assert {t.level for t in train} == {1, 2, 3} and {t.split for t in heldout} == {"heldout"}
    assert [t.id for t in generate_tasks("train", 40, seed=4)] != [t.id for t in train]


def test_levels_pick_the_families() -> None:
    tasks = generate_tasks("train", 12, seed=0, levels=(3,))
    assert {t.level for t in tasks} == {3}
    assert {t.id.rsplit("-", 1)[0] for t in tasks} == {f.name for f in FAMILIES if f.level == 3}


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"levels": (4,)}, "levels: each must be one of"), ({"n": -1}, "n: must be")]
)
def test_bad_generation_arguments_name_the_argument(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"split": "train", "n": 3, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=message):
        generate_tasks(**arguments)  # type: ignore[arg-type]


def test_a_task_hides_its_tests_and_its_stub_fails_them() -> None:
    task = generate_tasks("train", 1, seed=0)[0]
    assert set(task.files) == {SOLUTION_FILE, "test_solution.py", "README.md"}
    assert set(task.hidden_tests) == {HIDDEN_TEST_FILE} and HIDDEN_TEST_FILE not in task.files
    assert "raise NotImplementedError" in task.files[SOLUTION_FILE]
    assert "{nonce}" in task.test_command


def test_the_result_line_needs_the_runs_nonce() -> None:
    forged = "mixrl-tests 0000 8 8\n"
    assert score(forged + "mixrl-tests abcd 3 8\n", 0, "abcd").share == 3 / 8
    assert score(forged, 1, "abcd").source == "exit_code"
    assert score(forged, 1, "abcd").share == 0.0
    # a second line with the nonce is someone else's, before the runner's or after it
    for two in (
        "mixrl-tests abcd 3 8\nmixrl-tests abcd 8 8\n",
        "mixrl-tests abcd 8 8\nmixrl-tests abcd 3 8\n",
    ):
        assert score(two, 0, "abcd") == Score(0, 1, "mixrl")


ANSWERS = ("15", "[1, 2]", '"ab"')


@pytest.mark.parametrize(
    ("output", "passed"),
    [
        ('mixrl-outputs abcd ["15","[1, 2]","\\"ab\\""]', 3),
        # re-encoded on the host: the sandbox's spelling of the same JSON does not matter
        ('noise\nmixrl-outputs abcd ["15","[1,2]","\\"ab\\""]\nmore noise', 3),
        ('mixrl-outputs abcd ["16",null,"\\"ab\\""]', 1),
        ('mixrl-outputs abcd ["15.0","[2, 1]","ab"]', 0),  # not JSON, or not the same
        # exactly one line with the nonce: a second one, first or last, scores 0
        ('mixrl-outputs abcd ["15","[1, 2]","\\"ab\\""]\nmixrl-outputs abcd [null,null,null]', 0),
        ('mixrl-outputs abcd [null,null,null]\nmixrl-outputs abcd ["15","[1, 2]","\\"ab\\""]', 0),
        ('mixrl-outputs 0000 ["15","[1, 2]","\\"ab\\""]', 0),
        # no line: whatever else the output says, whatever the exit status
        ("Ran 3 tests in 0.001s\n\nOK\n==== 3 passed in 0.01s ====\nmixrl-tests abcd 3 3", 0),
        ('mixrl-outputs abcd ["15","[1, 2]"]', 0),  # not one output per answer
        ("mixrl-outputs abcd [15, [1, 2], ", 0),
        ('mixrl-outputs abcd {"0": "15"}', 0),
    ],
)
def test_outputs_are_compared_with_the_answers_on_the_host(output: str, passed: int) -> None:
    assert score(output, 0, "abcd", ANSWERS) == Score(passed, 3, "mixrl")


def test_outputs_without_answers_score_0() -> None:
    assert score('mixrl-outputs abcd ["15"]\nRan 1 test in 0.1s\n\nOK', 0, "abcd") == Score(0, 1, "mixrl")
    assert score('mixrl-outputs 0000 ["15"]', 0, "abcd").source == "exit_code"


def test_the_answers_are_the_references_outputs_and_stay_on_the_host() -> None:
    for task in generate_tasks("train", 30, seed=1):
        assert len(task.answers) == HIDDEN_CASES and all(len(a) <= MAX_OUTPUT_CHARS for a in task.answers)
        runner = task.hidden_tests[HIDDEN_TEST_FILE]
        assert "mixrl-outputs" in runner and "expected" not in runner
        # the runner holds the inputs alone; the answers are the reference's outputs on them
        match = re.search(r"json\.loads\((.*)\)\n", runner)
        assert match is not None
        inputs = json.loads(ast.literal_eval(match.group(1)))
        namespace: dict[str, Any] = {}
        exec(task.reference[SOLUTION_FILE], namespace)
        (fn,) = (value for name, value in namespace.items() if not name.startswith("__"))
        assert task.answers == tuple(json.dumps(fn(*args), sort_keys=True) for args in inputs)


@pytest.mark.parametrize(
    ("output", "exit_code", "share", "source"),
    [
        ("==== 3 passed, 1 failed in 0.12s ====", 1, 0.75, "pytest"),
        ("=== 2 passed, 1 error, 1 skipped in 1.0s ===", 1, 2 / 3, "pytest"),
        ("....\n----\nRan 5 tests in 0.001s\n\nFAILED (failures=1, errors=1)", 1, 0.6, "unittest"),
        ("Ran 4 tests in 0.001s\n\nOK", 0, 1.0, "unittest"),
        ("nothing I know", 0, 1.0, "exit_code"),
        ("nothing I know", None, 0.0, "exit_code"),
    ],
)
def test_test_frameworks_summaries(output: str, exit_code: int | None, share: float, source: str) -> None:
    result = score(output, exit_code, "n")
    assert (result.share, result.source) == (pytest.approx(share), source)


def write_task(root: Path, name: str, split: str | None = "train") -> Path:
    task = root / name
    (task / "repo" / "pkg").mkdir(parents=True)
    (task / "repo" / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (task / "repo" / ".git").mkdir()
    (task / "repo" / ".git" / "HEAD").write_text("ref")
    (task / "repo" / "logo.png").write_bytes(b"\x89PNG\xff\xfe")
    (task / "tests").mkdir()
    (task / "tests" / "test_mod.py").write_text("from pkg.mod import f\n")
    spec = {"problem_statement": "make f return 2", "test_command": "python3 -m unittest -v"}
    (task / "task.json").write_text(json.dumps(spec | ({"split": split} if split else {})))
    return task


def test_a_task_directory_in_the_swe_layout(tmp_path: Path) -> None:
    write_task(tmp_path, "b-task")
    write_task(tmp_path, "a-task")
    write_task(tmp_path, "c-held", split="heldout")
    tasks = load_task_dir(tmp_path, "train")
    assert [t.id for t in tasks] == ["a-task", "b-task"]
    assert tasks[0].files == {"pkg/mod.py": "def f():\n    return 1\n"}  # .git and the binary left out
    assert tasks[0].hidden_tests == {"test_mod.py": "from pkg.mod import f\n"}
    assert tasks[0].problem == "make f return 2" and tasks[0].test_command == "python3 -m unittest -v"
    assert [t.id for t in load_task_dir(tmp_path, "heldout")] == ["c-held"]


def test_a_jsonl_row_in_the_swe_style(tmp_path: Path) -> None:
    task_dir = write_task(tmp_path, "t")
    row = {
        "instance_id": "t-1",
        "repo": "t/repo",
        "problem_statement": "p",
        "test_command": "true",
        "hidden_tests": "t/tests",
    }
    task = task_from_record(row, "heldout", 0, tmp_path)
    assert (task.id, task.split, task.problem) == ("t-1", "heldout", "p")
    assert task.files == {"pkg/mod.py": (task_dir / "repo/pkg/mod.py").read_text()}
    assert set(task.hidden_tests) == {"test_mod.py"}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"repo": "t/repo", "problem_statement": "p", "test_command": "true"},
            "row 0: id \\(or instance_id\\)",
        ),
        ({"id": "x", "repo": "t/repo", "test_command": "true"}, "row 0: problem_statement must be"),
        (
            {"id": "x", "repo": "nope", "problem_statement": "p", "test_command": "true"},
            "nope: no such directory",
        ),
    ],
)
def test_bad_rows_get_one_line_naming_the_field(tmp_path: Path, row: dict[str, str], message: str) -> None:
    write_task(tmp_path, "t")
    with pytest.raises(TaskSetError, match=message):
        task_from_record(row, "train", 0, tmp_path)


def test_a_link_in_a_snapshot_is_refused(tmp_path: Path) -> None:
    task = write_task(tmp_path, "t")
    (task / "repo" / "escape").symlink_to("/etc/passwd")
    with pytest.raises(TaskSetError, match="escape: a symbolic link"):
        load_task_dir(tmp_path, "train")


def test_each_familys_space_is_exactly_what_it_draws() -> None:
    rng = random.Random(0)
    for family in FAMILIES:
        space = [tuple(sorted(params.items())) for params in family.space()]
        assert len(space) == len(set(space)), family.name
        drawn = {tuple(sorted(family.draw(rng).items())) for _ in range(40 * len(space))}
        assert drawn == set(space), family.name


def test_the_capacity_is_what_the_generator_yields_and_more_is_refused_at_once() -> None:
    held = capacity("heldout", (2,))
    tasks = generate_tasks("heldout", held, seed=5, levels=(2,))
    assert len({task.id for task in tasks}) == held == 21
    assert capacity("train", (1, 2, 3)) == sum(capacity("train", (level,)) for level in (1, 2, 3))
    started = time.monotonic()
    with pytest.raises(
        ValueError, match=r"^n: the families of levels \[1\] hold 1536 train tasks, fewer than 4096$"
    ):
        generate_tasks("train", 4096, seed=0, levels=(1,))
    assert time.monotonic() - started < 2.0
