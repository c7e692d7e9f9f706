"""A thin adapter: any Gymnasium-style environment with text observations and text actions becomes a
mixrl environment (docs/rollout.md#bring-your-own-environment).

Gymnasium's contract is ``reset(seed=..., options=...) -> (observation, info)`` and
``step(action) -> (observation, reward, terminated, truncated, info)``.  The adapter offers one
tool, ``act <action>``, whose argument is passed to ``step``; the episode's reward is the sum of the
step rewards, and it ends when the environment says ``terminated`` or ``truncated`` (those become
the finish reasons).  Each task is a reset seed, so the tasks are generated: no dataset needed.

Name it in an RLRun (this directory on the rollout worker's PYTHONPATH)::

    rollout:
      environment: gym_adapter:GymnasiumAdapter
      environmentArgs: {env: "gym_adapter:GuessNumber", max_guesses: 4}

``GuessNumber`` below is a stand-in written in Gymnasium's style (nothing here imports gymnasium);
a real ``gymnasium.Env`` with text spaces plugs in the same way.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Sequence
from typing import Any, ClassVar

from mixrl.rl.environments.base import Environment, Episode, Message, Outcome, Split, StepResult, Task
from mixrl.rl.environments.tools import PlainTextParser, Tool, ToolCall

ACT = Tool(
    "act",
    "Take one action in the environment.",
    {"type": "object", "properties": {"action": {"type": "string"}}, "required": ["action"]},
)


class GymnasiumAdapter(Environment[Task]):
    """``env``: the import path of a Gymnasium-style class; every other argument is passed to it."""

    parser: ClassVar[PlainTextParser] = PlainTextParser(rest_of_reply=(ACT.name,))

    def __init__(self, env: str, **env_args: Any) -> None:
        module, _, name = env.partition(":")
        self.env_class = getattr(importlib.import_module(module), name)
        self.env_args = env_args

    def tools(self) -> Sequence[Tool]:
        return (ACT,)

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        # Disjoint reset seeds per split: the held-out episodes are ones never trained on.
        return [Task(f"{split}-{seed}-{i}", split, {"seed": _seed(split, seed, i)}) for i in range(n)]

    async def reset(self, task: Task) -> tuple[list[Message], Episode]:
        env = self.env_class(**self.env_args)
        observation, _info = env.reset(seed=task.data["seed"])
        return [Message("user", str(observation))], GymnasiumEpisode(env)

    def vocabulary(self) -> Sequence[str] | None:
        return getattr(self.env_class, "VOCABULARY", None)


class GymnasiumEpisode(Episode):
    def __init__(self, env: Any) -> None:
        self.env = env
        self.total_reward = 0.0

    async def step(self, call: ToolCall) -> StepResult:
        # A step that takes long (a simulator, a sandbox) belongs in asyncio.to_thread(self.env.step, ...)
        # so that the worker's other episodes go on meanwhile; this one is instant.
        observation, reward, terminated, truncated, _info = self.env.step(call.arguments["action"])
        self.total_reward += float(reward)
        if terminated or truncated:
            return StepResult(
                str(observation), done=True, finish_reason="terminated" if terminated else "truncated"
            )
        return StepResult(str(observation))

    async def finish(self, reason: str) -> Outcome:
        return Outcome(self.total_reward, reason)

    async def close(self) -> None:
        self.env.close()


def _seed(split: str, seed: int, index: int) -> int:
    digest = hashlib.sha256(f"{split}|{seed}|{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


class GuessNumber:
    """Gymnasium-style: guess a hidden digit; the answer is ``higher``, ``lower`` or ``correct``."""

    VOCABULARY: ClassVar[tuple[str, ...]] = (
        "act", "guess", "a", "digit", "higher", "lower", "correct", "out", "of", "guesses", "not",
        *map(str, range(10)),
    )  # fmt: skip

    def __init__(self, max_guesses: int = 4) -> None:
        self.max_guesses = max_guesses
        self.target = 0
        self.guesses = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        self.target = (seed or 0) % 10
        self.guesses = 0
        return "guess a digit", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.guesses += 1
        if not action.isdigit():
            observation, reward, terminated = "not a digit", 0.0, False
        elif int(action) == self.target:
            observation, reward, terminated = "correct", 1.0, True
        else:
            observation, reward, terminated = ("higher" if int(action) < self.target else "lower"), 0.0, False
        truncated = not terminated and self.guesses >= self.max_guesses
        return ("out of guesses" if truncated else observation), reward, terminated, truncated, {}

    def close(self) -> None:
        return None
