"""The agentic coding environment: edit a repository snapshot, run commands in the sandbox, be scored by tests.

Tools (JSON schemas; :class:`CodingEnvironment` reads the Hermes/Qwen ``<tool_call>`` JSON of real
chat models, :class:`PlainCodingEnvironment` the plain ``name words...`` of tiny models):

- ``list_files``                 -> the snapshot's paths, one per line
- ``read_file {path}``           -> the file's text
- ``write_file {path, content}`` -> writes it (creates or replaces) in the snapshot; refused
  when the path and a file already there, or a hidden test's path, would each be the other's
  directory
- ``run {command}``              -> runs ``/bin/sh -c command`` in a fresh sandbox holding the
  snapshot; the files it leaves in ``/work`` become the snapshot (a run killed by a limit leaves
  the snapshot as it was)
- ``submit``                     -> ends the episode

Every file operation works on the episode's own copy of the task's snapshot (a dict in memory);
nothing the agent does touches the host's files, and every command runs in a sandbox
(:mod:`mixrl.rl.sandbox`).

The reward is the share of the task's hidden tests that pass, run in a sandbox on the snapshot
with the hidden tests added (copied over it: they replace a file at their path, and a file or
directory in their way that a ``run`` left there), when the episode ends by ``submit``, at
``rollout.maxTurns`` or at the context limit (the work done counts, submitted or not).  An episode mixrl ends after
``rollout.formatErrorLimit`` consecutive replies without a valid tool call (the seed's three
empty replies) scores 0 and runs no tests.  Observations are cut to ``max_observation_chars``
here, then to ``rollout.maxObservationTokens`` by mixrl.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from mixrl.rl.environments.base import SPLITS, Environment, Episode, Message, Outcome, Split, StepResult
from mixrl.rl.environments.coding import swe
from mixrl.rl.environments.coding.scoring import TestScore, score, test_command_for
from mixrl.rl.environments.coding.tasks import FAMILIES, LEVELS, CodingTask, capacity, generate_tasks
from mixrl.rl.environments.tools import (
    JsonToolCallParser,
    PlainTextParser,
    Tool,
    ToolCall,
    ToolCallParser,
    string_parameters,
)
from mixrl.rl.sandbox import Limits, SandboxConfig, SandboxResult, SandboxUnavailable
from mixrl.rl.sandbox.backend import make_sandbox
from mixrl.rl.sandbox.files import check_path

if TYPE_CHECKING:
    from mixrl.api.models import RolloutSpec

TOOL_LIST, TOOL_READ, TOOL_WRITE, TOOL_RUN, TOOL_SUBMIT = (
    "list_files",
    "read_file",
    "write_file",
    "run",
    "submit",
)
TOOLS: tuple[Tool, ...] = (
    Tool(TOOL_LIST, "List the repository's files."),
    Tool(TOOL_READ, "Read one file of the repository.", string_parameters("path")),
    Tool(TOOL_WRITE, "Create or replace one file of the repository.", string_parameters("path", "content")),
    Tool(
        TOOL_RUN,
        "Run a shell command in the repository's root, in a sandbox without network.",
        string_parameters("command"),
    ),
    Tool(TOOL_SUBMIT, "Finish: the hidden tests are run on the repository as it is."),
)
CHANGING_TOOLS: tuple[str, ...] = (TOOL_WRITE, TOOL_RUN)
"""The tools that change the snapshot: without one, every episode is scored on the untouched stub."""
SIZE_FIELDS: dict[Split, str] = {"train": "trainSize", "heldout": "heldoutSize"}
SUBMITTED = "submitted"
TRUNCATED = "\n[... {more} more characters]"


class CodingEpisode(Episode):
    """One episode: a private copy of the task's snapshot, and the sandbox its commands run in."""

    def __init__(self, task: CodingTask, environment: CodingEnvironment) -> None:
        self.task = task
        self.environment = environment
        self.files: dict[str, bytes] = {path: text.encode() for path, text in task.files.items()}
        self.hidden = hidden_paths(task)
        """What no file of the snapshot may stand in the way of (:func:`blocks`)."""
        self.score: TestScore | None = None
        """The hidden tests' result, once :meth:`finish` ran them."""
        self.test_result: SandboxResult | None = None

    async def step(self, call: ToolCall) -> StepResult:
        arguments = call.arguments
        problem = unusable_argument(arguments)
        if problem:
            return self._observe(f"error: {problem}")
        if call.name == TOOL_SUBMIT:
            return StepResult("submitted", done=True, finish_reason=SUBMITTED)
        if call.name == TOOL_LIST:
            return self._observe("\n".join(sorted(self.files)) or "(no files)")
        if call.name == TOOL_READ:
            path = self._path(arguments["path"])
            if path is None or path not in self.files:
                return self._observe(f"error: no such file: {arguments['path']}")
            return self._observe(self.files[path].decode(errors="replace"))
        if call.name == TOOL_WRITE:
            return self._observe(self._write(arguments["path"], arguments["content"]))
        if call.name == TOOL_RUN:
            result = await self.environment.sandbox.run(
                arguments["command"], self.files, self.environment.limits
            )
            if result.files is not None:
                self.files = result.files
            return self._observe(describe_run(result))
        raise ValueError(f"tool: {call.name!r} is not a coding tool")

    def _path(self, given: str) -> str | None:
        try:
            return check_path(given)
        except ValueError:
            return None

    def _write(self, given: str, content: str) -> str:
        try:
            path = check_path(given)
        except ValueError as error:
            return f"error: {error}"
        data = content.encode()
        if len(data) > self.environment.limits.file_bytes:
            return f"error: {len(data)} bytes is more than a file may hold ({self.environment.limits.file_bytes})"
        clash = [other for other in self.files if in_the_way(path, other)]
        if clash:
            return f"error: {path} and {clash[0]} cannot both exist (one would be the other's directory)"
        # The scoring copies the hidden tests over the snapshot (CodingEnvironment.run_tests).
        if blocks(path, *self.hidden):
            kept = [hidden for hidden in self.task.hidden_tests if in_the_way(path, hidden)]
            return (
                f"error: {path} cannot exist: {kept[0]} is kept for the hidden tests "
                "(one would be the other's directory)"
            )
        self.files[path] = data
        return f"wrote {len(data)} bytes to {path}"

    def _observe(self, text: str) -> StepResult:
        return StepResult(cap(text, self.environment.max_observation_chars))

    async def finish(self, reason: str) -> Outcome:
        if reason == "format_errors":
            return Outcome(0.0, reason)
        self.score, self.test_result = await self.environment.run_tests(self.task, self.files)
        return Outcome(self.score.share, reason)


class CodingEnvironment(Environment[CodingTask]):
    """Agentic coding over generated tasks (``levels``) or your own (``tasks``: a directory in the
    SWE-style layout; rows of ``rollout.dataset`` files work too, paths relative to ``root``).

    ``limits`` and ``test_limits``: :class:`mixrl.rl.sandbox.Limits` fields for each ``run`` and for
    the hidden tests' run; ``ro_paths``: extra read-only host paths in the sandbox (an interpreter
    with your test framework); ``max_concurrent``: sandboxes at once in this worker."""

    parser: ClassVar[ToolCallParser] = JsonToolCallParser()

    def __init__(
        self,
        levels: Sequence[int] = LEVELS,
        tasks: str | None = None,
        root: str | None = None,
        limits: Mapping[str, Any] | None = None,
        test_limits: Mapping[str, Any] | None = None,
        max_observation_chars: int = 4000,
        ro_paths: Sequence[str] = (),
        max_concurrent: int = 8,
        bwrap: str = "bwrap",
    ) -> None:
        if not isinstance(levels, Sequence) or isinstance(levels, str) or not levels:
            raise ValueError(f"levels: a list of levels among {list(LEVELS)}, got {levels!r}")
        bad = [level for level in levels if level not in LEVELS]
        if bad:
            raise ValueError(f"levels: each must be one of {list(LEVELS)}, got {list(levels)}")
        for name, value in (
            ("max_observation_chars", max_observation_chars),
            ("max_concurrent", max_concurrent),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 2**31:
                raise ValueError(f"{name}: a whole number from 1 to 2**31, got {value!r}")
        self.levels = tuple(levels)
        self.tasks_dir = Path(tasks) if tasks is not None else None
        if self.tasks_dir is not None and not self.tasks_dir.is_dir():
            raise ValueError(f"tasks: {tasks} is not a directory")
        self.root = Path(root) if root is not None else Path.cwd()
        self.limits = _limits(limits, "limits", Limits())
        self.test_limits = _limits(test_limits, "test_limits", Limits(wall_s=30.0, cpu_s=20))
        self.max_observation_chars = max_observation_chars
        # The process's backend: bubblewrap here, sandbox pods in a cluster (spec.rollout.sandbox).
        self.sandbox = make_sandbox(
            SandboxConfig(bwrap=bwrap, ro_paths=tuple(ro_paths), max_concurrent=max_concurrent)
        )
        try:
            self.sandbox.check()  # here, where the worker starts, rather than in its first episode
        except SandboxUnavailable as error:
            raise ValueError(f"the coding environment runs every command in a sandbox: {error}") from None

    def tools(self) -> Sequence[Tool]:
        return TOOLS

    async def reset(self, task: CodingTask) -> tuple[list[Message], Episode]:
        listing = ", ".join(sorted(task.files))
        prompt = f"{task.problem}\nThe repository holds: {listing}. Submit when done."
        return [Message("user", prompt)], CodingEpisode(task, self)

    def generate_tasks(self, split: Split, n: int, seed: int) -> Sequence[CodingTask]:
        if self.tasks_dir is not None:
            return swe.load_task_dir(self.tasks_dir, split)[:n]
        return generate_tasks(split, n, seed, self.levels)

    def task_from_record(self, record: Mapping[str, Any], split: Split, index: int) -> CodingTask:
        return swe.task_from_record(record, split, index, self.root)

    def rollout_problems(self, rollout: RolloutSpec) -> list[str]:
        """What would let a run start but never train
        (:class:`mixrl.rl.environments.registry.ChecksRollout`): no tool that changes the repository,
        or more generated tasks asked for than ``levels`` hold (the rollout worker would find that out
        only after minutes of generating them)."""
        problems: list[str] = []
        tools = [tool.name for tool in TOOLS] if rollout.tools is None else rollout.tools
        if not any(tool in tools for tool in CHANGING_TOOLS):
            # As mixrl.api refuses filetree without submit: every episode would be scored on the stub.
            problems.append(
                f"spec.rollout.tools: without {' or '.join(CHANGING_TOOLS)} no episode can earn a reward"
            )
        for split in SPLITS:
            if getattr(rollout.dataset, split) is not None or self.tasks_dir is not None:
                continue  # a file or a task directory: its first rows are used, however many it has
            asked, held = getattr(rollout.dataset, f"{split}_size"), capacity(split, self.levels)
            if asked > held:
                problems.append(
                    f"spec.rollout.dataset.{SIZE_FIELDS[split]}: {asked} is more than the {held} {split} "
                    f"tasks levels {list(self.levels)} hold; at most {held}, or add levels"
                )
        return problems

    async def run_tests(
        self, task: CodingTask, files: Mapping[str, bytes]
    ) -> tuple[TestScore, SandboxResult]:
        """The hidden tests on ``files``: in a sandbox, with a fresh nonce in the test command."""
        nonce = secrets.token_hex(8)
        hidden = {path: text.encode() for path, text in task.hidden_tests.items()}
        # Copied over the snapshot: whatever a ``run`` left in a hidden test's way (a file named like
        # its directory, a directory named like it) gives way, as a file at its path does.
        paths = hidden_paths(task)
        tree = {path: data for path, data in files.items() if not blocks(path, *paths)} | hidden
        result = await self.sandbox.run(test_command_for(task.test_command, nonce), tree, self.test_limits)
        return score(result.stdout + "\n" + result.stderr, result.exit_code, nonce, task.answers), result


class PlainCodingEnvironment(CodingEnvironment):
    """The same environment for tiny models and mixrl's word tokenizer: plain-text calls
    (``write_file solution.py def scale ( x ) : return 7 * x + 3``; the content and the command
    take the rest of the reply, on one line) and a closed vocabulary."""

    parser: ClassVar[ToolCallParser] = PlainTextParser(rest_of_reply=(TOOL_WRITE, TOOL_RUN))

    def vocabulary(self) -> Sequence[str]:
        from mixrl.rl.rollout.tokenizer import split_words  # the tokenizer's own word rule

        texts = [tool.name for tool in TOOLS] + list(VOCABULARY_TEXTS)
        for family in FAMILIES:
            texts += [family.statement, family.signature, family.reference, *family.names]
        words = [word for text in texts for word in split_words(text)]
        return list(dict.fromkeys([*words, *(str(n) for n in range(101))]))


VOCABULARY_TEXTS: tuple[str, ...] = (
    "def return if else for in range while and or not True False None import from print len sum min max",
    "abs str int list ord chr join append x y n xs text i j k c out total _ python solution .py .md",
    "test_solution README The repository holds : , . Submit when done Examples are in run",
    "( ) [ ] { } = == + - * / // % < > <= >= ' \" # ! ; \n",
    "wrote bytes to error no such file exit code ok timeout memory disk output_limit killed stdout stderr",
    "examples pass Traceback most recent call last File line NameError SyntaxError AssertionError",
    "submitted more characters",
)


def describe_run(result: SandboxResult) -> str:
    """A ``run`` tool's observation: how it ended, then its output."""
    head = f"exit code {result.exit_code if result.exit_code is not None else '-'} ({result.finish_reason}"
    head += f": {result.detail})" if result.detail else ")"
    parts = [head]
    if result.stdout:
        parts += ["stdout:", result.stdout.rstrip("\n")]
    if result.stderr:
        parts += ["stderr:", result.stderr.rstrip("\n")]
    return "\n".join(parts)


def unusable_argument(arguments: Mapping[str, Any]) -> str:
    """Why a tool call's argument cannot be used (``""``: each can), answered to the model like any
    bad call rather than failing the episode.  JSON can carry a lone surrogate (``\\ud800``), which is
    not text: it encodes to no UTF-8 file content and to no token; and a NUL, which no command line
    or path can hold (in a file's content it is just a byte)."""
    for name, value in arguments.items():
        if not isinstance(value, str):
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{name}: holds a lone surrogate, which is not UTF-8 text"
        if "\x00" in value and name != "content":
            return f"{name}: holds a NUL character"
    return ""


def in_the_way(path: str, other: str) -> bool:
    """Whether two (normalized) paths cannot both be files: one would be the other's directory."""
    return other.startswith(path + "/") or path.startswith(other + "/")


def hidden_paths(task: CodingTask) -> tuple[frozenset[str], frozenset[str]]:
    """The paths of ``task``'s hidden tests, and every directory above them."""
    files = frozenset(task.hidden_tests)
    return files, frozenset(parent for path in files for parent in _parents(path))


def blocks(path: str, files: frozenset[str], dirs: frozenset[str]) -> bool:
    """Whether a file at ``path`` is in the way of ``files`` (``dirs``: every directory above them):
    :func:`in_the_way` of one of them, in time of the path's depth."""
    return path in dirs or any(parent in files for parent in _parents(path))


def _parents(path: str) -> list[str]:
    """``a/b/c`` -> ``["a", "a/b"]``."""
    parts = path.split("/")
    return ["/".join(parts[:depth]) for depth in range(1, len(parts))]


def cap(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + TRUNCATED.format(more=len(text) - limit)


def _limits(given: Mapping[str, Any] | None, name: str, default: Limits) -> Limits:
    if given is None:
        return default
    known = set(Limits.__dataclass_fields__)
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{name}: unknown {unknown}; known: {sorted(known)}")
    fields = {key: getattr(default, key) for key in known} | dict(given)
    try:
        return Limits(**fields)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
