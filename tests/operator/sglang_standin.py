"""A stand-in for SGLang's control plane that enforces SGLang 0.5.23's weight-update rules.

Real HTTP on loopback.  Requests generate one token every few milliseconds; each token records
the weights that produced it and the version label the engine would report for it.  The rules,
as SGLang's scheduler and tokenizer manager apply them (docs/engine.md, "Weight updates under load"):

- ``/pause_generation``: ``in_place`` freezes running requests where they are; ``retract`` moves
  them back to the waiting queue; ``abort`` ends them.  Either way they are still unfinished.
- ``/update_weights_from_disk`` loads the weights, then, with ``flush_cache``, flushes the cache —
  which SGLang refuses while any request is running or queued.  The weights are then already new,
  but the answer is ``success: false`` and the reported version stays the old one.
- ``/update_weight_version`` relabels without loading anything.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)


@dataclass
class Token:
    weights: str
    """The checkpoint that produced it."""
    label: str
    """The weight version the engine reports for it."""


@dataclass
class StandInSGLang:
    weights: str
    label: str = "default"
    token_interval_s: float = 0.005
    paused: bool = False
    healthy: bool = True
    """False: /health answers 503, as an engine still loading its model."""
    unfinished: set[int] = field(default_factory=set)
    loads: list[dict[str, Any]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    produced: int = 0
    """Tokens generated so far, by every request."""
    _resume: asyncio.Event = field(default_factory=asyncio.Event)
    _next_rid: int = 0

    def __post_init__(self) -> None:
        self._resume.set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/get_weight_version", self.get_weight_version)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/pause_generation", self.pause_generation)
        app.router.add_post("/continue_generation", self.continue_generation)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_post("/update_weight_version", self.update_weight_version)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if self.healthy else 503)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.label})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        self.unfinished.add(rid)
        tokens: list[Token] = []
        try:
            while len(tokens) < body["sampling_params"]["max_new_tokens"]:
                await self._resume.wait()
                await asyncio.sleep(self.token_interval_s)
                if self._resume.is_set():  # a pause that began during the step holds this token
                    tokens.append(Token(self.weights, self.label))
                    self.produced += 1
        finally:
            self.unfinished.discard(rid)
        return web.json_response({"tokens": [[t.weights, t.label] for t in tokens]})

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await request.json())["mode"]
        assert mode in ("in_place", "retract"), mode  # abort is not what a weight sync uses
        self.paused = True
        self._resume.clear()
        return web.json_response({})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.paused = False
        self._resume.set()
        return web.json_response({})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.loads.append(body)
        self.weights = body["model_path"]  # loaded before the flush is tried, as SGLang does
        if body.get("flush_cache", True) and self.unfinished:
            answer = {"success": False, "message": FLUSH_REFUSED, "num_paused_requests": 0}
            self.answers.append(answer)
            return web.json_response(answer, status=400)
        if body.get("weight_version") is not None:
            self.label = body["weight_version"]
        answer = {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        self.answers.append(answer)
        return web.json_response(answer)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        self.label = (await request.json())["new_version"]
        return web.json_response({"success": True})
