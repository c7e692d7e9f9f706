"""Rollout tests.

Real: the task family and its checker, the tokenizer, the environment and tool parsing, the agent
loop, pass@k, the in-process sampler and the warm start on real tiny ``transformers`` models built
from local configs, the rollout worker and ``mixrl rollout`` as a real process, the real session
router (:class:`mixrl.rl.router.server.Router`) and the real trajectory buffer
(:class:`mixrl.rl.buffer.server.BufferServer` on a temporary directory), all over loopback HTTP.

Stand-ins, named as such:
- ``expert_reply``: a deterministic policy written as code (list the tree, open the asked file,
  submit its line), with variants that misbehave on purpose (never call a tool, loop on ``ls``,
  never stop).  It replaces a model where a test needs exact, known behaviour.
- ``ScriptedGenerate``: an in-process ``generate`` callable driven by that policy; it records every
  context it receives and returns token records with invented but valid log-probabilities.
- ``scripted_engine``: a ``FakeEngine`` (tests/fakes.py, an aiohttp server on loopback that speaks
  the part of SGLang's API the rollout and the router use) answering ``/generate`` with the same
  scripted policy, in SGLang's standard fields only.  It is not the torch engine (that one is
  tested in tests/engine); it lets a test kill a replica mid-episode and know exactly what every
  episode should earn.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mixrl.api.trajectory import TokenRecord
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine.protocol import GenerateResult, PoolInfo
from mixrl.rl.environments.filetree import parse_config
from mixrl.rl.rollout.stats import RolloutStats
from mixrl.rl.rollout.tokenizer import END, TOOL, Tokenizer
from mixrl.rl.router.server import Router, RouterSettings

from ..fakes import FakeEngine, Reply, serve, started_engines
from ..fakes import no_leftover_tasks as no_leftover_tasks
from ..router.conftest import pools_config
from ..servers import RunningBuffer as RunningBuffer
from ..servers import StartBuffer as StartBuffer
from ..servers import started_buffers

TOKENIZER = Tokenizer.filetree()


def expert_reply(context: list[int], behaviour: str = "expert", tokenizer: Tokenizer = TOKENIZER) -> str:
    """Stand-in policy (see the module docstring): the next reply text for this context."""
    if behaviour == "silent":
        return "what is"  # words, but no tool call
    if behaviour == "looper":
        return "ls"
    if behaviour == "chatty":
        return "ls ls ls ls ls ls ls ls ls ls ls ls ls ls ls ls ls ls ls ls"
    if behaviour == "wrong":  # the expert, except that it reports a value one too high
        reply = expert_reply(context, "expert", tokenizer)
        if not reply.startswith("submit "):
            return reply
        _, key, value = reply.split()
        return f"submit {key} {int(value) + 1}"
    text = tokenizer.decode(context)
    question = text.split("what is ", 1)[1].split(" ?", 1)[0]
    key, section = question.split(" in ")
    tool_turns = text.split(TOOL)[1:]
    if not tool_turns:
        return "ls"
    last = tool_turns[-1].split(END, 1)[0].strip()
    if "." in last:  # a listing
        path = next(p for p in last.split() if p.startswith(section + "."))
        return f"cat {path}"
    value = parse_config(last).get(key, "0")
    return f"submit {key} {value}"


def reply_records(reply_ids: list[int], version: int, vocab: int, start: int = 0) -> list[TokenRecord]:
    """Valid token records with invented log-probabilities (position-dependent, so they can be checked)."""
    return [
        TokenRecord(
            token_id=token,
            logprob=-0.01 * (start + i + 1),
            cand_ids=[token, (token + 1) % vocab],
            cand_logprobs=[-0.01 * (start + i + 1), -3.0],
            support_size=0,
            weight_version=version,
        )
        for i, token in enumerate(reply_ids)
    ]


@dataclass
class ScriptedGenerate:
    """Stand-in ``generate`` (see the module docstring); records each context it is given."""

    behaviour: str = "expert"
    script: list[str] | None = None
    """Replies to give in order (instead of ``behaviour``)."""
    version: int = 3
    pool: PoolInfo = field(default_factory=lambda: PoolInfo("scripted", "cpu", "bf16"))
    include_stop: bool = True
    abort_first_after: int | None = None
    """Abort the first request after this many tokens (as an engine does on a weight update)."""
    received: list[list[int]] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    _aborted: bool = False

    async def __call__(self, input_ids: list[int], max_new_tokens: int) -> GenerateResult:
        self.received.append(list(input_ids))
        self.budgets.append(max_new_tokens)
        reply = self.reply_ids(input_ids)
        finish = "stop"
        if self.abort_first_after is not None and not self._aborted:
            self._aborted = True
            reply, finish = reply[: self.abort_first_after], "abort"
        elif len(reply) > max_new_tokens:
            reply, finish = reply[:max_new_tokens], "length"
        elif not self.include_stop:
            reply = reply[:-1]
        return GenerateResult(reply_records(reply, self.version, TOKENIZER.vocab_size), finish, self.pool)

    def reply_ids(self, context: list[int]) -> list[int]:
        """The policy's reply continuing ``context`` (which may already hold part of it after an abort)."""
        prompt_end = max(i for i, t in enumerate(context) if t == TOKENIZER.role_ids["assistant"]) + 1
        if self.script is not None:
            turn = sum(1 for t in context if t == TOKENIZER.role_ids["assistant"]) - 1
            text = self.script[turn]
        else:
            text = expert_reply(context[:prompt_end], self.behaviour)
        full = [*TOKENIZER.encode(text), TOKENIZER.end_id]
        done = context[prompt_end:]
        assert full[: len(done)] == done, "the continuation must extend what was generated"
        return full[len(done) :]


def scripted_reply(behaviour: str = "expert", version: int = 0) -> Reply:
    """The stand-in policy's ``/generate`` answer, with SGLang's standard fields only.  Asked for the
    sampling support (``return_sampling_mask``) it answers ``output_token_sampling_mask`` as SGLang
    does: here the token alone (its q ≈ 0.99 fills any top-p), the first of its candidates."""

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        context = body["input_ids"]
        reply = [*TOKENIZER.encode(expert_reply(context, behaviour)), TOKENIZER.end_id]
        limit = body["sampling_params"]["max_new_tokens"]
        finish: dict[str, Any] = {"type": "stop", "matched": TOKENIZER.end_id}
        if len(reply) > limit:
            reply, finish = reply[:limit], {"type": "length", "length": limit}
        records = reply_records(reply, version, TOKENIZER.vocab_size)
        meta: dict[str, Any] = {
            "id": "scripted",
            "finish_reason": finish,
            "prompt_tokens": len(context),
            "completion_tokens": len(reply),
            "weight_version": str(version),
            "output_token_logprobs": [[r.logprob, r.token_id, None] for r in records],
            "output_top_logprobs": [
                [[lp, i, None] for i, lp in zip(r.cand_ids, r.cand_logprobs, strict=True)] for r in records
            ],
        }
        if body.get("return_sampling_mask"):
            meta["output_token_sampling_mask"] = [[r.token_id] for r in records]
        return {"text": "", "output_ids": reply, "meta_info": meta}

    return reply


def scripted_engine(
    name: str, version: int = 0, behaviour: str = "expert", reply: Reply | None = None
) -> FakeEngine:
    """A stand-in replica playing the scripted policy, or ``reply`` (a test's reshaping of the
    policy's answer); each turn takes 2 ms, so episodes overlap."""
    return FakeEngine(name, reply=reply or scripted_reply(behaviour, version), delay=0.002)


Engines = Callable[..., Awaitable[FakeEngine]]
"""The ``engines`` fixture: ``await engines(name, **scripted_engine's keywords)`` starts a replica."""


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    async with started_engines(scripted_engine) as start:
        yield start


@dataclass
class RunningRouter:
    router: Router
    url: str


StartRouter = Callable[..., Awaitable[RunningRouter]]


@pytest.fixture
async def start_router() -> AsyncIterator[StartRouter]:
    runners: list[web.AppRunner] = []

    async def start(
        pools: dict[str, list[FakeEngine]], run: str = "test", auth_token: AuthToken | None = None
    ) -> RunningRouter:
        config = pools_config({name: (1.0, replicas) for name, replicas in pools.items()}, run)
        router = Router(config, RouterSettings(run=run, health_interval=3600.0, auth_token=auth_token))
        runner, url = await serve(router.app())
        runners.append(runner)
        return RunningRouter(router, url)

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def start_buffer(tmp_path: Path) -> AsyncIterator[StartBuffer]:
    async with started_buffers(tmp_path / "buffer") as start:
        yield start


async def metrics_text(stats: RolloutStats) -> str:
    """What ``stats`` exports on ``/metrics``, served on a free loopback port for the one request."""
    runner = await stats.serve_metrics(0, host="127.0.0.1")
    try:
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/metrics") as response:
            return await response.text()
    finally:
        await runner.cleanup()


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        return json.loads(await response.text())
