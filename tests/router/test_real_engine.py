"""The router in front of real torch engine processes (mixrl engine on a tiny local Qwen3 model)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers.utils import logging as hf_logging

from mixrl.local.processes import EngineProcess
from mixrl.rl.engine.protocol import POOL_HEADER, REPLICA_HEADER, SESSION_HEADER
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model
from mixrl.rl.weights import WeightStore

from .conftest import RunningRouter

hf_logging.disable_progress_bar()

pytestmark = pytest.mark.slow


@pytest.fixture
async def two_engines(tmp_path) -> AsyncIterator[tuple[str, list[EngineProcess]]]:  # type: ignore[no-untyped-def]
    model = create_tiny_checkpoint(tmp_path / "tiny", "qwen3", vocab_size=128, seed=3)
    processes = [EngineProcess(model, pool="p", max_running_requests=8) for _ in range(2)]
    try:
        await asyncio.gather(*(asyncio.to_thread(p.start) for p in processes))
        yield model, processes
    finally:
        await asyncio.gather(*(asyncio.to_thread(p.close) for p in processes))


async def _running_requests(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        if family.name in ("sglang:num_running_reqs", "sglang_num_running_reqs"):
            return sum(s.value for s in family.samples)
    return 0.0


async def test_sessions_reload_and_survive_a_killed_engine(two_engines, start_router, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from .conftest import pools_config

    model, processes = two_engines

    class _Url:  # pools_config takes objects with a .url
        def __init__(self, url: str) -> None:
            self.url = url

    running: RunningRouter = await start_router(pools_config({"p": (None, [_Url(p.url) for p in processes])}))
    http = running.http
    body = {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": -1},
        "return_logprob": True,
    }

    async def turn(session: str, payload: dict) -> aiohttp.ClientResponse:  # type: ignore[type-arg]
        response = await http.post(f"{running.url}/generate", json=payload, headers={SESSION_HEADER: session})
        await response.read()
        return response

    first = await turn("s", body)
    assert first.status == 200, await first.text()
    replica = first.headers[REPLICA_HEADER]
    assert first.headers[POOL_HEADER] == "p"
    answer = json.loads(await first.read())
    assert len(answer["output_ids"]) == 6 and answer["meta_info"]["weight_version"] == "0"

    # Weight reload fan-out: both engines load version 1 from the weight store while the session goes on.
    trained = {name: tensor + 0.01 for name, tensor in load_model(model).state_dict().items()}
    version_path = WeightStore(str(tmp_path / "store")).publish(1, trained)
    reload = {"model_path": version_path, "weight_version": "1", "flush_cache": True}
    async with http.post(f"{running.url}/update_weights_from_disk", json=reload) as response:
        result = await response.json()
        assert response.status == 200, result
    assert sorted(r["replica"] for r in result["results"]) == sorted(p.url for p in processes)
    for process in processes:
        async with http.get(f"{process.url}/get_weight_version") as response:
            assert (await response.json())["weight_version"] == "1"
    second = await turn("s", body)
    assert second.headers[REPLICA_HEADER] == replica  # sticky
    assert json.loads(await second.read())["meta_info"]["weight_version"] == "1"

    # Kill the session's engine (SIGKILL) while a long turn is being generated.
    victim = next(p for p in processes if p.url == replica)
    survivor = next(p for p in processes if p.url != replica)
    long_turn = {
        **body,
        "sampling_params": {**body["sampling_params"], "max_new_tokens": 3000, "ignore_eos": True},
    }
    pending = asyncio.create_task(turn("s", long_turn))
    while await _running_requests(http, victim.url) < 1:
        assert not pending.done(), await pending.result().text()
        await asyncio.sleep(0.02)
    assert victim.process is not None
    victim.process.kill()
    failed = await pending
    assert failed.status == 503
    assert json.loads(await failed.read())["retry"] is True
    retried = await turn("s", body)  # the rollout retries the same turn
    assert retried.status == 200
    assert retried.headers[REPLICA_HEADER] == survivor.url
    assert running.router.state.replica("p", victim.url).ready is False

    # Measured capacity (capacity null): the surviving engine's throughput was sampled at a probe.
    await running.router.poll_once()
    pool = (await running.get_json("/pools"))["pools"][0]
    assert pool["ready_replicas"] == 1
    measured = {r["url"]: r["measured_throughput"] for r in pool["replicas"]}
    assert measured[survivor.url] is not None and measured[survivor.url] > 0
    # A fleet that declares nothing: capacities relative to its pools' mean throughput (one pool: 1.0).
    assert pool["capacity_per_replica"] == pool["capacity_measured"] == 1.0
    assert pool["capacity_source"] == "measured"
