"""The torch engine as a drop-in for SGLang's native API: text in and out through the model's
tokenizer, stop strings, ``n`` > 1, SGLang's batch ``rid`` expansion, streaming as SGLang streams,
``weight_versions`` spans, fields omitted unless asked for, ``/get_load`` and SGLang's metrics.

Real: the engine's HTTP app on a loopback port (tests/engine/conftest.py ``serve_in_process``), a
tiny transformers Qwen3, a real Hugging Face fast tokenizer saved to disk and loaded by the engine
with ``AutoTokenizer`` (``--tokenizer-path``), aiohttp as the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from transformers import AutoTokenizer

from mixrl.rl.engine.protocol import token_records
from mixrl.rl.engine.service import EngineService

from .conftest import save_tiny_tokenizer, serve_in_process, word

pytestmark = pytest.mark.asyncio


@contextlib.asynccontextmanager
async def serving(**config: Any) -> AsyncIterator[tuple[str, EngineService, aiohttp.ClientSession]]:
    """The engine on loopback (``serve_in_process``) and an HTTP session to it."""
    async with serve_in_process(**config) as (url, service), aiohttp.ClientSession() as session:
        yield url, service, session


GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


async def sse_events(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """The ``data:`` payloads of a server-sent-event stream, ``[DONE]`` as the string."""
    async with session.post(url, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = (await response.read()).decode()
    assert raw.endswith("\n\n")
    events = [block for block in raw.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events), raw[:300]
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


async def test_text_in_and_out_through_the_models_tokenizer(dense_path: str, tokenizer_dir: str) -> None:
    hf = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    prompt = " ".join(word(i) for i in (40, 41, 300, 7))
    async with serving(model_path=dense_path, tokenizer_path=tokenizer_dir) as (url, _, session):
        status, by_text = await post(session, f"{url}/generate", {"text": prompt, "sampling_params": GREEDY})
        assert status == 200
        ids = hf.encode(prompt)
        status, by_ids = await post(session, f"{url}/generate", {"input_ids": ids, "sampling_params": GREEDY})
        assert by_text["output_ids"] == by_ids["output_ids"]
        assert by_text["text"] == hf.decode(by_text["output_ids"], skip_special_tokens=True)
        assert by_text["meta_info"]["prompt_tokens"] == len(ids)
        # return_text_in_logprobs: every log-prob triple names its token's text
        status, with_text = await post(
            session,
            f"{url}/generate",
            {
                "text": prompt,
                "sampling_params": GREEDY,
                "return_logprob": True,
                "top_logprobs_num": 2,
                "return_text_in_logprobs": True,
            },
        )
        triples = with_text["meta_info"]["output_token_logprobs"]
        assert [t[2] for t in triples] == [hf.decode([t[1]]) for t in triples]
        assert all(
            c[2] == hf.decode([c[1]]) for row in with_text["meta_info"]["output_top_logprobs"] for c in row
        )


async def test_a_stop_string_ends_the_output_and_is_cut_from_the_text(
    dense_path: str, tokenizer_dir: str
) -> None:
    hf = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    prompt = " ".join(word(i) for i in (9, 90, 201))
    sampling = {**GREEDY, "max_new_tokens": 12}
    async with serving(model_path=dense_path, tokenizer_path=tokenizer_dir) as (url, _, session):
        _, free = await post(session, f"{url}/generate", {"text": prompt, "sampling_params": sampling})
        ids = free["output_ids"]
        # the first word token that has not appeared before it (greedy tiny models repeat)
        k = next(t for t in range(len(ids)) if ids[t] >= 7 and ids[t] not in ids[:t])
        stop = hf.decode([ids[k]])
        upto = hf.decode(ids[: k + 1], skip_special_tokens=True)
        _, cut = await post(
            session,
            f"{url}/generate",
            {"text": prompt, "sampling_params": {**sampling, "stop": [stop, "zzz"]}},
        )
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert cut["output_ids"] == ids[: k + 1]  # the token that completed the stop string is kept
        assert cut["text"] == upto[: upto.index(stop)]
        assert stop not in cut["text"]
        _, kept = await post(
            session,
            f"{url}/generate",
            {"text": prompt, "sampling_params": {**sampling, "stop": stop, "no_stop_trim": True}},
        )
        assert kept["text"].endswith(stop) and kept["output_ids"] == ids[: k + 1]


async def test_without_a_tokenizer_text_fields_are_refused_naming_why(dense_path: str) -> None:
    async with serve_in_process(model_path=dense_path) as (url, service):
        assert service.codec is None  # the tiny checkpoint carries no tokenizer files
        async with aiohttp.ClientSession() as session:
            for body, field in (
                ({"text": "w010"}, "text"),
                ({"input_ids": [1, 2], "sampling_params": {"stop": "w010"}}, "sampling_params.stop"),
                (
                    {"input_ids": [1, 2], "return_logprob": True, "return_text_in_logprobs": True},
                    "return_text_in_logprobs",
                ),
            ):
                status, error = await post(session, f"{url}/generate", body)
                assert status == 400 and error["error"]["param"] == field
                assert "tokenizer" in error["error"]["message"]
            status, ok = await post(
                session, f"{url}/generate", {"input_ids": [1, 2], "sampling_params": GREEDY}
            )
            assert status == 200 and "text" not in ok  # token-in/token-out: no text key, as SGLang
            # a sampling key SGLang's SamplingParams does not have is refused (SGLang raises on it too)
            body = {"input_ids": [1], "sampling_params": {"tempreature": 1}}
            status, error = await post(session, f"{url}/generate", body)
            assert status == 400 and error["error"]["param"] == "sampling_params.tempreature"


async def test_fields_are_omitted_unless_asked_for(dense_path: str) -> None:
    body = {"input_ids": [3, 4, 5], "sampling_params": {**GREEDY, "max_new_tokens": 3}}
    async with serve_in_process(model_path=dense_path) as (url, _), aiohttp.ClientSession() as session:
        _, plain = await post(session, f"{url}/generate", body)
        _, logprobs = await post(session, f"{url}/generate", {**body, "return_logprob": True})
        _, top = await post(
            session, f"{url}/generate", {**body, "return_logprob": True, "top_logprobs_num": 3}
        )
    for absent in ("output_token_logprobs", "output_top_logprobs", "output_token_sampling_mask",
                   "output_token_support_size", "output_token_weight_versions"):  # fmt: skip
        assert absent not in plain["meta_info"]
    assert (
        "output_token_logprobs" in logprobs["meta_info"]
        and "output_top_logprobs" not in logprobs["meta_info"]
    )
    assert [len(row) for row in top["meta_info"]["output_top_logprobs"]] == [3, 3, 3]
    assert plain["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 3}]


async def test_batch_rids_are_expanded_and_n_samples_come_prompt_major(dense_path: str) -> None:
    prompts = [[3, 4, 5], [6, 7]]
    sampling = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True}
    async with serve_in_process(model_path=dense_path) as (url, _), aiohttp.ClientSession() as session:
        _, batch = await post(
            session, f"{url}/generate", {"input_ids": prompts, "rid": "abc", "sampling_params": sampling}
        )
        assert [r["meta_info"]["id"] for r in batch] == ["abc_0", "abc_1"]
        _, single = await post(session, f"{url}/generate", {"input_ids": prompts[0], "rid": "abc"})
        assert single["meta_info"]["id"] == "abc"
        _, listed = await post(session, f"{url}/generate", {"input_ids": prompts, "rid": ["x", "y"]})
        assert [r["meta_info"]["id"] for r in listed] == ["x", "y"]
        status, bad = await post(session, f"{url}/generate", {"input_ids": prompts, "rid": ["x"]})
        assert status == 400 and bad["error"]["param"] == "rid"
        _, samples = await post(
            session, f"{url}/generate", {"input_ids": prompts, "sampling_params": {**sampling, "n": 3}}
        )
        assert [r["meta_info"]["prompt_tokens"] for r in samples] == [3, 3, 3, 2, 2, 2]
        assert len({r["meta_info"]["id"] for r in samples}) == 6
        assert len({tuple(r["output_ids"]) for r in samples[:3]}) > 1  # independent draws
        _, one = await post(
            session, f"{url}/generate", {"input_ids": prompts[0], "sampling_params": {**sampling, "n": 2}}
        )
        assert isinstance(one, list) and len(one) == 2  # n > 1 answers a list, as SGLang


async def test_streaming_is_sglangs_cumulative_sse_and_ends_with_done(dense_path: str) -> None:
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {**GREEDY, "max_new_tokens": 7},
        "return_logprob": True,
    }
    async with serve_in_process(model_path=dense_path) as (url, _), aiohttp.ClientSession() as session:
        _, whole = await post(session, f"{url}/generate", body)
        events = await sse_events(session, f"{url}/generate", {**body, "stream": True})
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert [len(c["output_ids"]) for c in chunks] == list(range(1, 8))
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        assert chunks[-1]["output_ids"] == whole["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
        # the same log-probs (up to float rounding: the second request may reuse cached keys)
        streamed = chunks[-1]["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in streamed] == [t[1] for t in whole["meta_info"]["output_token_logprobs"]]
        assert [t[0] for t in streamed] == pytest.approx(
            [t[0] for t in whole["meta_info"]["output_token_logprobs"]], abs=1e-5
        )
        spaced = await sse_events(
            session,
            f"{url}/generate",
            {
                **body,
                "stream": True,
                "sampling_params": {**body["sampling_params"], "stream_interval": 3},
            },
        )
        assert [len(c["output_ids"]) for c in spaced[:-1]] == [3, 6, 7]
        batch = await sse_events(
            session,
            f"{url}/generate",
            {"input_ids": [[5, 6], [8, 9, 10]], "sampling_params": GREEDY, "stream": True},
        )
        finals = {c["index"]: c for c in batch[:-1] if c["meta_info"]["finish_reason"]}
        assert sorted(finals) == [0, 1] and all(len(c["output_ids"]) == 8 for c in finals.values())


async def test_weight_versions_are_spans_and_records_read_back_from_them(dense_path: str) -> None:
    """A relabel mid-stream: the spans say which tokens each version produced, and the records
    read from the spans alone (as from a real SGLang server) equal mixrl's per-token field."""
    sampling = {"temperature": 1.0, "sampling_seed": 3, "max_new_tokens": 30, "ignore_eos": True}
    body = {"input_ids": [5, 6, 7], "sampling_params": sampling, "return_logprob": True, "stream": True}
    async with (
        serving(model_path=dense_path) as (url, service, session),
        session.post(f"{url}/generate", json=body) as response,
    ):
        last = None
        relabelled = False
        async for line in response.content:
            text = line.decode().strip()
            if not text.startswith("data: {"):
                continue
            last = json.loads(text[6:])
            if not relabelled and len(last["output_ids"]) >= 3:
                await service.set_weight_version(7, abort_all_requests=False)
                relabelled = True
    meta = last["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "7"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 30
    per_token = meta["output_token_weight_versions"]
    assert per_token == [0] * spans[0]["end"] + [7] * (30 - spans[0]["end"])
    sglang_like = {
        **last,
        "meta_info": {k: v for k, v in meta.items() if k != "output_token_weight_versions"},
    }
    assert [r.weight_version for r in token_records(sglang_like)] == per_token


async def test_get_load_is_sglangs_per_rank_list(dense_path: str) -> None:
    async with serve_in_process(model_path=dense_path) as (url, _), aiohttp.ClientSession() as session:
        task = asyncio.create_task(
            post(
                session,
                f"{url}/generate",
                {"input_ids": [[1, 2, 3]] * 3, "sampling_params": {**GREEDY, "max_new_tokens": 60}},
            )
        )
        seen = []
        for _ in range(200):
            async with session.get(f"{url}/get_load") as response:
                seen.append(await response.json())
            if seen[-1][0]["num_reqs"] == 3 and seen[-1][0]["num_tokens"] > 0:
                break
            await asyncio.sleep(0.01)
        await task
        async with session.get(f"{url}/get_load") as response:
            idle = await response.json()
    busy = seen[-1]
    assert set(busy[0]) == {
        "dp_rank",
        "num_reqs",
        "num_waiting_reqs",
        "num_tokens",
        "num_pending_tokens",
        "ts_tic",
    }
    assert busy[0]["dp_rank"] == 0 and busy[0]["num_reqs"] == 3 and busy[0]["num_tokens"] >= 9
    assert idle[0]["num_reqs"] == 0 and idle[0]["num_tokens"] == 0


def _samples(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """``{labels: value}`` of every sample of ``name`` in a Prometheus exposition."""
    out = {}
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        out[frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(1)))] = float(match.group(2))
    return out


def _labels(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


async def test_metrics_have_sglangs_names_labels_and_per_token_latency(dense_path: str) -> None:
    async with serving(model_path=dense_path, served_model_name="tiny") as (url, _, session):
        lengths = [5, 9]
        for n in lengths:
            await post(
                session,
                f"{url}/generate",
                {"input_ids": [1, 2, 3], "sampling_params": {**GREEDY, "max_new_tokens": n}},
            )
        await sse_events(
            session, f"{url}/generate", {"input_ids": [1, 2], "sampling_params": GREEDY, "stream": True}
        )
        abort = {"input_ids": [1, 2], "sampling_params": {**GREEDY, "max_new_tokens": 10_000}}
        unlogged = {"input_ids": [1, 2], "sampling_params": GREEDY, "log_metrics": False}
        assert (await post(session, f"{url}/generate", unlogged))[0] == 200  # not counted below
        task = asyncio.create_task(post(session, f"{url}/generate", abort))
        # Until the long request has made two tokens (was a fixed 0.3 s): inter-token latencies are
        # observed as tokens arrive, one per token after each request's first.
        before = sum(n - 1 for n in lengths) + (8 - 1)
        for _ in range(1000):
            async with session.get(f"{url}/metrics") as response:
                itl = _samples(await response.text(), "sglang:inter_token_latency_seconds_count")
            if itl.get(_labels(engine_type="unified", model_name="tiny"), 0) > before:
                break
            await asyncio.sleep(0.01)
        await post(session, f"{url}/abort_request", {"abort_all": True})
        await task
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
    request = {"engine_type": "unified", "model_name": "tiny"}
    plain, streamed = _labels(**request, is_streaming="false"), _labels(**request, is_streaming="true")
    requests = _samples(text, "sglang:num_requests_total")
    assert requests[plain] == 3  # two finished, one aborted
    assert requests[streamed] == 1
    assert _samples(text, "sglang:num_aborted_requests_total") == {_labels(**request): 1}
    generated = _samples(text, "sglang:generation_tokens_total")
    assert generated[streamed] == 8
    # one inter-token observation per token after each request's first
    itl_count = _samples(text, "sglang:inter_token_latency_seconds_count")[_labels(**request)]
    aborted_tokens = generated[plain] - sum(lengths)
    assert aborted_tokens > 1
    assert itl_count == sum(n - 1 for n in lengths) + (8 - 1) + (aborted_tokens - 1)
    engine = _labels(**request, tp_rank="0", pp_rank="0", moe_ep_rank="0")
    for gauge in ("sglang:num_running_reqs", "sglang:kv_used_tokens", "sglang:kv_available_tokens",
                  "sglang:cache_hit_rate", "sglang:token_usage"):  # fmt: skip
        assert engine in _samples(text, gauge), gauge
    assert "# TYPE sglang:cached_tokens_total counter" in text
    assert _labels(**request, cache_source="device") in _samples(text, "sglang:cached_tokens_total")


async def test_the_prefix_caches_hits_are_exported_as_sglang_does(dense_path: str) -> None:
    """A second turn that extends the first reuses its keys and values: ``meta_info.cached_tokens``,
    ``sglang:cached_tokens_total`` and ``sglang:cache_hit_rate`` say how many, and the evictable /
    available KV gauges account for what the prefix cache holds."""
    sampling = {**GREEDY, "max_new_tokens": 4}
    async with serving(model_path=dense_path, served_model_name="tiny", max_total_tokens=1000) as (
        url,
        _,
        session,
    ):
        _, first = await post(
            session, f"{url}/generate", {"input_ids": [1, 2, 3, 4], "sampling_params": sampling}
        )
        turn = [1, 2, 3, 4, *first["output_ids"], 9, 10]
        _, second = await post(session, f"{url}/generate", {"input_ids": turn, "sampling_params": sampling})
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
    cached = second["meta_info"]["cached_tokens"]
    assert cached >= 4  # at least the first prompt's keys and values were reused
    request = {"engine_type": "unified", "model_name": "tiny"}
    assert _samples(text, "sglang:cached_tokens_total")[_labels(**request, cache_source="device")] == cached
    engine = _labels(**request, tp_rank="0", pp_rank="0", moe_ep_rank="0")
    assert _samples(text, "sglang:cache_hit_rate")[engine] == pytest.approx(cached / (4 + len(turn)))
    evictable = _samples(text, "sglang:kv_evictable_tokens")[engine]
    assert evictable > 0
    assert _samples(text, "sglang:kv_available_tokens")[engine] == 1000 - evictable


async def test_a_tokenizer_that_does_not_fit_is_one_line_at_start(
    dense_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mixrl.rl.engine import server

    assert (
        server.main(["--model-path", dense_path, "--insecure-no-auth", "--tokenizer-path", str(tmp_path)])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"mixrl engine: --tokenizer-path {tmp_path}: cannot load a tokenizer"
    )
    big = tmp_path / "big"
    hf = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "tok"), local_files_only=True)
    hf.add_tokens([f"extra{i}" for i in range(3)])  # 515 ids for a 512-token model
    hf.save_pretrained(str(big))
    assert server.main(["--model-path", dense_path, "--insecure-no-auth", "--tokenizer-path", str(big)]) == 2
    assert "the tokenizer has 515 ids, the model's vocabulary 512" in capsys.readouterr().err


async def test_a_stream_whose_client_goes_away_is_aborted(dense_path: str) -> None:
    body = {"input_ids": [5, 6], "sampling_params": {**GREEDY, "max_new_tokens": 5000}, "stream": True}
    async with serving(model_path=dense_path, served_model_name="tiny") as (url, service, session):
        async with aiohttp.ClientSession() as other, other.post(f"{url}/generate", json=body) as response:
            first = await response.content.readline()
            assert first.startswith(b"data: {")
        # the connection is closed: the request leaves the batch within a step or two
        for _ in range(200):
            async with session.get(f"{url}/get_load") as load:
                if (await load.json())[0]["num_reqs"] == 0:
                    break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the abandoned stream is still running")
        assert service.sched.num_running == 0
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
    aborted = _samples(text, "sglang:num_aborted_requests_total")
    assert aborted == {_labels(engine_type="unified", model_name="tiny"): 1}
