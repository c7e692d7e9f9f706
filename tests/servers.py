"""Real mixrl servers on loopback, for the test folders that need one beside their own subject."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp import web

from mixrl.api.trajectory_check import TrajectoryLimits
from mixrl.rl.buffer.server import BufferServer
from mixrl.rl.buffer.store import TrajectoryBuffer


def limits(run: str = "test", samples_per_prompt: int = 2, candidates: int = 8) -> TrajectoryLimits:
    """A run's trajectory contract for tests (no vocabulary: ids are only checked to be ≥ 0)."""
    return TrajectoryLimits(run, samples_per_prompt, candidates, max_context_tokens=32768, vocab_size=None)


@asynccontextmanager
async def buffer_at(
    directory: Path, prompts_per_update: int = 1, samples_per_prompt: int = 2, run: str = "test"
) -> AsyncIterator[str]:
    """The real buffer of run ``run`` over ``directory`` (its logs survive for a second one); yields its URL."""
    buffer = TrajectoryBuffer(
        directory, prompts_per_update=prompts_per_update, samples_per_prompt=samples_per_prompt
    )
    server = BufferServer(buffer, limits(run, samples_per_prompt), max_body_bytes=64 << 20)
    runner = web.AppRunner(server.app(), shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()
        buffer.close()
