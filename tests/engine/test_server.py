"""The torch engine as a real HTTP server on loopback, through the client and through raw HTTP."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from mixrl.local.processes import EngineProcess
from mixrl.rl import metrics
from mixrl.rl.engine.client import EngineClient, EngineError

from . import reference
from .conftest import VOCAB, random_prompts, reference_logprobs, reference_model, until_running

TIE = 1e-4


@pytest.fixture
async def client(engine: EngineProcess) -> AsyncIterator[EngineClient]:
    async with EngineClient(engine.url) as c:
        yield c


@pytest.fixture
async def http(engine: EngineProcess) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    async with aiohttp.ClientSession() as session:
        yield session, engine.url


async def _post(http: tuple[aiohttp.ClientSession, str], path: str, body: Any) -> tuple[int, Any]:
    session, url = http
    kwargs = {"data": body} if isinstance(body, str | bytes) else {"json": body}
    async with session.post(f"{url}{path}", **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_greedy_matches_plain_transformers_forward(client: EngineClient, dense_path: str) -> None:
    model = reference_model(dense_path, "bf16")
    prompts = random_prompts(4, seed=10)
    results = await asyncio.gather(
        *(client.generate(p, max_new_tokens=16, temperature=0.0, top_logprobs_num=3) for p in prompts)
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.finish_detail == {"type": "length", "length": 16}
        ref = reference_logprobs(model, prompt, result.output_ids)
        for t, record in enumerate(result.records):
            assert ref[t, record.token_id] >= ref[t].max() - TIE  # the argmax of the plain forward
            assert record.logprob == pytest.approx(ref[t, record.token_id].item(), abs=2e-4)
            assert record.support_size == 1 and record.cand_ids[0] == record.token_id
            assert record.weight_version == 0


async def test_logprobs_and_top_candidates_match_the_model(client: EngineClient, dense_path: str) -> None:
    model = reference_model(dense_path, "bf16")
    prompt = random_prompts(1, seed=11)[0]
    result = await client.generate(
        prompt, max_new_tokens=12, temperature=0.7, top_logprobs_num=5, sampling_seed=3
    )
    ref = reference_logprobs(model, prompt, result.output_ids, temperature=0.7)
    for t, record in enumerate(result.records):
        assert record.support_size == 0  # no truncation: sampled from the whole vocabulary
        assert record.logprob == pytest.approx(ref[t, record.token_id].item(), abs=2e-4)
        assert record.cand_logprobs == sorted(record.cand_logprobs, reverse=True)
        assert record.cand_logprobs == pytest.approx(ref[t, record.cand_ids].tolist(), abs=2e-4)
        assert record.cand_ids == reference.order(ref[t].tolist())[:5]
        # log-probs are a distribution's: the candidates' mass is at most 1
        assert sum(math.exp(lp) for lp in record.cand_logprobs) <= 1.0 + 1e-5


async def test_top_p_support_is_the_top_p_set_and_holds_the_sampled_token(
    http: tuple[aiohttp.ClientSession, str], client: EngineClient, dense_path: str
) -> None:
    model = reference_model(dense_path, "bf16")
    prompts = random_prompts(3, seed=12)
    top_p, temperature = 0.8, 1.0
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 20, "temperature": temperature, "top_p": top_p, "top_k": -1},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_sampling_mask": True,
    }
    status, responses = await _post(http, "/generate", body)
    assert status == 200 and len(responses) == 3
    sizes_seen = set()
    for prompt, response in zip(prompts, responses, strict=True):
        meta = response["meta_info"]
        ref = reference_logprobs(model, prompt, response["output_ids"], temperature)
        for t, token in enumerate(response["output_ids"]):
            mask = meta["output_token_sampling_mask"][t]
            assert token in mask
            assert meta["output_token_support_size"][t] == len(mask)
            expected = reference.support(ref[t].tolist(), -1, top_p, 0.0)
            if mask != expected:  # only a float tie at the boundary may differ
                assert reference.boundary_gap(ref[t].tolist(), top_p, len(expected)) < 1e-5
            # S is the leading |S| candidates, which are at least max(|S|, top_logprobs_num)
            top = meta["output_top_logprobs"][t]
            assert [e[1] for e in top[: len(mask)]] == mask
            assert len(top) == max(len(mask), 2)
            mass = sum(math.exp(ref[t, i].item()) for i in mask)
            renormalized = ref[t, token].item() - math.log(mass)
            assert meta["output_token_sampling_logprobs"][t] == pytest.approx(renormalized, abs=2e-4)
            sizes_seen.add(len(mask))
    assert len(sizes_seen) > 3  # the support really varies per position
    # the client builds the same records from this response shape
    result = await client.generate(prompts[0], max_new_tokens=5, temperature=1.0, top_p=top_p)
    for record in result.records:
        assert 0 < record.support_size <= len(record.cand_ids)
        assert record.token_id in record.cand_ids[: record.support_size]


async def test_concurrent_requests_finish_and_match_sequential_results(client: EngineClient) -> None:
    prompts = random_prompts(10, seed=13)

    def kwargs(i: int) -> dict[str, Any]:
        if i % 2:
            return {"temperature": 0.0, "max_new_tokens": 8 + i}
        return {"temperature": 0.9, "top_k": 20, "sampling_seed": i, "max_new_tokens": 8 + i}

    together = await asyncio.gather(*(client.generate(p, **kwargs(i)) for i, p in enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        alone = await client.generate(prompt, **kwargs(i))
        assert together[i].output_ids == alone.output_ids
        assert [r.logprob for r in together[i].records] == pytest.approx(
            [r.logprob for r in alone.records], abs=1e-4
        )
        assert together[i].completion_tokens == 8 + i


async def test_a_request_arriving_later_joins_the_running_batch(client: EngineClient) -> None:
    long = asyncio.create_task(client.generate([5, 6, 7], max_new_tokens=400, temperature=0.0))
    await until_running(client)
    short = await client.generate([8, 9], max_new_tokens=4, temperature=0.0)
    assert short.completion_tokens == 4
    assert not long.done()  # the short request did not wait for the long one
    assert (await long).completion_tokens == 400


async def test_batched_input_ids_and_per_prompt_parameters(http: tuple[aiohttp.ClientSession, str]) -> None:
    body = {
        "input_ids": [[1, 2, 3], [4, 5]],
        "sampling_params": [{"max_new_tokens": 3, "temperature": 0}, {"max_new_tokens": 5, "temperature": 0}],
        "rid": ["a", "b"],
        "return_logprob": [True, False],
    }
    status, responses = await _post(http, "/generate", body)
    assert status == 200
    assert [r["meta_info"]["id"] for r in responses] == ["a", "b"]
    assert [len(r["output_ids"]) for r in responses] == [3, 5]
    assert "output_token_logprobs" in responses[0]["meta_info"]
    assert "output_token_logprobs" not in responses[1]["meta_info"]
    assert responses[0]["meta_info"]["prompt_tokens"] == 3
    assert responses[1]["meta_info"]["weight_version"] == "0"


MALFORMED = [
    ({"input_ids": "hello"}, "input_ids"),
    ({"text": "hello"}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, VOCAB]}, "input_ids[1]"),
    ({"input_ids": [[1], [2, -1]]}, "input_ids[1][1]"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2.5}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"stop": ["\n"]}}, "sampling_params.stop"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"input_ids": [1], "sampling_params": {"logit_bias": {"1": 2.0}}}, "sampling_params.logit_bias"),
    ({"input_ids": [1], "sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
    # SGLang builds SamplingParams(**sampling_params): a key it does not have is an error there too
    ({"input_ids": [1], "sampling_params": {"some_future_knob": 1}}, "sampling_params.some_future_knob"),
    ({"input_ids": [1], "lora_path": "/adapters/a"}, "lora_path"),
    ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
    ({"input_ids": [1], "token_ids_logprob": [3]}, "token_ids_logprob"),
    (
        {"input_ids": [1], "sampling_params": {"stop_token_ids": [1, "x"]}},
        "sampling_params.stop_token_ids[1]",
    ),
    ({"input_ids": [1], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1], "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
    ({"input_ids": [1], "return_sampling_mask": 1}, "return_sampling_mask"),
    ({"input_ids": [1], "stream": "yes"}, "stream"),
    ({"input_ids": [1], "rid": 7}, "rid"),
    ("{not json", "body"),
    ([1, 2, 3], "body"),
]


@pytest.mark.parametrize(("body", "field"), MALFORMED, ids=[f for _, f in MALFORMED])
async def test_malformed_request_gets_400_naming_the_field(
    http: tuple[aiohttp.ClientSession, str], body: Any, field: str
) -> None:
    status, payload = await _post(http, "/generate", body)
    assert status == 400
    assert payload["error"]["param"] == field
    assert payload["error"]["message"].startswith(f"{field}: ")
    # and the server keeps serving
    status, ok = await _post(
        http, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    )
    assert status == 200 and len(ok["output_ids"]) == 2


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/update_weights_from_disk", {}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "/x", "weight_version": "v1"}, "weight_version"),
        ("/update_weights_from_disk", {"model_path": "/x", "abort_all_requests": "no"}, "abort_all_requests"),
        ("/pause_generation", {"mode": "sideways"}, "mode"),
        ("/update_weight_version", {}, "new_version"),
    ],
)
async def test_malformed_control_request_gets_400_naming_the_field(
    http: tuple[aiohttp.ClientSession, str], path: str, body: Any, field: str
) -> None:
    status, payload = await _post(http, path, body)
    assert status == 400 and payload["error"]["param"] == field


async def test_client_raises_with_the_field_name(client: EngineClient) -> None:
    with pytest.raises(EngineError) as info:
        await client.generate([1, 2], top_p=1.5)
    assert info.value.status == 400 and info.value.field == "sampling_params.top_p"


async def test_unknown_fields_are_ignored(http: tuple[aiohttp.ClientSession, str]) -> None:
    body = {
        "model": None,  # what the sglang-router adds
        "input_ids": [3, 4],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "lora_path": None,
        "custom_field": {"nested": [1, 2]},
    }
    status, payload = await _post(http, "/generate", body)
    assert status == 200 and len(payload["output_ids"]) == 3


async def test_info_and_health_endpoints(http: tuple[aiohttp.ClientSession, str], dense_path: str) -> None:
    session, url = http
    for path in ("/get_model_info", "/model_info"):
        async with session.get(url + path) as resp:
            info = await resp.json()
            assert info["model_path"] == dense_path and info["is_generation"] is True
            assert info["weight_version"] == "0"
    for path in ("/get_server_info", "/server_info"):
        async with session.get(url + path) as resp:
            info = await resp.json()
            assert info["weight_precision"] == "bf16" and info["vocab_size"] == VOCAB
            assert info["quantization"]["kept"]["lm_head"] == "lm_head"
    for path in ("/health", "/health_generate", "/flush_cache"):
        async with session.get(url + path) as resp:
            assert resp.status == 200, path
    async with session.get(url + "/get_weight_version") as resp:
        assert await resp.json() == {"weight_version": "0"}


async def test_metrics_use_sglang_names_and_count_tokens(client: EngineClient) -> None:
    text = await client.metrics_text()
    for spec in metrics.ENGINE_METRICS:
        assert f"# TYPE {spec.name} {spec.kind}" in text, spec.name
    before = await client.metrics()
    results = await asyncio.gather(
        client.generate([1, 2, 3], max_new_tokens=7), client.generate([4, 5], max_new_tokens=5)
    )
    after = await client.metrics()
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 12
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == 5
    count = "sglang:e2e_request_latency_seconds_count"
    assert after[count] - before[count] == 2
    assert after["sglang:gen_throughput"] > 0
    assert sum(r.completion_tokens for r in results) == 12


async def test_pause_in_place_holds_requests_and_continue_resumes(client: EngineClient) -> None:
    task = asyncio.create_task(client.generate([1, 2], max_new_tokens=300, temperature=0.0))
    try:
        await until_running(client)
        await client.pause_generation("in_place")
        first = (await client.metrics())["sglang:generation_tokens_total"]
        await asyncio.sleep(0.3)
        held = await client.metrics()
        assert held["sglang:generation_tokens_total"] == first
        assert held["sglang:num_paused_reqs"] == 1
        assert not task.done()
    finally:
        await client.continue_generation()
    result = await task
    assert result.finish_detail == {"type": "length", "length": 300}


async def test_pause_abort_finishes_requests_with_an_abort_reason(client: EngineClient) -> None:
    task = asyncio.create_task(client.generate([1, 2], max_new_tokens=2000, temperature=0.0))
    try:
        await until_running(client)
        await client.pause_generation("abort")
        result = await task
    finally:
        await client.continue_generation()
    assert result.aborted and result.completion_tokens < 2000
    assert (await client.generate([3], max_new_tokens=2)).completion_tokens == 2
