"""Router tests.

Real: the router itself (share scheduling, session table, aiohttp proxy, health probes, fan-out,
Prometheus exposition), real HTTP over loopback, real sockets refusing connections or dropping
mid-request when a replica is killed, and in ``test_real_engine.py`` real torch engine processes.

Stand-ins, named as such:
- ``FakeEngine`` (tests/fakes.py): a small aiohttp server on loopback that speaks the subset of
  SGLang's API the router touches and records what it received; here it answers with counting ids
  (no real tokens).  Its ``kill()`` is a replica dying (connection dropped, then refused).
- ``StandInResolver``: replaces DNS for discovery tests (in a cluster, getaddrinfo on the pool's
  headless Service name); it returns the addresses the test sets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mixrl.rl.engine.protocol import SESSION_HEADER
from mixrl.rl.router.config import PoolConfig, RouterConfig
from mixrl.rl.router.server import Router, RouterSettings

from ..fakes import FakeEngine, serve, started_engines
from ..fakes import no_leftover_tasks as no_leftover_tasks


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
async def engines() -> AsyncIterator[Callable[..., Awaitable[FakeEngine]]]:
    async with started_engines(FakeEngine) as start:
        yield start


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


def pools_config(pools: dict[str, tuple[float | None, list[FakeEngine]]], run: str = "test") -> RouterConfig:
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
