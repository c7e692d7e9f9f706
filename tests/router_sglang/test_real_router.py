"""mixrl's requests through the real sglang-router (0.3.2) to real torch engines.

What the router sends on is read at the :class:`~.conftest.Recorder` between it and each engine,
so every assertion about "what arrives" is about the bytes the engine received.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from mixrl.rl.engine.client import EngineClient, request_body
from mixrl.rl.engine.protocol import EngineResponseError

from ..engine.conftest import word
from ..router.conftest import pools_config, start_router
from .conftest import Recorder, recording

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]
__all__ = ["start_router"]  # mixrl's router, the fixture of tests/router/conftest.py

PROMPT = [11, 12, 13, 14, 15]
TRUNCATED = {"temperature": 1.0, "top_p": 0.9, "top_k": 8}
"""A truncating rule: mixrl asks for the sampling support (return_sampling_mask)."""


ROUTER_ADDS = {
    "model": None,
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}
"""What sglang-router 0.3.2 adds to every non-streamed /generate body (docs/router.md)."""


def generate_requests(recorders: list[Recorder]) -> list[dict[str, Any]]:
    return [seen.json() for r in recorders for seen in r.requests("/generate")]


def assert_carried(sent: dict[str, Any], received: dict[str, Any], dropped: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """Every field mixrl sent arrived with its value (``sampling_params`` key by key), but ``dropped``."""
    for key, value in sent.items():
        if key in dropped:
            assert key not in received, f"{key} arrived: the router now carries it (update docs/router.md)"
        elif key == "sampling_params":
            for name, setting in value.items():
                assert received[key].get(name) == setting, f"sampling_params.{name}: {received[key]}"
        else:
            assert received.get(key) == value, f"{key}: sent {value!r}, received {received.get(key)!r}"


async def test_candidates_and_records_arrive_unchanged(behind_router) -> None:  # type: ignore[no-untyped-def]
    params = {"max_new_tokens": 6, "temperature": 1.0, "top_logprobs_num": 5, "sampling_seed": 3}
    async with behind_router() as (url, recorders), EngineClient(url) as client:
        result = await client.generate(PROMPT, **params, stop_token_ids=[2], rid="turn-1")
        sent = request_body(PROMPT, **params, stop_token_ids=[2], rid="turn-1")
        (received,) = generate_requests(recorders)
    assert_carried(sent, received)
    added = {k: v for k, v in received.items() if k not in sent}
    assert added == ROUTER_ADDS  # the router's own additions, at values SGLang and the engine accept
    assert len(result.records) == 6 and result.finish_reason == "length"
    for record in result.records:
        assert len(record.cand_ids) >= 5 and record.weight_version == 0
        assert record.support_size == 0  # an untruncated rule has no support to record


async def test_the_sampling_mask_request_is_dropped_by_the_router(behind_router, engines) -> None:  # type: ignore[no-untyped-def]
    """The router re-serialises the body without ``return_sampling_mask``.  Behind it the torch
    engine still reports each token's support size (mixrl's ``output_token_support_size``, sent
    whenever log-probs are), so the records equal those the engine gives directly."""
    params = {**TRUNCATED, "max_new_tokens": 6, "sampling_seed": 11}
    sent = request_body(PROMPT, **params)
    assert sent["return_sampling_mask"] is True and sent["top_logprobs_num"] >= 8
    async with behind_router() as (url, recorders), EngineClient(url) as client:
        routed = await client.generate(PROMPT, **params)
        (received,) = generate_requests(recorders)
    assert_carried(sent, received, dropped={"return_sampling_mask"})
    async with EngineClient(engines[0].url) as direct_client:
        direct = await direct_client.generate(PROMPT, **params)
    assert [r.token_id for r in routed.records] == [r.token_id for r in direct.records]
    assert [r.support_size for r in routed.records] == [r.support_size for r in direct.records]
    assert [r.cand_ids[: r.support_size] for r in routed.records] == [
        r.cand_ids[: r.support_size] for r in direct.records
    ]
    assert all(r.support_size >= 1 for r in routed.records)


async def test_behind_the_router_sglangs_answer_loses_the_support_and_the_client_says_so(  # type: ignore[no-untyped-def]
    behind_router,
) -> None:
    """An engine answering with SGLang's fields only (the mask fields exist only when asked for):
    directly, the client records the support; behind the router, the request lost
    ``return_sampling_mask`` and the client fails naming the field, rather than recording a
    truncated rule's tokens as untruncated."""
    params = {**TRUNCATED, "max_new_tokens": 4, "sampling_seed": 5}
    async with behind_router(sglang_fields_only=True) as (url, recorders):
        async with EngineClient(recorders[0].url) as direct_client:  # the stand-in itself, no router
            direct = await direct_client.generate(PROMPT, **params)
        assert all(r.support_size >= 1 for r in direct.records)
        async with EngineClient(url, retries=0) as client:
            with pytest.raises(EngineResponseError, match="output_token_sampling_mask: absent"):
                await client.generate(PROMPT, **params)
        # without the client's check the same answer reads as support 0 on every token: silent
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{url}/generate", json=request_body(PROMPT, **params)) as answer,
        ):
            meta = (await answer.json())["meta_info"]
        assert "output_token_sampling_mask" not in meta and "output_token_support_size" not in meta


async def test_text_generate_and_streaming(behind_router) -> None:  # type: ignore[no-untyped-def]
    text_body = {
        "text": f"{word(40)} {word(41)} {word(42)}",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
    }
    stream_body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    }
    async with behind_router() as (url, recorders), aiohttp.ClientSession() as http:
        async with http.post(f"{url}/generate", json=text_body) as answer:
            assert answer.status == 200, await answer.text()
            text_answer = await answer.json()
        async with http.post(f"{url}/generate", json=stream_body) as answer:
            assert answer.status == 200, await answer.text()
            assert answer.headers["Content-Type"].startswith("text/event-stream")
            raw = (await answer.read()).decode()
        received = generate_requests(recorders)
    (text_request,) = [b for b in received if "text" in b]  # round robin: one request per engine
    (stream_request,) = [b for b in received if "input_ids" in b]
    assert text_request["text"] == text_body["text"]
    assert len(text_answer["output_ids"]) == 4
    assert text_answer["text"].split() == [word(i) for i in text_answer["output_ids"]]
    events = [line.removeprefix("data: ") for line in raw.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks[-1]["output_ids"]) == 5 and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert stream_request["stream"] is True


async def test_power_of_two_polls_get_load_and_routes(behind_router) -> None:  # type: ignore[no-untyped-def]
    async with behind_router(policy="power_of_two") as (url, recorders), EngineClient(url) as client:
        deadline = time.monotonic() + 45
        while not all(r.requests("/get_load") for r in recorders):
            assert time.monotonic() < deadline, "the router never polled /get_load"
            await asyncio.sleep(0.2)
        results = await asyncio.gather(*(client.generate(PROMPT, max_new_tokens=3) for _ in range(4)))
        async with aiohttp.ClientSession() as http, http.get(f"{recorders[0].engine_url}/get_load") as answer:
            load = await answer.json()
    assert all(len(r.records) == 3 for r in results)
    assert isinstance(load, list) and {"num_reqs", "num_tokens", "dp_rank"} <= set(load[0])
    assert all(s.method == "GET" for r in recorders for s in r.requests("/get_load"))


async def test_mixrls_router_carries_the_mask_request_byte_for_byte(engines, start_router) -> None:  # type: ignore[no-untyped-def]
    """The same truncated request through mixrl's router, to engines answering with SGLang's fields
    only: the body arrives exactly as sent and the support comes back in the mask."""
    params = {**TRUNCATED, "max_new_tokens": 4, "sampling_seed": 5}
    async with recording(engines, sglang_fields_only=True) as recorders:
        running = await start_router(pools_config({"p": (None, recorders)}))
        async with EngineClient(running.url) as client:
            result = await client.generate(PROMPT, **params)
        (received,) = generate_requests(recorders)
    assert received == request_body(PROMPT, **params)
    assert all(r.support_size >= 1 for r in result.records)
