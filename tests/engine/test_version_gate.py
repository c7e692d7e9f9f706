"""Version-aware requests on the torch engine (docs/engine.md#version-aware-requests).

Real: the engine's HTTP app on loopback (``serve_in_process``) with a tiny Qwen3 and a real
tokenizer, an aiohttp client, and the engine's own ``/update_weight_version`` to move its version.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from multidict import CIMultiDictProxy

from mixrl.rl import weights
from mixrl.rl.engine.version_gate import (
    MAX_VERSION,
    MIN_VERSION_FIELD,
    MIN_VERSION_HEADER,
    VersionRefusal,
    raw_body_min_version,
    request_min_version,
)

from .conftest import serve_in_process, word

GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any, CIMultiDictProxy[str]]:
    async with http.post(url, json=body, headers=headers or {}) as response:
        return response.status, await response.json(content_type=None), response.headers


async def test_an_older_engine_answers_409_naming_both_versions_then_serves_once_updated(
    dense_path: str,
) -> None:
    async with (
        serve_in_process(model_path=dense_path, weight_version=3) as (url, _),
        aiohttp.ClientSession() as http,
    ):
        status, payload, headers = await post(http, f"{url}/generate", {**GENERATE, MIN_VERSION_FIELD: 5})
        assert status == 409
        assert payload[MIN_VERSION_FIELD] == 5 and payload["weight_version"] == 3
        assert payload["error"]["param"] == MIN_VERSION_FIELD and payload["retry"] is True
        assert "version 5 or newer" in payload["error"]["message"]
        assert headers["Retry-After"] == "1"
        refusal = VersionRefusal.read(payload, headers)
        assert refusal == VersionRefusal(5, 3, 1.0, payload["error"]["message"])

        # the header alone is a minimum too; a satisfied one is served as before
        status, payload, _ = await post(http, f"{url}/generate", GENERATE, {MIN_VERSION_HEADER: "4"})
        assert status == 409 and payload[MIN_VERSION_FIELD] == 4
        status, payload, _ = await post(http, f"{url}/generate", {**GENERATE, MIN_VERSION_FIELD: "3"})
        assert status == 200 and payload["meta_info"]["weight_version"] == "3"

        async with http.post(f"{url}/update_weight_version", json={"new_version": 5}) as response:
            assert response.status == 200
        status, payload, _ = await post(http, f"{url}/generate", {**GENERATE, MIN_VERSION_FIELD: 5})
        assert status == 200 and payload["meta_info"]["weight_version"] == "5"


async def test_body_and_header_both_hold_and_bad_values_are_400_naming_where(dense_path: str) -> None:
    async with (
        serve_in_process(model_path=dense_path, weight_version=2) as (url, _),
        aiohttp.ClientSession() as http,
    ):
        # body 1 is met, header 7 is not: the stricter one counts
        status, payload, _ = await post(
            http, f"{url}/generate", {**GENERATE, MIN_VERSION_FIELD: 1}, {MIN_VERSION_HEADER: "7"}
        )
        assert status == 409 and payload[MIN_VERSION_FIELD] == 7
        for bad in (-1, "soon", True, 1.5, MAX_VERSION + 1):
            status, payload, _ = await post(http, f"{url}/generate", {**GENERATE, MIN_VERSION_FIELD: bad})
            assert status == 400, bad
            assert payload["error"]["param"] == MIN_VERSION_FIELD
            assert payload["error"]["message"].startswith(f"{MIN_VERSION_FIELD}: must be an integer")
        status, payload, _ = await post(http, f"{url}/generate", GENERATE, {MIN_VERSION_HEADER: "v3"})
        assert status == 400 and payload["error"]["param"] == MIN_VERSION_HEADER
        # a request that is wrong in another field is 400 first: retrying it would never help
        status, payload, _ = await post(http, f"{url}/generate", {MIN_VERSION_FIELD: 9})
        assert status == 400 and payload["error"]["param"] == "input_ids"


async def test_the_openai_routes_take_the_field_and_the_header(dense_path: str, tokenizer_dir: str) -> None:
    completion = {"prompt": word(5), "max_tokens": 2, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": word(5)}], "max_tokens": 2, "temperature": 0}
    async with (
        serve_in_process(model_path=dense_path, tokenizer_path=tokenizer_dir, weight_version=1) as (url, _),
        aiohttp.ClientSession() as http,
    ):
        for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            status, payload, headers = await post(http, f"{url}{path}", {**body, MIN_VERSION_FIELD: 2})
            assert status == 409, path
            assert (payload[MIN_VERSION_FIELD], payload["weight_version"]) == (2, 1)
            assert headers["Retry-After"] == "1"
            status, payload, _ = await post(http, f"{url}{path}", body, {MIN_VERSION_HEADER: "2"})
            assert status == 409, path
            status, payload, _ = await post(http, f"{url}{path}", {**body, MIN_VERSION_FIELD: 1})
            assert status == 200, (path, payload)
            status, payload, _ = await post(
                http, f"{url}{path}", {**body, "stream": True, MIN_VERSION_FIELD: 2}
            )
            assert status == 409, path


def test_the_gate_reads_raw_bodies_only_when_the_field_is_there() -> None:
    assert MAX_VERSION == weights.MAX_VERSION
    assert raw_body_min_version(b'{"input_ids": [1]}') is None
    assert raw_body_min_version(b'{"input_ids": [1], "min_weight_version": 4}') == 4
    # the name inside generated text is escaped and never read as the field
    assert raw_body_min_version(b'{"text": "say \\"min_weight_version\\": 4"}') is None
    assert raw_body_min_version(b"not json") is None
    assert request_min_version({MIN_VERSION_FIELD: 2}, {MIN_VERSION_HEADER: " "}) == 2
    assert VersionRefusal.read({"error": "step 3 has no batch"}, {}) is None
