"""The file-tree environment: tools over one task's virtual files, and tool calls parsed from replies.

A fresh :class:`FileTreeEnv` is built for every episode (and for every check), so nothing one
episode does can leak into another.  Tools:

- ``ls``            -> the file names, sorted, separated by spaces
- ``cat <path>``    -> the file's text, or ``error : no such file``
- ``submit <text>`` -> ends the episode; :func:`check` judges the answer in another fresh environment

A reply that is not exactly one of these calls is a *reply without a tool call* (the paper's
format error); the environment answers with a short user nudge and the agent loop counts it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from mixrl.rl.rollout.tasks import TOOL_CAT, TOOL_LS, TOOL_SUBMIT, TOOLS, Task, parse_config

NO_SUCH_FILE = "error : no such file"
NO_TOOL_CALL = "no tool call"


@dataclass(frozen=True)
class ToolCall:
    tool: Literal["ls", "cat", "submit"]
    argument: str = ""


def parse_tool_call(reply: str, tools: Collection[str] = TOOLS) -> ToolCall | None:
    """The tool call a reply makes, or None when it makes none (unknown or not offered tool,
    wrong arity, empty reply)."""
    words = reply.split()
    if not words or words[0] not in tools:
        return None
    tool, args = words[0], words[1:]
    if tool == TOOL_LS and not args:
        return ToolCall(TOOL_LS)
    if tool == TOOL_CAT and len(args) == 1:
        return ToolCall(TOOL_CAT, args[0])
    if tool == TOOL_SUBMIT and args:
        return ToolCall(TOOL_SUBMIT, " ".join(args))
    return None


@dataclass(frozen=True)
class Observation:
    """What the environment says back: a tool's output, or the nudge after a reply without a call."""

    role: Literal["tool", "user"]
    text: str


class FileTreeEnv:
    """One episode's private copy of a task's file tree."""

    def __init__(self, task: Task) -> None:
        self._files: dict[str, str] = dict(task.files)

    def list_files(self) -> list[str]:
        return sorted(self._files)

    def read_file(self, path: str) -> str | None:
        return self._files.get(path)

    def run_tool(self, call: ToolCall) -> Observation:
        """Output of ``ls`` or ``cat``; ``submit`` is handled by the agent loop (it ends the episode)."""
        if call.tool == TOOL_LS:
            return Observation("tool", " ".join(self.list_files()))
        if call.tool == TOOL_CAT:
            text = self.read_file(call.argument)
            return Observation("tool", NO_SUCH_FILE if text is None else text)
        raise ValueError(f"tool: {call.tool!r} produces no output (submit ends the episode)")

    @staticmethod
    def no_tool_call() -> Observation:
        return Observation("user", NO_TOOL_CALL)


def check(task: Task, submission: str) -> bool:
    """Whether ``submission`` answers ``task``, judged in a fresh environment built from the task.

    The checker does not trust ``task.answer``: it rebuilds the tree, finds the asked section's
    file, reads it and parses it, as a test suite would run against a clean checkout.
    """
    env = FileTreeEnv(task)
    paths = [path for path in env.list_files() if path.rsplit(".", 1)[0] == task.section]
    if len(paths) != 1:
        return False
    expected = parse_config(env.read_file(paths[0]) or "").get(task.key)
    submitted = parse_config(" ".join(submission.split()))
    return expected is not None and submitted == {task.key: expected}
