"""Environment tests.

Real: the API's parsers, dataset readers (JSONL with the standard library, Parquet with pyarrow on
files written here), the registry importing a package written to ``tmp_path`` (as a user's own),
the agent loop playing those environments, ``mixrl validate`` and ``mixrl run`` as real processes.

Stand-in, named as such: ``ScriptedReplies``, an in-process ``generate`` that answers each turn with
the next text of a script (encoded with the word tokenizer), where a test needs known replies.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from mixrl.api.trajectory import TokenRecord
from mixrl.rl.engine.protocol import GenerateResult, PoolInfo
from mixrl.rl.rollout.tokenizer import Tokenizer

USER_PACKAGE = "my_envs"
USER_ENVIRONMENT = f"{USER_PACKAGE}.echo:EchoEnv"
ECHO_SOURCE = '''
"""A user's own environment, outside mixrl: say the word the task asks for."""

from mixrl.rl.environments.base import Environment, Episode, Message, Outcome, StepResult
from mixrl.rl.environments.tools import PlainTextParser, Tool

WORDS = ("apple", "pear", "plum", "fig", "lime", "kiwi")


class EchoEpisode(Episode):
    def __init__(self, word, log):
        self.word, self.said, self.log = word, None, log

    async def step(self, call):
        if call.name == "look":
            return StepResult(" ".join(["look"] * 50))  # a long observation: mixrl cuts it
        self.said = call.arguments["word"]
        return StepResult("", done=True, finish_reason="said")

    async def finish(self, reason):
        return Outcome(1.0 if self.said == self.word else 0.0, reason)

    async def close(self):
        self.log.append("closed")


class EchoEnv(Environment):
    parser = PlainTextParser()
    no_tool_call = Message("user", "say a word")

    def __init__(self, prefix="say"):
        self.prefix = prefix
        self.closed = []

    def tools(self):
        return (
            Tool("say", "Say a word.", {"type": "object", "properties": {"word": {"type": "string"}},
                                         "required": ["word"]}),
            Tool("look", "Look around."),
        )

    async def reset(self, task):
        return [Message("user", f"{self.prefix} {task.data['word']}")], EchoEpisode(task.data["word"], self.closed)

    def vocabulary(self):
        return (self.prefix, "say", "look", "a", "word", *WORDS)


class NotAnEnvironment:
    pass
'''


def write_user_package(root: Path) -> Path:
    """The package ``my_envs`` under ``root`` (put ``root`` on PYTHONPATH); returns ``root``."""
    package = root / USER_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "echo.py").write_text(textwrap.dedent(ECHO_SOURCE))
    return root


def write_words(path: Path, words: list[str]) -> Path:
    path.write_text("".join(f'{{"id": "w{i}", "word": "{w}"}}\n' for i, w in enumerate(words)))
    return path


@dataclass
class ScriptedReplies:
    """Stand-in ``generate`` (see the module docstring)."""

    tokenizer: Tokenizer
    script: list[str]
    received: list[list[int]] = field(default_factory=list)

    async def __call__(self, input_ids: list[int], max_new_tokens: int) -> GenerateResult:
        turn = len(self.received)
        self.received.append(list(input_ids))
        ids = [*self.tokenizer.encode(self.script[turn]), self.tokenizer.end_id][:max_new_tokens]
        records = [
            TokenRecord(
                token_id=t, logprob=-0.5, cand_ids=[t], cand_logprobs=[-0.5], support_size=0, weight_version=1
            )
            for t in ids
        ]
        return GenerateResult(records, "stop", PoolInfo("scripted", "cpu", "bf16"))
