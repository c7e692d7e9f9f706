"""The environment API: what a task family implements so that mixrl can train on it.

An :class:`Environment` is built once per rollout worker from ``rollout.environment`` and
``rollout.environmentArgs`` (``Environment(**args)``), and plays many episodes at once, each an
:class:`Episode` of its own, so no state is shared between episodes unless the environment shares it.

The shape follows the field's conventions:

- Gymnasium's ``reset``/``step``: :meth:`Environment.reset` takes a task and returns the first
  messages and the episode; :meth:`Episode.step` executes one action (a parsed tool call) and
  returns an observation and whether the episode ended (Gymnasium's ``terminated``).  The reward
  is asked for once, at the end (:meth:`Episode.finish`), as verifiers' rubrics score a finished
  rollout: an agentic task's reward is a test run, not a per-step signal.
- verifiers' ``ToolEnv``/OpenAI's tool calling: tools are names with a JSON-Schema for their
  arguments (:class:`Tool`, :meth:`Tool.schema` is the OpenAI ``{"type": "function", ...}`` form),
  a call is a name with a mapping of arguments (:class:`ToolCall`); how a reply's text becomes a
  call is the environment's :attr:`Environment.parser` (:mod:`mixrl.rl.environments.tools`).
- Datasets are rows (a ``dict`` per JSONL line or Parquet row, as a Hugging Face ``Dataset`` yields
  them); :meth:`Environment.task_from_record` turns one row into a task.  An environment may
  instead generate its tasks (:meth:`Environment.generate_tasks`, filetree does).

What mixrl enforces around every environment (``docs/rollout.md``): ``rollout.maxTurns`` assistant
replies, ``rollout.maxObservationTokens`` tokens per observation (longer ones are cut),
``model.maxContextTokens`` in all, ``rollout.formatErrorLimit`` consecutive replies without a valid
tool call, and the tools the spec offers (a call to any other is a reply without a tool call).
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

from mixrl.rl.environments.tools import PlainTextParser, Tool, ToolCall, ToolCallParser

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")
Role = Literal["system", "user", "assistant", "tool"]

DONE = "done"
"""The finish reason of an episode the environment ended (a step with ``done=True``) unless the
step names its own."""
MIXRL_FINISH_REASONS: tuple[str, ...] = ("max_turns", "context_limit", "format_errors")
"""Why mixrl ends an episode the environment has not ended (passed to :meth:`Episode.finish`)."""


@dataclass(frozen=True)
class Message:
    """One chat message; ``role`` as in OpenAI's and Hugging Face's chat formats."""

    role: Role
    content: str


@dataclass(frozen=True)
class StepResult:
    """What a step returns: the observation's text, and whether the episode ended."""

    observation: str
    done: bool = False
    role: Literal["tool", "user"] = "tool"
    """``tool`` for a tool's output; ``user`` for a message in the user's voice."""
    finish_reason: str = DONE
    """When ``done``: why (``submitted``, ``tests_ran``, ...); passed to :meth:`Episode.finish`."""


@dataclass(frozen=True)
class Outcome:
    """The end of an episode: its reward, and the finish reason the trajectory records."""

    reward: float
    finish_reason: str


class TaskLike(Protocol):
    """What mixrl needs of a task: a stable id (prompt ids and groups use it) and its split."""

    @property
    def id(self) -> str: ...

    @property
    def split(self) -> str: ...


@dataclass(frozen=True)
class Task:
    """A task read from a dataset row: the row itself is ``data``."""

    id: str
    split: Split
    data: Mapping[str, Any]


TaskT = TypeVar("TaskT", bound=TaskLike)


class NoTaskGenerator(ValueError):
    """The environment generates no tasks: the spec must name dataset files."""


class Episode(ABC):
    """One episode's state.  mixrl calls :meth:`step` once per valid tool call, then
    :meth:`finish` exactly once, then :meth:`close` (always, also when the episode was cancelled)."""

    @abstractmethod
    async def step(self, call: ToolCall) -> StepResult:
        """Execute one tool call (its name is one of the offered tools, its arguments fit the schema)."""

    @abstractmethod
    async def finish(self, reason: str) -> Outcome:
        """The reward.  ``reason``: the :attr:`StepResult.finish_reason` of the step that ended the
        episode, or mixrl's (:data:`MIXRL_FINISH_REASONS`) when mixrl ended it."""

    async def close(self) -> None:
        """Release what the episode holds (a sandbox, a directory).  Should not raise: if it does, the
        rollout worker logs one ERROR line and the episode's outcome stands."""
        return None


class Environment(ABC, Generic[TaskT]):
    """A task family.  Subclass it in your own package and name it in the RLRun as
    ``rollout.environment: your_pkg.module:YourEnvironment``; ``rollout.environmentArgs`` are passed
    to the constructor as keyword arguments."""

    parser: ClassVar[ToolCallParser] = PlainTextParser()
    """How a reply's text becomes a :class:`ToolCall` (:mod:`mixrl.rl.environments.tools`)."""

    no_tool_call: ClassVar[Message] = Message("user", "no tool call")
    """The environment's answer to a reply without a valid tool call."""

    @abstractmethod
    def tools(self) -> Sequence[Tool]:
        """Every tool the environment offers; ``rollout.tools`` picks among them (default: all)."""

    @abstractmethod
    async def reset(self, task: TaskT) -> tuple[list[Message], Episode]:
        """Start an episode of ``task``: the first messages (the prompt) and the episode.  If it
        raises, that episode fails (its group is dropped), not the rollout worker."""

    def generate_tasks(self, split: Split, n: int, seed: int) -> Sequence[TaskT]:
        """The first ``n`` tasks of ``split`` generated from ``seed``; used when the spec names no
        dataset file for that split."""
        raise NoTaskGenerator(f"{type(self).__name__} generates no tasks")

    def task_from_record(self, record: Mapping[str, Any], split: Split, index: int) -> TaskT:
        """One dataset row as a task.  Default: :class:`Task` with the row as ``data`` and the row's
        ``id`` column (else a hash of the row) as its id."""
        given = record.get("id")
        task_id = str(given) if given is not None else _row_id(record, split, index)
        return Task(id=task_id, split=split, data=dict(record))  # type: ignore[return-value]

    def vocabulary(self) -> Sequence[str] | None:
        """The closed list of words the environment's texts use, for mixrl's word tokenizer (what
        ``tiny:`` models use); None: the environment needs a real tokenizer (``model.tokenizer``)."""
        return None


def _row_id(record: Mapping[str, Any], split: str, index: int) -> str:
    text = json.dumps(record, sort_keys=True, default=str)
    return f"{split}-{index}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"
