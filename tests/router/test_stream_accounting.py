"""The router's accounting of streamed answers, against a stand-in engine that streams as the torch
engine does: each event the cumulative response, ``meta_info.completion_tokens`` near its start
and the per-token log-probs after it (so a long answer's events run to many kilobytes), and in a
batch one ``index`` per item.  The pool's generated tokens must be the tokens the client received,
whatever the size of the events or how the bytes are cut on the way."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from ..fakes import serve
from .conftest import pools_config

LOGPROBS_PER_TOKEN = 40
"""Candidates per token in each event: enough that a long answer's events are tens of kilobytes."""


def event(tokens: int, index: int | None, version: str) -> bytes:
    """One cumulative SSE event as the torch engine writes it (build_response, then stream_chunk)."""
    meta = {
        "id": "r",
        "finish_reason": None,
        "prompt_tokens": 1,
        "completion_tokens": tokens,
        "cached_tokens": 0,
        "weight_version": version,
        "output_token_logprobs": [[-1.25, t, None] for t in range(tokens)],
        "output_top_logprobs": [[[-1.25, c, None] for c in range(LOGPROBS_PER_TOKEN)] for _ in range(tokens)],
    }
    chunk: dict[str, object] = {"output_ids": list(range(tokens)), "meta_info": meta}
    if index is not None:
        chunk["index"] = index
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class StreamingEngine:
    """Streams ``lengths[i]`` tokens for item i, the items' events interleaved (a batch when more
    than one), each write cut into ``piece``-byte pieces (0: one write per event)."""

    def __init__(self, lengths: list[int], piece: int = 0) -> None:
        self.lengths = lengths
        self.piece = piece

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/generate", self._generate)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        batched = len(self.lengths) > 1
        data = b"".join(
            event(k, i if batched else None, "7" if k == n else "6")
            for k in range(1, max(self.lengths) + 1)
            for i, n in enumerate(self.lengths)
            if k <= n
        )
        step = self.piece or len(data)
        for start in range(0, len(data), step):
            await response.write(data[start : start + step])
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def streaming_engine() -> AsyncIterator[list[tuple[web.AppRunner, str]]]:
    started: list[tuple[web.AppRunner, str]] = []
    yield started
    for runner, _ in started:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("lengths", "piece"),
    [
        ([60], 0),  # long events, each written whole (read in pieces far beyond 4 KiB)
        ([60], 1000),  # cut into small pieces on the way
        ([30, 45], 0),  # a batch: every item's tokens count, not just the last event's
        ([30, 45], 777),
    ],
)
async def test_streamed_tokens_and_version_are_counted_whatever_the_event_size(
    streaming_engine, start_router, lengths: list[int], piece: int
) -> None:
    engine = StreamingEngine(lengths, piece)
    runner, url = await serve(engine.app())
    streaming_engine.append((runner, url))

    class Replica:  # what pools_config reads of an engine
        def __init__(self, url: str) -> None:
            self.url = url

    running = await start_router(pools_config({"p": (1.0, [Replica(url)])}))  # type: ignore[list-item]
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": max(lengths)}, "stream": True}
    async with running.http.post(f"{running.url}/generate", json=body) as response:
        assert response.status == 200
        received = await response.read()
    events = [e for e in received.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert len(events) - 1 == sum(lengths)  # passed through untouched
    pool = running.router.state.pools["p"]
    assert pool.generated_tokens == sum(lengths)
    assert running.router.state.replica("p", url).generated_tokens == sum(lengths)
    assert pool.weight_version == 7
