"""Ids the engine makes itself (a request without ``rid``, the ``/health_generate`` probe) never
name a client's request.

Real: the engine's HTTP app on loopback (``serve_in_process``, a tiny Qwen3), its model thread held
by a control operation so that requests stay queued while ``/abort_request`` looks for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from mixrl.rl.engine.service import EngineService

from .conftest import serve_in_process


@contextlib.asynccontextmanager
async def model_thread_held(service: EngineService) -> AsyncIterator[None]:
    """The scheduler's model thread busy with a control operation until the block ends: requests
    sent meanwhile wait in its queue (none is admitted, none generates a token)."""
    release = threading.Event()
    held = asyncio.ensure_future(service.sched.control(lambda: release.wait(30)))
    try:
        yield
    finally:
        release.set()
        await held


async def queued(service: EngineService, count: int) -> None:
    while service.sched.num_waiting < count:
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_client_rid_equal_to_an_engine_made_one_aborts_only_the_clients(dense_path: str) -> None:
    """Before, a request without ``rid`` was named ``mixrl-<n>`` from a counter: a client's request
    named ``mixrl-2`` (the second request's) passed the in-flight check (engine ids were not in it), and /abort_request for
    it also aborted the engine-named one."""
    async with serve_in_process(model_path=dense_path) as (url, service), aiohttp.ClientSession() as session:

        async def post(path: str, body: dict[str, Any]) -> Any:
            async with session.post(url + path, json=body) as response:
                assert response.status == 200, await response.text()
                return await response.json(content_type=None)

        params = {"max_new_tokens": 2}
        async with model_thread_held(service):
            named = asyncio.create_task(
                post("/generate", {"input_ids": [1, 2], "sampling_params": params, "rid": "mixrl-2"})
            )
            await queued(service, 1)
            unnamed = asyncio.create_task(post("/generate", {"input_ids": [3, 4], "sampling_params": params}))
            await queued(service, 2)
            assert await post("/abort_request", {"rid": "mixrl-2"}) == {"success": True, "aborted": 1}
        assert (await named)["meta_info"]["finish_reason"]["type"] == "abort"
        answer = await unnamed
        assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
        assert answer["meta_info"]["id"] != "mixrl-2"


@pytest.mark.asyncio
async def test_a_client_request_named_health_generate_is_not_the_health_probe(dense_path: str) -> None:
    """Before, the probe was always named ``health_generate``: /abort_request for a client's request
    of that name aborted the probe too (and the probe then answered 200 without a token)."""
    async with serve_in_process(model_path=dense_path) as (url, service), aiohttp.ClientSession() as session:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "rid": "health_generate"}
        async with model_thread_held(service):
            client = asyncio.create_task(session.post(url + "/generate", json=body))
            await queued(service, 1)
            probe = asyncio.create_task(session.get(url + "/health_generate"))
            await queued(service, 2)
            async with session.post(url + "/abort_request", json={"rid": "health_generate"}) as response:
                assert await response.json() == {"success": True, "aborted": 1}
        async with await probe as response:
            assert response.status == 200
        async with await client as response:
            assert (await response.json())["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.asyncio
async def test_a_probe_whose_model_step_fails_is_a_503(
    dense_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler aborts a batch whose model step raised ("engine error: …"): the probe then
    generated nothing, and a 200 would keep the broken engine in service."""
    async with serve_in_process(model_path=dense_path) as (url, service), aiohttp.ClientSession() as session:

        def broken_step(*args: Any) -> Any:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        # the probe's one token comes from its prefill (add), a longer request's from step
        monkeypatch.setattr(service.runner, "add", broken_step)
        monkeypatch.setattr(service.runner, "step", broken_step)
        async with session.get(url + "/health_generate") as response:
            assert response.status == 503
            assert "engine error: CUDA error" in await response.text()
        monkeypatch.undo()
        async with session.get(url + "/health_generate") as response:
            assert response.status == 200, "a step that works again is healthy again"
