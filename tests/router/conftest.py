"""Router tests.

Real: the router itself (share scheduling, session table, aiohttp proxy, health probes, fan-out,
Prometheus exposition), real HTTP over loopback, real sockets refusing connections or dropping
mid-request when a replica is killed, and in ``test_real_engine.py`` real torch engine processes.

Stand-ins, named as such:
- ``StandInEngine``: a small aiohttp server on loopback that speaks the subset of SGLang's API the
  router touches (``/generate``, ``/health``, ``/metrics`` with ``sglang:gen_throughput``,
  ``/update_weights_from_disk``) and records what it received.  With ``api_key`` it checks the
  bearer token as SGLang's ``--api-key`` does (every route but ``/health*`` and ``/metrics``).  It generates no real tokens.  Its
  ``kill()`` shuts the server down with requests in flight, which the router sees as a replica
  dying (connection dropped, then refused).
- ``StandInResolver``: replaces DNS for discovery tests (in a cluster, getaddrinfo on the pool's
  headless Service name); it returns the addresses the test sets.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mixrl.rl.router.config import PoolConfig, RouterConfig
from mixrl.rl.router.server import SESSION_HEADER, Router, RouterSettings


async def serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on 127.0.0.1 (``port`` 0 = any free port); returns the runner and base URL."""
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    host, bound = runner.addresses[0][:2]
    return runner, f"http://{host}:{bound}"


@dataclass
class StandInEngine:
    """Stand-in for an SGLang/torch engine replica (see the module docstring)."""

    name: str
    healthy: bool = True
    gen_throughput: float | None = None
    delay: float = 0.0
    hold: asyncio.Event | None = None
    """When set, /generate waits for this event before answering (to keep requests in flight)."""
    generate_bodies: list[bytes] = field(default_factory=list)
    sessions_seen: list[str | None] = field(default_factory=list)
    update_bodies: list[dict[str, Any]] = field(default_factory=list)
    api_key: str | None = None
    """As SGLang's ``--api-key``: every route but /health and /metrics needs ``Bearer <api_key>``."""
    authorizations: list[str | None] = field(default_factory=list)
    """The Authorization header of every /generate and /update_weights_from_disk received."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._api_key_check])
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/update_weights_from_disk", self._update)
        return app

    async def start(self, port: int = 0) -> StandInEngine:
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

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.generate_bodies.append(body)
        self.sessions_seen.append(request.headers.get(SESSION_HEADER))
        self.arrived.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        payload = json.loads(body)
        n = int(payload.get("sampling_params", {}).get("max_new_tokens", 4))
        if payload.get("stream"):
            return await self._stream(request, n)
        return web.json_response(
            {
                "text": "",
                "output_ids": list(range(n)),
                "meta_info": {
                    "id": payload.get("rid") or "r",
                    "prompt_tokens": len(payload.get("input_ids", [])),
                    "completion_tokens": n,
                    "weight_version": "0",
                    "finish_reason": {"type": "length", "length": n},
                    "served_by": self.name,
                },
            }
        )

    async def _stream(self, request: web.Request, n: int) -> web.StreamResponse:
        """SGLang-style server-sent events: cumulative output, then ``[DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for k in range(1, n + 1):
            chunk = {"text": "", "output_ids": list(range(k)), "meta_info": {"completion_tokens": k}}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = ["# TYPE sglang:num_queue_reqs gauge", 'sglang:num_queue_reqs{model_name="m"} 0']
        if self.gen_throughput is not None:
            lines += [
                "# TYPE sglang:gen_throughput gauge",
                f'sglang:gen_throughput{{model_name="m"}} {self.gen_throughput}',
            ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _update(self, request: web.Request) -> web.Response:
        self.update_bodies.append(await request.json())
        return web.json_response({"success": True, "message": f"{self.name} loaded"})


class StandInResolver:
    """Stand-in for DNS: maps a Service name to the addresses the test sets."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.lookups: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append((host, port))
        if host not in self.records:
            raise OSError(f"stand-in resolver: temporary failure for {host}")
        return list(self.records[host])


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[StandInEngine]]]:
    started: list[StandInEngine] = []

    async def start(name: str, **kwargs: Any) -> StandInEngine:
        engine = await StandInEngine(name, **kwargs).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        if engine.hold is not None:
            engine.hold.set()
        await engine.kill()


@dataclass
class RunningRouter:
    router: Router
    url: str
    http: aiohttp.ClientSession

    async def generate(self, session: str | None, max_new_tokens: int = 4) -> aiohttp.ClientResponse:
        headers = {SESSION_HEADER: session} if session else {}
        body = {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0},
        }
        response = await self.http.post(f"{self.url}/generate", json=body, headers=headers)
        await response.read()
        return response

    async def get_json(self, path: str) -> Any:
        async with self.http.get(f"{self.url}{path}") as response:
            assert response.status == 200, await response.text()
            return await response.json()


def pools_config(
    pools: dict[str, tuple[float | None, list[StandInEngine]]], run: str = "test"
) -> RouterConfig:
    """{name: (capacity, engines)} -> a RouterConfig with stand-in replica URLs."""
    return RouterConfig(
        run=run,
        pools=tuple(
            PoolConfig(
                name=name,
                gpu_type=f"gpu-{name}",
                precision=f"prec-{name}",
                capacity=capacity,
                replicas=tuple(e.url for e in replicas),
            )
            for name, (capacity, replicas) in pools.items()
        ),
    )


@pytest.fixture
async def start_router() -> AsyncIterator[Callable[..., Awaitable[RunningRouter]]]:
    started: list[tuple[web.AppRunner, aiohttp.ClientSession]] = []

    async def start(
        config: RouterConfig, settings: RouterSettings | None = None, **kwargs: Any
    ) -> RunningRouter:
        # A long health interval keeps tests deterministic: probes happen at start-up and when a test
        # calls poll_once(); a failed proxy marks a replica down on its own.
        router = Router(config, settings or RouterSettings(run=config.run, health_interval=3600.0), **kwargs)
        runner, url = await serve(router.app())
        http = aiohttp.ClientSession()
        started.append((runner, http))
        return RunningRouter(router, url, http)

    yield start
    for runner, http in started:
        await http.close()
        await runner.cleanup()


@pytest.fixture(autouse=True)
async def no_leftover_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves an asyncio task running (fixtures have been torn down by then)."""
    yield
    current = asyncio.current_task()
    await asyncio.sleep(0)
    left = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    assert not left, f"test left asyncio tasks behind: {left}"
