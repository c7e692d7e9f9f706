"""Autoscaling tests: the policy, the fleet simulator, the KEDA builder, the PromQL and the loop.

Real: the pure policy and budget allocation, the simulator, the ScaledObject builder (checked against
KEDA's published API through the ``cloudcoil-models-keda`` models when installed), our aiohttp
Prometheus client and Kubernetes calls, a real Prometheus server (the Debian ``prometheus``
package, started here on loopback with a 1 s scrape interval) scraping real HTTP servers on
loopback that expose SGLang's gauges with prometheus-client, and kopf's real engine running our
handlers on the test's event loop.

Stand-ins: the engines are small aiohttp servers whose gauges the test sets (no model behind them:
the loop only reads their metrics); Kubernetes' pod labels (``namespace``, ``pod``) are attached
as static target labels in the Prometheus config, where a cluster's service discovery would; the
API server is kmock's in-memory emulator, which has no scale semantics — it merges what is PATCHed
to ``…/scale`` into the object itself, so our ``{"spec": {"replicas": N}}`` lands on
``.spec.replicas`` as the real API server's ``specReplicasPath`` mapping would put it (the tests
check the request went to ``/scale``); no Deployment controller runs, the tests write
``status.readyReplicas`` themselves.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import aiohttp.web
import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder, generate_latest

PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.needs_prometheus  # tests/conftest.py fails these without the binary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class EngineMetrics:
    """A loopback server exposing SGLang's two load gauges (and optionally DCGM-like GPU gauges).

    ``negotiate=True`` answers what the scraper asks for (Prometheus 2.x asks for OpenMetrics, so
    the colon turns into an underscore); ``False`` always sends the classic text format, which
    keeps ``sglang:num_queue_reqs`` as it is.  Both spellings reach the same Prometheus."""

    negotiate: bool
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        labels = ["model_name"]
        self.queue = Gauge("sglang:num_queue_reqs", "queued requests", labels, registry=self.registry)
        self.running = Gauge("sglang:num_running_reqs", "running requests", labels, registry=self.registry)
        self.set(0, 0)

    def set(self, queued: float, running: float) -> None:
        self.queue.labels("tiny").set(queued)
        self.running.labels("tiny").set(running)

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if self.negotiate:
            encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
            body = encoder(self.registry)
        else:
            body, content_type = generate_latest(self.registry), CONTENT_TYPE_LATEST
        return aiohttp.web.Response(body=body, headers={"Content-Type": content_type})


@dataclass
class PrometheusServer:
    url: str
    process: asyncio.subprocess.Process

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), timeout=10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


async def start_prometheus(tmp: Path, jobs: list[str]) -> PrometheusServer:
    """Our own Prometheus on loopback (never the package's system service), 1 s scrapes."""
    assert PROMETHEUS is not None
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n"
        + "".join(jobs)
    )
    process = await asyncio.create_subprocess_exec(
        PROMETHEUS,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    server = PrometheusServer(f"http://127.0.0.1:{port}", process)
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            try:
                async with session.get(f"{server.url}/-/ready") as response:
                    if response.status == 200:
                        return server
            except aiohttp.ClientError:
                pass
            if process.returncode is not None:
                raise RuntimeError(
                    f"prometheus exited with {process.returncode}; config:\n{config.read_text()}"
                )
            await asyncio.sleep(0.05)
    await server.stop()
    raise RuntimeError("prometheus did not become ready in 15 s")


def engine_job(name: str, port: int, namespace: str, pod: str) -> str:
    """A scrape job for one engine, labelled the way Kubernetes service discovery would label it."""
    return (
        f"  - job_name: {name}\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{port}']\n        labels: {{namespace: {namespace}, pod: {pod}}}\n"
    )


@pytest.fixture
async def serve() -> AsyncIterator[
    Callable[[Callable[[aiohttp.web.Request], Awaitable[aiohttp.web.StreamResponse]], int], Awaitable[None]]
]:
    """``await serve(handler, port)`` runs a loopback HTTP server until the test ends."""
    runners: list[aiohttp.web.AppRunner] = []

    async def start(
        handler: Callable[[aiohttp.web.Request], Awaitable[aiohttp.web.StreamResponse]], port: int
    ) -> None:
        app = aiohttp.web.Application()
        app.router.add_get("/metrics", handler)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def prometheus(tmp_path: Path) -> AsyncIterator[Callable[[list[str]], Awaitable[PrometheusServer]]]:
    started: list[PrometheusServer] = []

    async def start(jobs: list[str]) -> PrometheusServer:
        server = await start_prometheus(tmp_path, jobs)
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()
