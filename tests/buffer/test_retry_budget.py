"""How long ``BufferClient`` retries a buffer it cannot reach: for a time budget (a buffer pod
restarting takes minutes), with capped backoff; it used to give up after five retries, about 6 s."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from mixrl.rl.buffer.client import RETRY_BUDGET_S, BufferClient, BufferError
from mixrl.rl.buffer.server import BufferServer
from mixrl.rl.buffer.store import TrajectoryBuffer

from ..fakes import serve
from ..servers import free_port, limits


def test_the_default_budget_outlasts_a_pod_restart() -> None:
    client = BufferClient("http://127.0.0.1:9")
    assert client.retry_budget_s == RETRY_BUDGET_S >= 120 and client.retries is None
    assert client.max_backoff_s <= 10  # a buffer back up is found within seconds, not minutes


async def test_a_buffer_that_comes_back_within_the_budget_is_reached(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with BufferClient(url, retry_budget_s=30, backoff_s=0.05, max_backoff_s=0.2) as client:
        asking = asyncio.create_task(client.stats())
        buffer = runner = None
        try:
            await asyncio.sleep(1.6)  # longer than five doubling retries from 0.05 s (1.55 s in all)
            assert not asking.done(), asking
            buffer = TrajectoryBuffer(tmp_path, 1, 2, None)
            runner, _ = await serve(BufferServer(buffer, limits(), max_body_bytes=1 << 20).app(), port=port)
            assert (await asyncio.wait_for(asking, 5))["batches"] == 0
        finally:
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)
            if runner is not None:
                await runner.cleanup()
            if buffer is not None:
                buffer.close()


@pytest.mark.parametrize(
    ("kwargs", "attempts"), [({"retry_budget_s": 0.6}, range(6, 20)), ({"retries": 1}, [2])]
)
async def test_an_unreachable_buffer_fails_once_the_budget_or_count_is_spent(
    kwargs: dict[str, float], attempts: range | list[int]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with BufferClient(url, backoff_s=0.02, max_backoff_s=0.1, **kwargs) as client:  # type: ignore[arg-type]
        with pytest.raises(BufferError) as refused:
            await client.stats()
    assert loop.time() - started < 3
    message = str(refused.value)
    match = re.fullmatch(
        rf"GET /stats: cannot reach the buffer at {url} \((\d+) attempts in [\d.]+ s; last: .+\)", message
    )
    assert match is not None, message
    assert int(match.group(1)) in attempts and refused.value.status is None
