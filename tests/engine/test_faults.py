"""Failures inside the engine: a model step that raises, and a shutdown with requests in flight.

The fault is injected by wrapping the real runner's ``step`` of an in-process engine (the server,
scheduler and model are real)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import aiohttp
import pytest

from mixrl.local.processes import EngineProcess
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
            assert hit.aborted and "injected fault" in hit.finish_detail["message"]
            assert 0 < hit.completion_tokens < 20
            assert any("model step failed" in r.message for r in caplog.records)
            after = await client.generate([1, 2, 3], max_new_tokens=20, temperature=0.0)
            assert after.finish_detail == {"type": "length", "length": 20}
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


async def _load(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    names = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:generation_tokens_total")
    return {
        name: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        for name in names
        if line.startswith(name + "{")
    }


STREAMS_DROPPED = 12


async def test_a_client_that_goes_away_has_its_requests_aborted_and_no_error_logged(
    dense_path: str, tmp_path: Path
) -> None:
    """A dropped client's sequences leave the batch at the next step (the running count falls to 0
    long before max_new_tokens), a queued one leaves the queue, a client gone mid-body is forgotten,
    and none of it logs an ERROR or a traceback.  The real `mixrl engine` process and its log."""
    log_path = tmp_path / "engine.log"
    long = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True},
    }
    with EngineProcess(dense_path, max_running_requests=1, log_path=log_path) as engine:
        async with aiohttp.ClientSession() as http:
            async with aiohttp.ClientSession() as leaving:  # the client that goes away
                requests = [
                    asyncio.create_task(leaving.post(f"{engine.url}/generate", json=long)) for _ in range(2)
                ]
                while (load := await _load(http, engine.url)).get("sglang:num_queue_reqs", 0) < 1 or load.get(
                    "sglang:num_running_reqs", 0
                ) < 1:
                    await asyncio.sleep(0.02)
                for request in requests:
                    request.cancel()
                await asyncio.gather(*requests, return_exceptions=True)
            dropped = time.monotonic()
            while (load := await _load(http, engine.url))["sglang:num_running_reqs"] or load[
                "sglang:num_queue_reqs"
            ]:
                assert time.monotonic() - dropped < 5, load  # 4,000 tokens take far longer than this
                await asyncio.sleep(0.02)
            assert load["sglang:generation_tokens_total"] < 1000, load

            _, writer = await asyncio.open_connection(engine.host, engine.port)  # gone mid-body
            writer.write(
                b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"input_ids": [1,'
            )
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.close()
            await writer.wait_closed()

            # Streams whose clients go after the first chunk: before, each left a pending task that
            # was later destroyed ("ERROR asyncio: Task was destroyed but it is pending!": 19 of 30).
            for _ in range(STREAMS_DROPPED):
                async with aiohttp.ClientSession() as leaving:
                    response = await leaving.post(f"{engine.url}/generate", json={**long, "stream": True})
                    assert (await response.content.readline()).startswith(b"data: ")
                    response.close()
            dropped = time.monotonic()
            while (await _load(http, engine.url))["sglang:num_running_reqs"]:
                assert time.monotonic() - dropped < 5
                await asyncio.sleep(0.02)

            async with EngineClient(engine.url) as client:  # and the engine serves on
                result = await client.generate([1, 2], max_new_tokens=4, temperature=0.0)
            assert result.completion_tokens == 4
    log = log_path.read_text()
    assert "ERROR" not in log and "Traceback" not in log, log
    assert log.count("client disconnected; aborted after") == 2 + STREAMS_DROPPED, log


LONG_SAMPLING = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"input_ids": [1, 2, 3], "stream": True, "sampling_params": LONG_SAMPLING}),
        (
            "/v1/completions",
            {"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True},
        ),
    ],
)
async def test_a_stream_whose_client_left_before_the_cancellation_ends_quietly(
    dense_path: str,
    tokenizer_dir: str,
    path: str,
    body: dict[str, object],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race CI met: a client leaves between two chunks and the next write fails ("Cannot write to
    closing transport") before aiohttp cancels the handler.  The write's failure is made certain here
    (the second chunk's); its items are aborted and nothing is logged as an error."""
    real_write = aiohttp.web.StreamResponse.write
    writes = 0

    async def write_until_closed(self: aiohttp.web.StreamResponse, data: bytes) -> None:
        nonlocal writes
        writes += 1
        if writes >= 2:
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        await real_write(self, data)

    async with serve_in_process(model_path=dense_path, tokenizer_path=tokenizer_dir) as (url, service):
        monkeypatch.setattr(aiohttp.web.StreamResponse, "write", write_until_closed)
        with caplog.at_level(logging.INFO):
            async with aiohttp.ClientSession() as http, http.post(f"{url}{path}", json=body) as response:
                assert response.status == 200
                streamed = await response.read()
            started = time.monotonic()
            while service.runner.running:
                assert time.monotonic() - started < 5  # 4,000 tokens take far longer than this
                await asyncio.sleep(0.02)
    assert writes >= 2 and b"[DONE]" not in streamed
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert any("client disconnected; aborted after" in r.getMessage() for r in caplog.records)
