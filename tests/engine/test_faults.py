"""Failures inside the engine: a model step that raises, and a shutdown with requests in flight.

The fault is injected by wrapping the real runner's ``step`` of an in-process engine (the server,
scheduler and model are real)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mixrl.rl.engine.client import EngineClient

from .conftest import serve_in_process


async def test_a_failed_step_aborts_the_batch_and_the_engine_keeps_serving(
    dense_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with serve_in_process(model_path=dense_path) as (url, service):
        real_step = service.runner.step
        calls = 0

        def failing_step() -> list:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise RuntimeError("injected fault")
            return real_step()

        service.runner.step = failing_step  # type: ignore[method-assign]
        async with EngineClient(url) as client:
            with caplog.at_level(logging.ERROR):
                hit = await client.generate([1, 2, 3], max_new_tokens=20, temperature=0.0)
            assert hit.aborted and "injected fault" in hit.finish_reason["message"]
            assert 0 < hit.completion_tokens < 20
            assert any("model step failed" in r.message for r in caplog.records)
            after = await client.generate([1, 2, 3], max_new_tokens=20, temperature=0.0)
            assert after.finish_reason == {"type": "length", "length": 20}
            assert after.output_ids[: hit.completion_tokens] == hit.output_ids


async def test_shutdown_answers_requests_in_flight_with_an_abort(dense_path: str) -> None:
    async with serve_in_process(model_path=dense_path) as (url, service):
        client = EngineClient(url)
        task = asyncio.create_task(client.generate([4, 5], max_new_tokens=5000, temperature=0.0))
        while not service.runner.running:
            await asyncio.sleep(0.01)
    result = await task
    await client.close()
    assert result.aborted and result.completion_tokens < 5000
