"""Stand-ins shared by the test folders, named as such.

- :class:`FakeEngine`: an aiohttp server on loopback that speaks the part of SGLang's API the
  router and the rollout touch (``/generate``, ``/health``, ``/metrics`` with
  ``sglang:num_queue_reqs`` and optionally ``sglang:gen_throughput``, ``/update_weights_from_disk``)
  and records what it received.  What ``/generate`` answers is its ``reply`` (a function of the
  request body): by default ``max_new_tokens`` counting ids with no log-probs (the router's tests);
  the rollout's tests plug in a scripted policy with token records.  With ``api_key`` it checks the
  bearer token as SGLang's ``--api-key`` does (every route but ``/health*`` and ``/metrics``).  Its
  ``kill()`` shuts the server down with requests in flight, which a client sees as a replica dying
  (connection dropped, then refused).  It is not the torch engine (tests/engine tests that one).
- :class:`WeightVersionEngine`: a :class:`FakeEngine` that also answers ``/get_weight_version``.
- :func:`no_leftover_tasks`: an autouse fixture for a folder's conftest.
- :func:`script_module`: a script of scripts/ or bench/ (not packages) imported as a module.
- :class:`HandledInAFinalizer`: :class:`~mixrl.local.processes.StopSignals` whose handler's raise
  is lost, as when a signal comes while the garbage collector runs a finalizer in the main thread.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web

from mixrl.local.processes import StopSignals
from mixrl.rl.engine.protocol import SESSION_HEADER

Reply = Callable[[dict[str, Any]], dict[str, Any]]
"""A ``/generate`` body -> the response payload."""


async def serve(
    app: web.Application, port: int = 0, shutdown_timeout: float = 0.2
) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on 127.0.0.1 (``port`` 0 = any free port); returns the runner and base URL.
    ``shutdown_timeout``: how long the runner's cleanup lets requests in flight finish."""
    runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    host, bound = runner.addresses[0][:2]
    return runner, f"http://{host}:{bound}"


def counting_reply(name: str) -> Reply:
    """``max_new_tokens`` ids 0, 1, 2, … without log-probs; ``meta_info.served_by`` names the engine.
    Asked for the sampling support (``return_sampling_mask``) it answers one member per token, the
    token itself, as SGLang answers a confident truncated rule."""

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        n = int(body.get("sampling_params", {}).get("max_new_tokens", 4))
        meta: dict[str, Any] = {
            "id": body.get("rid") or "r",
            "prompt_tokens": len(body.get("input_ids", [])),
            "completion_tokens": n,
            "weight_version": "0",
            "finish_reason": {"type": "length", "length": n},
            "served_by": name,
        }
        if body.get("return_sampling_mask"):
            meta["output_token_sampling_mask"] = [[i] for i in range(n)]
        return {"text": "", "output_ids": list(range(n)), "meta_info": meta}

    return reply


@dataclass
class FakeEngine:
    """Stand-in for an SGLang/torch engine replica (see the module docstring)."""

    name: str
    reply: Reply | None = None
    """What /generate answers; None: :func:`counting_reply`."""
    healthy: bool = True
    gen_throughput: float | None = None
    queued: int = 0
    """``sglang:num_queue_reqs``: requests it holds waiting (a full engine)."""
    delay: float = 0.0
    hold: asyncio.Event | None = None
    """When set, /generate waits for this event before answering (to keep requests in flight)."""
    update_delay: float = 0.0
    """Seconds /update_weights_from_disk takes (a reload in progress)."""
    cut_after: int | None = None
    """When set, /generate sends its headers and this many bytes of its answer (a streamed one: this
    many events), then drops the connection: a replica that dies mid-answer."""
    api_key: str | None = None
    """As SGLang's ``--api-key``: every route but /health and /metrics needs ``Bearer <api_key>``."""
    generate_bodies: list[bytes] = field(default_factory=list)
    sessions_seen: list[str | None] = field(default_factory=list)
    update_bodies: list[dict[str, Any]] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    """The Authorization header of every /generate and /update_weights_from_disk received."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a /generate's caller went away mid-request (its handler is cancelled, as in the
    torch engine, whose scheduler then aborts the sequence)."""
    runner: web.AppRunner | None = None
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._api_key_check], handler_args={"handler_cancellation": True})
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/update_weights_from_disk", self._update)
        return app

    async def start(self, port: int = 0) -> FakeEngine:
        self.runner, self.url = await serve(self.app(), port)
        return self

    async def kill(self) -> None:
        """Stop serving: in-flight requests lose their connection, later ones are refused."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @web.middleware
    async def _api_key_check(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """SGLang's check (``add_api_key_middleware``): health and metrics stay open."""
        if request.path in ("/generate", "/update_weights_from_disk"):
            self.authorizations.append(request.headers.get("Authorization"))
        open_path = request.path.startswith("/health") or request.path.startswith("/metrics")
        wanted = None if self.api_key is None or open_path else f"Bearer {self.api_key}"
        if wanted is not None and request.headers.get("Authorization") != wanted:
            return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.generate_bodies.append(raw)
        self.sessions_seen.append(request.headers.get(SESSION_HEADER))
        self.arrived.set()
        try:
            if self.hold is not None:
                await self.hold.wait()
            if self.delay:
                await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        body = json.loads(raw)
        if body.get("stream"):
            return await self._stream(request, int(body.get("sampling_params", {}).get("max_new_tokens", 4)))
        answer = json.dumps((self.reply or counting_reply(self.name))(body)).encode()
        if self.cut_after is None:
            return web.Response(body=answer, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(answer)
        await response.prepare(request)
        await response.write(answer[: self.cut_after])
        return self._drop(request, response)

    @staticmethod
    def _drop(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        """Close the connection under a half-sent answer."""
        assert request.transport is not None
        request.transport.abort()
        return response

    async def _stream(self, request: web.Request, n: int) -> web.StreamResponse:
        """SGLang-style server-sent events: cumulative output, then ``[DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for k in range(1, n + 1):
            if self.cut_after is not None and k > self.cut_after:
                return self._drop(request, response)
            chunk = {"text": "", "output_ids": list(range(k)), "meta_info": {"completion_tokens": k}}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = [
            "# TYPE sglang:num_queue_reqs gauge",
            f'sglang:num_queue_reqs{{model_name="m"}} {self.queued}',
        ]
        if self.gen_throughput is not None:
            lines += [
                "# TYPE sglang:gen_throughput gauge",
                f'sglang:gen_throughput{{model_name="m"}} {self.gen_throughput}',
            ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _update(self, request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(self.update_delay)
        self.update_bodies.append(body)
        return web.json_response({"success": True, "message": f"{self.name} loaded"})


@dataclass
class WeightVersionEngine(FakeEngine):
    """A :class:`FakeEngine` at weight version ``version``, which it reports on
    ``/get_weight_version`` as SGLang does (a string); the test moves it as a weight update would."""

    version: int = 0

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/get_weight_version", self._weight_version)
        return app

    async def _weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.version)})


@asynccontextmanager
async def started_engines(
    make: Callable[..., FakeEngine],
) -> AsyncIterator[Callable[..., Awaitable[FakeEngine]]]:
    """``start(name, **kwargs)`` starts ``make(name, **kwargs)``; every engine is stopped at the end."""
    started: list[FakeEngine] = []

    async def start(name: str, **kwargs: Any) -> FakeEngine:
        engine = await make(name, **kwargs).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        if engine.hold is not None:
            engine.hold.set()
        await engine.kill()


@pytest.fixture(autouse=True)
async def no_leftover_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves an asyncio task running (fixtures have been torn down by then)."""
    yield
    current = asyncio.current_task()
    await asyncio.sleep(0)
    left = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    assert not left, f"test left asyncio tasks behind: {left}"


def script_module(name: str, path: Path) -> ModuleType:
    """The Python file ``path`` (a script of scripts/ or bench/, which are not packages) imported as
    module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class HandledInAFinalizer(StopSignals):
    """The handler runs inside a finalizer: CPython prints its raise and drops it (through
    ``sys.unraisablehook``), as when the garbage collector ran a finalizer in the main thread just
    as the signal came."""

    def _handle(self, signum: int, frame: Any) -> None:
        outer = self

        class Finalizer:
            def __del__(self) -> None:
                StopSignals._handle(outer, signum, frame)

        Finalizer()  # dropped at once
