"""Sampling defaults from the model's generation_config.json (docs/engine.md, "/generate").

Real: the engine's HTTP app on loopback (``serve_in_process``) on a tiny Qwen3 whose
generation_config.json is written here, a real Hugging Face tokenizer for the ``/v1`` routes.
A config top_k of 1 makes every draw the most likely token, so whether the default applied is read
off the support sizes (1 with it, the whole vocabulary without) and the tokens (greedy with it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from .conftest import serve_in_process

pytestmark = pytest.mark.asyncio

PROMPT = [7, 8, 9]


def with_generation_config(dense_path: str, directory: Path, config: dict[str, Any]) -> str:
    target = directory / "model"
    shutil.copytree(dense_path, target)
    (target / "generation_config.json").write_text(json.dumps({"pad_token_id": 0, **config}))
    return str(target)


async def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def omitted(url: str) -> dict[str, Any]:
    """A /generate request that omits temperature, top_p and top_k."""
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3},
    }
    return await post(url, "/generate", body)


async def greedy(url: str) -> list[int]:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0},
    }
    return list((await post(url, "/generate", body))["output_ids"])


async def test_do_sample_configs_fill_in_omitted_parameters_on_every_route(
    dense_path: str, tokenizer_dir: str, tmp_path: Path
) -> None:
    path = with_generation_config(dense_path, tmp_path, {"do_sample": True, "top_k": 1, "temperature": 0.7})
    async with serve_in_process(model_path=path, tokenizer_path=tokenizer_dir) as (url, service):
        assert service.sampling_defaults == {"temperature": 0.7, "top_k": 1}
        answer = await omitted(url)
        assert answer["meta_info"]["output_token_support_size"] == [1] * 8  # top-k 1 applied
        expected = await greedy(url)
        assert answer["output_ids"] == expected
        # a request's own value wins over the config's
        body = {
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "top_k": 5},
        }
        assert set((await post(url, "/generate", body))["meta_info"]["output_token_support_size"]) == {5}

        completion = await post(
            url,
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "seed": 3, "return_token_ids": True},
        )
        assert completion["choices"][0]["token_ids"] == expected
        chat = await post(
            url,
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "w040"}],
                "max_tokens": 8,
                "ignore_eos": True,
                "seed": 3,
                "return_token_ids": True,
            },
        )
        prompt_ids = chat["choices"][0]["prompt_token_ids"]
        body = {
            "input_ids": prompt_ids,
            "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0},
        }
        assert chat["choices"][0]["response_token_ids"] == (await post(url, "/generate", body))["output_ids"]


async def test_without_do_sample_the_config_values_are_not_used(dense_path: str, tmp_path: Path) -> None:
    path = with_generation_config(dense_path, tmp_path, {"top_k": 1, "temperature": 0.7})
    async with serve_in_process(model_path=path) as (url, service):
        assert service.sampling_defaults == {}
        answer = await omitted(url)
        assert answer["meta_info"]["output_token_support_size"] == [0] * 8  # the whole vocabulary
