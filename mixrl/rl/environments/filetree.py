"""The built-in ``filetree`` environment: read a setting from a small virtual file tree.

It has the shape of the paper's agentic coding at a size a tiny model learns on a CPU: the agent
sees a question, inspects a file tree with ``ls`` and ``cat``, and submits an answer that a checker
verifies in a *fresh* environment built from the task (reward 1 if it passes, else 0;
:func:`check`).

A task's tree holds a few config files, one per *section* (``net.cfg``, ``db.ini``, ...), each with
``key value`` lines (the ssh_config / nginx style).  Keys repeat across files with different values, so the question
"what is port in net ?" is answered only by the file whose stem is ``net``; its extension varies per
task, so the agent must read ``ls`` to name it.  The expert episode is three turns::

    ls                 -> db.ini log.env net.cfg
    cat net.cfg        -> host 17 / port 42 / mode 3
    submit port 42

The answer is the setting's line, ``key value``: the checker compares both.  (Restating the key
keeps the lookup within reach of a two-layer model: predicting the value right after the key is
the induction pattern "find this token earlier, copy what followed it".)

Everything is generated deterministically from a seed.  The split of a task is decided by a hash
of what determines its answer (section, extension, key, value), so a held-out task never shares
that tuple with any training task, whatever sizes are asked for.  The closed word lists below are
the task family's whole vocabulary (:data:`WORDS`); the tokenizer is built from them.

Tools (:class:`FileTreeEnvironment`, in the plain-text format):

- ``ls``            -> the file names, sorted, separated by spaces
- ``cat <path>``    -> the file's text, or ``error : no such file``
- ``submit <text>`` -> ends the episode; :func:`check` judges the answer in another fresh episode

A fresh :class:`FileTreeEpisode` is built for every episode (and for every check), so nothing one
episode does can leak into another.  A reply that is not exactly one of these calls is a *reply
without a tool call* (the paper's format error); mixrl answers it with ``no tool call``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mixrl.rl.environments.base import SPLITS, Environment, Episode, Message, Outcome, Split, StepResult
from mixrl.rl.environments.tools import PlainTextParser, Tool, ToolCall, string_parameters

HELDOUT_BUCKETS = 8
"""One in this many answer tuples is held out."""

SECTIONS: tuple[str, ...] = (
    "api",
    "auth",
    "cache",
    "cpu",
    "db",
    "disk",
    "gpu",
    "log",
    "mail",
    "net",
    "ui",
    "web",
)
EXTENSIONS: tuple[str, ...] = (".cfg", ".conf", ".env", ".ini")
KEYS: tuple[str, ...] = (
    "count",
    "delay",
    "depth",
    "host",
    "level",
    "limit",
    "mode",
    "port",
    "rate",
    "retry",
    "size",
    "user",
)
VALUES: tuple[str, ...] = tuple(str(v) for v in range(100))

TOOL_LS, TOOL_CAT, TOOL_SUBMIT = "ls", "cat", "submit"
TOOLS: tuple[str, ...] = (TOOL_LS, TOOL_CAT, TOOL_SUBMIT)

# Every fixed text the environment and the prompt use, word by word.
MESSAGE_WORDS: tuple[str, ...] = (
    "what",
    "is",
    "in",
    "?",
    "=",
    "error",
    ":",
    "no",
    "such",
    "file",
    "usage",
    "path",
    "answer",
    "tool",
    "call",
    "use",
    "or",
    ",",
    "empty",
    "\n",
)

WORDS: tuple[str, ...] = (*TOOLS, *MESSAGE_WORDS, *SECTIONS, *EXTENSIONS, *KEYS, *VALUES)
"""The task family's closed vocabulary (order fixed: token ids depend on it)."""


@dataclass(frozen=True)
class Difficulty:
    """Knobs of the task family.  More files and lines mean longer tool outputs and more distractors."""

    files: int = 3
    """Config files in the tree (sections); the asked one plus ``files - 1`` distractors."""
    lines: int = 1
    """``key value`` lines per file.  Beyond 1 the agent must find the asked key's line, an
    associative lookup a two-layer, 64-wide model does not learn within minutes (measured: it
    stays at chance, 1/lines); use it with larger models."""
    extensions: int = len(EXTENSIONS)
    """How many different extensions files may have (1 = always ``.cfg``: ``ls`` tells nothing new)."""

    def __post_init__(self) -> None:
        if not 1 <= self.files <= len(SECTIONS):
            raise ValueError(f"files: must be between 1 and {len(SECTIONS)}, got {self.files}")
        if not 1 <= self.lines <= len(KEYS):
            raise ValueError(f"lines: must be between 1 and {len(KEYS)}, got {self.lines}")
        if not 1 <= self.extensions <= len(EXTENSIONS):
            raise ValueError(f"extensions: must be between 1 and {len(EXTENSIONS)}, got {self.extensions}")


class FileTreeTask(BaseModel):
    """One task: a file tree, a question, and what a correct submission must equal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(description="Stable identifier derived from the content.")
    split: Split
    files: dict[str, str] = Field(description="Path -> file text; the tree is flat (one directory).")
    question: str = Field(description="The user's question, the text of the first user turn.")
    section: str
    key: str
    answer: str = Field(
        description="The reference answer ``key value``; check() re-derives it from a fresh tree."
    )


def _answer_split(section: str, extension: str, key: str, value: str) -> Split:
    digest = hashlib.sha256(f"{section}|{extension}|{key}|{value}".encode()).digest()
    return "heldout" if digest[0] % HELDOUT_BUCKETS == 0 else "train"


def file_text(lines: list[tuple[str, str]]) -> str:
    return "\n".join(f"{key} {value}" for key, value in lines)


def parse_config(text: str) -> dict[str, str]:
    """``key value`` lines -> mapping (first definition wins); other lines are ignored."""
    settings: dict[str, str] = {}
    for line in text.split("\n"):
        words = line.split()
        if len(words) == 2:
            settings.setdefault(words[0], words[1])
    return settings


def question_text(section: str, key: str) -> str:
    return f"what is {key} in {section} ?"


def _candidate(seed: int, index: int, difficulty: Difficulty) -> FileTreeTask:
    rng = random.Random(
        f"filetree|{seed}|{index}|{difficulty.files}|{difficulty.lines}|{difficulty.extensions}"
    )
    sections = rng.sample(SECTIONS, difficulty.files)
    extensions = EXTENSIONS[: difficulty.extensions]
    files: dict[str, str] = {}
    contents: dict[str, list[tuple[str, str]]] = {}
    for section in sections:
        keys = rng.sample(KEYS, difficulty.lines)
        lines = [(key, rng.choice(VALUES)) for key in keys]
        path = section + rng.choice(extensions)
        files[path] = file_text(lines)
        contents[path] = lines
    # The asked file comes first in `sections`; every other file is a distractor that may share its keys.
    target_path = next(path for path in files if path.startswith(sections[0] + "."))
    key, value = rng.choice(contents[target_path])
    extension = target_path[len(sections[0]) :]
    split = _answer_split(sections[0], extension, key, value)
    ordered = dict(sorted(files.items()))
    digest = hashlib.sha256(repr((sorted(files.items()), sections[0], key)).encode()).hexdigest()[:12]
    return FileTreeTask(
        id=f"ft-{digest}",
        split=split,
        files=ordered,
        question=question_text(sections[0], key),
        section=sections[0],
        key=key,
        answer=f"{key} {value}",
    )


def generate_tasks(
    seed: int, n: int, split: Split, difficulty: Difficulty | None = None
) -> list[FileTreeTask]:
    """The first ``n`` distinct tasks of ``split`` in the stream generated from ``seed``.

    Deterministic: the same arguments always give the same list, and a smaller ``n`` gives a prefix.
    """
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {', '.join(SPLITS)}, got {split!r}")
    if n < 0:
        raise ValueError(f"n: must be non-negative, got {n}")
    difficulty = difficulty or Difficulty()
    tasks: list[FileTreeTask] = []
    seen: set[str] = set()
    index = misses = 0
    # A candidate lands in the held-out split with probability 1/8; a long run of candidates that
    # add nothing new means the difficulty has too few distinct tasks for n.
    while len(tasks) < n:
        if misses >= 64 * HELDOUT_BUCKETS:
            raise ValueError(f"n: only {len(tasks)} distinct {split} tasks exist at {difficulty}, asked {n}")
        task = _candidate(seed, index, difficulty)
        index += 1
        misses += 1
        if task.split == split and task.id not in seen:
            seen.add(task.id)
            tasks.append(task)
            misses = 0
    return tasks


# ----------------------------------------------------------------------------- the environment

NO_SUCH_FILE = "error : no such file"
SUBMITTED = "submitted"

FILETREE_TOOLS: tuple[Tool, ...] = (
    Tool(TOOL_LS, "List the files of the tree."),
    Tool(TOOL_CAT, "Print one file.", string_parameters("path")),
    Tool(
        TOOL_SUBMIT,
        "Submit the answer, the setting's line `key value`; ends the episode.",
        string_parameters("answer"),
    ),
)


class FileTreeEpisode(Episode):
    """One episode's private copy of a task's file tree."""

    def __init__(self, task: FileTreeTask) -> None:
        self.task = task
        self._files: dict[str, str] = dict(task.files)
        self.submission: str | None = None

    def list_files(self) -> list[str]:
        return sorted(self._files)

    def read_file(self, path: str) -> str | None:
        return self._files.get(path)

    def run_tool(self, call: ToolCall) -> StepResult:
        """The step, synchronously (the warm start's demonstrations replay it)."""
        if call.name == TOOL_LS:
            return StepResult(" ".join(self.list_files()))
        if call.name == TOOL_CAT:
            text = self.read_file(call.arguments["path"])
            return StepResult(NO_SUCH_FILE if text is None else text)
        if call.name == TOOL_SUBMIT:
            self.submission = call.arguments["answer"]
            return StepResult("", done=True, finish_reason=SUBMITTED)
        raise ValueError(f"tool: filetree has no tool {call.name!r}")

    async def step(self, call: ToolCall) -> StepResult:
        return self.run_tool(call)

    async def finish(self, reason: str) -> Outcome:
        """1 for a submission that passes :func:`check`; 0 for a wrong one and for any other ending."""
        passed = reason == SUBMITTED and self.submission is not None and check(self.task, self.submission)
        return Outcome(1.0 if passed else 0.0, reason)


class FileTreeEnvironment(Environment[FileTreeTask]):
    """The built-in environment; ``environmentArgs`` are :class:`Difficulty`'s fields."""

    parser: ClassVar[PlainTextParser] = PlainTextParser(rest_of_reply=(TOOL_SUBMIT,))

    def __init__(self, files: int = 3, lines: int = 1, extensions: int = len(EXTENSIONS)) -> None:
        self.difficulty = Difficulty(files=files, lines=lines, extensions=extensions)

    def tools(self) -> Sequence[Tool]:
        return FILETREE_TOOLS

    async def reset(self, task: FileTreeTask) -> tuple[list[Message], Episode]:
        return [Message("user", task.question)], FileTreeEpisode(task)

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[FileTreeTask]:
        return generate_tasks(seed, n, split, self.difficulty)

    def task_from_record(self, record: Mapping[str, Any], split: Split, index: int) -> FileTreeTask:
        """A row holding a task's fields (``files``, ``question``, ``section``, ``key``, ``answer``,
        optionally ``id``); its split is the file's."""
        row = {key: value for key, value in record.items() if key != "split"}
        row.setdefault("id", f"ft-{split}-{index}")
        try:
            return FileTreeTask.model_validate({**row, "split": split})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"row {index}: {where}: {first['msg']}") from None

    def vocabulary(self) -> Sequence[str]:
        return WORDS


def check(task: FileTreeTask, submission: str) -> bool:
    """Whether ``submission`` answers ``task``, judged in a fresh episode built from the task.

    The checker does not trust ``task.answer``: it rebuilds the tree, finds the asked section's
    file, reads it and parses it, as a test suite would run against a clean checkout.
    """
    episode = FileTreeEpisode(task)
    paths = [path for path in episode.list_files() if path.rsplit(".", 1)[0] == task.section]
    if len(paths) != 1:
        return False
    expected = parse_config(episode.read_file(paths[0]) or "").get(task.key)
    submitted = parse_config(" ".join(submission.split()))
    return expected is not None and submitted == {task.key: expected}
