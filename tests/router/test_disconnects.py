"""Clients that go away: mid-body, mid-turn, mid-reload (real loopback HTTP, stand-in engines)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import pytest
from aiohttp import web

from mixrl.rl.router.server import ENGINE_BODY_LIMIT, POOL_HEADER, RouterSettings, body_limit

from .conftest import pools_config


async def wait_for(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_a_client_gone_mid_body_reaches_no_engine_and_logs_no_traceback(
    engines, start_router, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await engines("e")
    running = await start_router(pools_config({"a": (1.0, [engine])}))
    host, port = running.url.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO):
        _, writer = await asyncio.open_connection(host, int(port))
        head = f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        writer.write((head + "Content-Length: 100000\r\n\r\n").encode() + b'{"input_ids": [1, 2')
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        await wait_for(lambda: any("went away" in r.getMessage() for r in caplog.records))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert engine.generate_bodies == []  # nothing half-read was proxied
    assert (await running.generate("s")).status == 200  # and the router serves on


async def test_a_client_gone_mid_turn_cancels_the_request_at_the_engine(engines, start_router) -> None:
    engine = await engines("e", hold=asyncio.Event())
    running = await start_router(pools_config({"a": (1.0, [engine])}))
    async with aiohttp.ClientSession() as client:
        turn = asyncio.create_task(
            client.post(f"{running.url}/generate", json={"input_ids": [1], "sampling_params": {}})
        )
        await asyncio.wait_for(engine.arrived.wait(), 5)
        turn.cancel()  # the client goes away while the engine is still decoding
        with pytest.raises(asyncio.CancelledError):
            await turn
    # The router's upstream request is cancelled with it, so the engine stops working for nobody.
    await asyncio.wait_for(engine.cancelled.wait(), 5)
    replica = running.router.state.replica("a", engine.url)
    assert replica is not None
    await wait_for(lambda: replica.in_flight == 0)
    engine.hold.set()
    assert (await running.generate("s")).status == 200


async def test_a_trainer_gone_mid_reload_does_not_cut_the_fan_out_short(engines, start_router) -> None:
    replicas = [await engines(f"e{i}", update_delay=0.3) for i in range(3)]
    running = await start_router(pools_config({"a": (1.0, replicas)}))
    body = {"model_path": "/weights/v3", "weight_version": "3"}
    timeout = aiohttp.ClientTimeout(total=0.1)  # the caller gives up long before the reloads end
    with pytest.raises(TimeoutError):
        await running.http.post(f"{running.url}/update_weights_from_disk", json=body, timeout=timeout)
    await wait_for(lambda: all(e.update_bodies == [body] for e in replicas))


async def test_a_body_beyond_the_limit_gets_413_before_any_engine_sees_it(engines, start_router) -> None:
    engine = await engines("e")
    settings = RouterSettings(run="test", health_interval=3600.0, max_request_bytes=1 << 16)
    running = await start_router(pools_config({"a": (1.0, [engine])}), settings)
    body = {"input_ids": list(range(20_000)), "sampling_params": {}}
    async with running.http.post(f"{running.url}/generate", json=body) as answer:
        assert answer.status == 413
    assert engine.generate_bodies == []


def test_the_body_limit_holds_a_whole_context_and_never_drops_below_an_engines() -> None:
    assert body_limit(256) == ENGINE_BODY_LIMIT
    context = 1_000_000
    ids = str(list(range(2**31 - context, 2**31))).encode()  # the longest ids a context can hold
    assert len(ids) < body_limit(context) < 4 * len(ids)


async def test_a_client_gone_mid_stream_before_its_cancellation_leaves_the_replica_up(
    engines, start_router, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that leaves mid-stream can make the router's next write to it fail
    ("Cannot write to closing transport") before aiohttp cancels the handler.  aiohttp raises a
    ClientConnectionResetError, a ClientConnectionError like a replica's failure: the replica is not
    to blame, stays up and keeps its sessions, and the request is recorded as the client's (499)."""
    engine = await engines("e")
    running = await start_router(pools_config({"a": (1.0, [engine])}))
    real_write = web.StreamResponse.write

    async def write_until_closed(self: web.StreamResponse, data: bytes) -> None:
        if POOL_HEADER in self.headers:  # the router's answer to its client, not the engine's
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        await real_write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write_until_closed)
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 5}, "stream": True}
    with caplog.at_level(logging.INFO):
        async with running.http.post(f"{running.url}/generate", json=body) as response:
            assert response.status == 200
            with contextlib.suppress(aiohttp.ClientPayloadError):
                await response.read()
        pool = running.router.state.pools["a"]
        await wait_for(lambda: pool.requests == 1)
    replica = running.router.state.replica("a", engine.url)
    assert replica is not None and replica.ready and replica.in_flight == 0
    assert pool.replica_failures == 0 and pool.errors == 1  # the 499
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [
        r.getMessage() for r in caplog.records
    ]
