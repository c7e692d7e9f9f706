"""Token records from responses shaped like a real SGLang server's (the stand-in for SGLang here),
the client's retries, the command line's errors, and the tiny-model builder."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from mixrl.rl.engine import server
from mixrl.rl.engine.client import EngineClient, EngineError
from mixrl.rl.engine.protocol import EngineResponseError, token_records
from mixrl.rl.tiny_models import create_tiny_checkpoint, tiny_config


def _sglang_response(**meta: Any) -> dict[str, Any]:
    """Only SGLang's standard fields: no output_token_support_size, no per-token versions."""
    base = {
        "id": "r1",
        "finish_reason": {"type": "length", "length": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "weight_version": "4",
        "output_token_logprobs": [[-0.5, 10, None], [-1.2, 30, None]],
        "output_top_logprobs": [
            [[-0.5, 10, None], [-1.5, 11, None], [-2.0, 12, None]],
            [[-0.9, 20, None], [-1.2, 30, None], [-1.2, 31, None]],
        ],
    }
    return {"text": "ab", "output_ids": [10, 30], "meta_info": {**base, **meta}}


def test_sglang_response_with_sampling_mask() -> None:
    # position 1: 31 ties with 30 but only 30 and 20 are in the support; members go first
    response = _sglang_response(output_token_sampling_mask=[[10, 11], [30, 20]])
    first, second = token_records(response)
    assert (first.token_id, first.support_size, first.cand_ids) == (10, 2, [10, 11, 12])
    assert second.support_size == 2 and set(second.cand_ids[:2]) == {20, 30}
    assert second.cand_ids == [20, 30, 31] and second.cand_logprobs == [-0.9, -1.2, -1.2]
    assert {first.weight_version, second.weight_version} == {4}


def test_sglang_response_without_mask_is_full_vocabulary_sampling() -> None:
    records = token_records(_sglang_response())
    assert [r.support_size for r in records] == [0, 0]
    assert records[1].cand_ids == [20, 30, 31]


def test_support_member_without_logprob_is_an_error_naming_the_fix() -> None:
    with pytest.raises(EngineResponseError, match="top_logprobs_num >= top_k"):
        token_records(_sglang_response(output_token_sampling_mask=[[10, 99], [30]]))


def test_mixrl_fields_take_precedence() -> None:
    response = _sglang_response(output_token_support_size=[1, 2], output_token_weight_versions=[3, 4])
    first, second = token_records(response)
    assert (first.support_size, first.weight_version) == (1, 3)
    assert (second.support_size, second.weight_version, second.cand_ids[:2]) == (2, 4, [20, 30])


@pytest.mark.parametrize(("version", "expected"), [("default", 0), ("7", 7), (5, 5)])
def test_weight_version_strings(version: Any, expected: int) -> None:
    assert token_records(_sglang_response(weight_version=version))[0].weight_version == expected


def test_unreadable_responses_are_errors() -> None:
    with pytest.raises(EngineResponseError, match="weight_version"):
        token_records(_sglang_response(weight_version="latest"))
    with pytest.raises(EngineResponseError, match="return_logprob"):
        token_records({"output_ids": [1], "meta_info": {}})
    with pytest.raises(EngineResponseError, match="outside its own support"):
        token_records(_sglang_response(output_token_sampling_mask=[[11], [30]]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_client_retries_until_the_engine_listens() -> None:
    """Stand-in engine: a one-route aiohttp app that starts listening only after the first attempts."""
    port = _free_port()

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": "3"})

    app = web.Application()
    app.router.add_get("/get_weight_version", version)
    runner = web.AppRunner(app)
    await runner.setup()

    async def listen_later() -> None:
        await asyncio.sleep(0.25)
        await web.TCPSite(runner, "127.0.0.1", port).start()

    starter = asyncio.create_task(listen_later())
    try:
        async with EngineClient(f"http://127.0.0.1:{port}", retries=6, backoff_s=0.05) as client:
            assert await client.get_weight_version() == 3
    finally:
        await starter
        await runner.cleanup()


async def test_client_gives_up_with_a_clear_error() -> None:
    async with EngineClient(f"http://127.0.0.1:{_free_port()}", retries=2, backoff_s=0.01) as client:
        with pytest.raises(EngineError, match="cannot reach"):
            await client.get_weight_version()
        assert await client.health() is False


def test_command_line_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert server.main(["--model-path", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model-path" in err[0]
    with pytest.raises(SystemExit):
        server.main(["--model-path", "x", "--weight-precision", "int3"])


def test_tiny_checkpoints_are_deterministic_and_loadable(tmp_path: Path) -> None:
    a = create_tiny_checkpoint(tmp_path / "a", "qwen3_moe", seed=3)
    b = create_tiny_checkpoint(tmp_path / "b", "qwen3_moe", seed=3)
    c = create_tiny_checkpoint(tmp_path / "c", "qwen3_moe", seed=4)
    models = [AutoModelForCausalLM.from_pretrained(p, local_files_only=True) for p in (a, b, c)]
    sa, sb, sc = (m.state_dict() for m in models)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
    assert models[0].config.num_experts == 8 and models[0].config.num_experts_per_tok == 2
    assert {p.name for p in Path(a).iterdir()} >= {
        "config.json",
        "model.safetensors",
        "generation_config.json",
    }
    assert tiny_config("qwen3", 100, hidden_size=128).head_dim == 32
    with pytest.raises(ValueError, match="kind"):
        tiny_config("llama")
