"""The real ``sglang-router`` (PyPI, pinned in the ``dev`` extra) in front of real torch engines.

Real: the router's own launcher (``python -m sglang_router.launch_router``, the Rust gateway) as a
child process, torch engine processes (``mixrl engine``) on a tiny Qwen3 model, and between each
engine and the router a recording pass-through (:class:`Recorder`), so a test sees exactly the
request the router sent on.  Missing package: the tests fail, never skip (CI must not pass having
skipped them).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mixrl.local.processes import EngineProcess
from mixrl.rl.tiny_models import create_tiny_checkpoint

from ..engine.conftest import VOCAB, save_tiny_tokenizer

ROUTER_VERSION = "0.3.2"
"""The sglang-router release these tests describe (docs/router.md says what it carries)."""
STARTUP_TIMEOUT_S = 60.0

MIXRL_ONLY_RESPONSE_FIELDS = ("output_token_support_size", "output_token_weight_versions")
"""meta_info fields the torch engine adds to SGLang's response (docs/engine.md)."""


@dataclass
class Seen:
    method: str
    path: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Recorder:
    """A pass-through between the router and one engine that records every request it forwards.

    ``sglang_fields_only``: strip the torch engine's own meta_info fields from answers, so the
    engine answers with SGLang's fields alone (a stand-in for a real SGLang server's answer, named
    as such: SGLang needs a GPU).
    """

    engine_url: str
    sglang_fields_only: bool = False
    seen: list[Seen] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    def requests(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path, body))
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        async with (
            aiohttp.ClientSession() as http,
            http.request(
                request.method, self.engine_url + request.path_qs, data=body or None, headers=headers
            ) as answer,
        ):
            content_type = answer.headers.get("Content-Type", "application/json")
            if content_type.startswith("text/event-stream"):
                stream = web.StreamResponse(status=answer.status, headers={"Content-Type": content_type})
                await stream.prepare(request)
                async for chunk in answer.content.iter_any():
                    await stream.write(chunk)
                await stream.write_eof()
                return stream
            data = await answer.read()
            if self.sglang_fields_only and request.path == "/generate" and answer.status == 200:
                data = json.dumps(_sglang_fields(json.loads(data))).encode()
            return web.Response(body=data, status=answer.status, headers={"Content-Type": content_type})

    async def start(self) -> Recorder:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def _sglang_fields(payload: Any) -> Any:
    if isinstance(payload, list):
        return [_sglang_fields(p) for p in payload]
    meta = {k: v for k, v in payload["meta_info"].items() if k not in MIXRL_ONLY_RESPONSE_FIELDS}
    return {**payload, "meta_info": meta}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def sglang_router(worker_urls: list[str], policy: str, log_path: Path) -> AsyncIterator[str]:
    """The real router on loopback in front of ``worker_urls``; yields its URL once it routes.

    Async: the recorders it health-checks at start-up run on this event loop.
    """
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--worker-urls",
        *worker_urls,
        "--log-level",
        "warn",
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_routing(url, process, log_path)
        yield url
    finally:
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _wait_routing(url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    """Until the router's /readiness says it has healthy workers (it registers them in the background)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(
                    f"sglang-router exited {process.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with http.get(f"{url}/readiness") as answer:
                    if answer.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise AssertionError(
        f"sglang-router not ready within {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}"
    )


@pytest.fixture(scope="session")
def router_installed() -> str:
    """The installed sglang-router's version; fails (never skips) when the package is absent."""
    try:
        version = importlib.metadata.version("sglang-router")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(
            f"sglang-router is not installed in this environment: scripts/setup.sh installs mixrl[dev], "
            f"which pins sglang-router=={ROUTER_VERSION}; run it, then rerun"
        )
    assert version == ROUTER_VERSION, (
        f"sglang-router {version} is installed but these tests and docs/router.md describe "
        f"{ROUTER_VERSION}: rerun scripts/setup.sh, or recheck what the new release carries"
    )
    return version


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen3 checkpoint with a real tokenizer saved beside its weights (text in and out)."""
    directory = tmp_path_factory.mktemp("router-sglang") / "tiny"
    path = create_tiny_checkpoint(directory, "qwen3", vocab_size=VOCAB, seed=5)
    save_tiny_tokenizer(Path(path))
    return path


@pytest.fixture(scope="module")
def engines(tiny_model: str) -> Iterator[list[EngineProcess]]:
    """Two torch engines (power_of_two, the load-aware policy, needs at least two workers)."""
    processes = [EngineProcess(tiny_model, pool="p", max_running_requests=8) for _ in range(2)]
    try:
        for process in processes:
            process.start()
        yield processes
    finally:
        for process in processes:
            process.close()


@pytest.fixture
def behind_router(
    router_installed: str, engines: list[EngineProcess], tmp_path: Path
) -> Callable[..., contextlib.AbstractAsyncContextManager[tuple[str, list[Recorder]]]]:
    """``async with behind_router(policy=..., sglang_fields_only=...) as (url, recorders)``."""

    @contextlib.asynccontextmanager
    async def start(
        policy: str = "round_robin", sglang_fields_only: bool = False
    ) -> AsyncIterator[tuple[str, list[Recorder]]]:
        async with recording(engines, sglang_fields_only) as recorders:
            urls = [r.url for r in recorders]
            async with sglang_router(urls, policy, tmp_path / "router.log") as url:
                yield url, recorders

    return start


@contextlib.asynccontextmanager
async def recording(
    engines: list[EngineProcess], sglang_fields_only: bool = False
) -> AsyncIterator[list[Recorder]]:
    """A :class:`Recorder` in front of each engine."""
    recorders = [await Recorder(e.url, sglang_fields_only=sglang_fields_only).start() for e in engines]
    try:
        yield recorders
    finally:
        await asyncio.gather(*(r.close() for r in recorders))
