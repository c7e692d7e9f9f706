"""The engines' preStop hook (mixrl/rl/engine/drain.py) reads in-flight requests off /metrics.

Real: the torch engine's HTTP app on loopback (``serve_in_process``) with a request held by an
in-place pause, and its own Prometheus exposition; the pure parser on SGLang-shaped text.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from mixrl.rl.engine import drain
from mixrl.rl.engine.client import EngineClient

from .conftest import serve_in_process, until_running

pytestmark = pytest.mark.asyncio


async def test_requests_held_by_a_pause_are_in_flight(dense_path: str) -> None:
    """While paused the engine reports no running request and holds them under
    sglang:num_paused_reqs: the drain must wait for them, not call the engine idle."""
    async with serve_in_process(model_path=dense_path) as (url, _), EngineClient(url) as client:
        task = asyncio.create_task(client.generate([1, 2], max_new_tokens=300, temperature=0.0))
        try:
            await until_running(client)
            await client.pause_generation("in_place")
            async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
                text = await response.text()
            held = await client.metrics()
            assert held["sglang:num_running_reqs"] == 0 and held["sglang:num_paused_reqs"] == 1
            assert drain.in_flight(text) == 1.0
        finally:
            await client.continue_generation()
        await task
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
            assert drain.in_flight(await response.text()) == 0.0


async def test_an_exposition_without_the_paused_gauge_counts_it_as_zero() -> None:
    # an SGLang build that does not export num_paused_reqs: queued plus running, as before
    text = 'sglang:num_running_reqs{model_name="m"} 2\nsglang_num_queue_reqs 1\n'
    assert drain.in_flight(text) == 3.0
    assert drain.in_flight(text + 'sglang_num_paused_reqs{model_name="m"} 4\n') == 7.0
