"""Weight updates from the weight store into a running engine process, and queueing under load."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mixrl.local.processes import EngineProcess
from mixrl.rl.engine.client import EngineClient
from mixrl.rl.tiny_models import create_tiny_checkpoint
from mixrl.rl.weights import WeightStore

from .conftest import VOCAB, publish, reference_logprobs, reference_model, until_running

TIE = 1e-4


@pytest.fixture(scope="module")
def weight_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine's --weight-root: every version it is asked to load lies under it."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, weight_root: Path) -> WeightStore:
    """Version 1: different weights, same architecture; published as the trainer would."""
    other = create_tiny_checkpoint(tmp_path_factory.mktemp("other") / "v1", "qwen3", vocab_size=VOCAB, seed=7)
    store = WeightStore(str(weight_root / "store"))
    publish(store, 1, other)
    return store


@pytest.fixture(scope="module")
def small_engine(dense_path: str, weight_root: Path) -> Iterator[EngineProcess]:
    extra = ["--weight-root", str(weight_root)]
    with EngineProcess(dense_path, max_running_requests=2, pool="update-test", extra_args=extra) as process:
        yield process


@pytest.fixture
async def client(small_engine: EngineProcess) -> AsyncIterator[EngineClient]:
    async with EngineClient(small_engine.url) as c:
        yield c


async def _assert_serves(client: EngineClient, path: str) -> None:
    """A fresh greedy generation is the plain forward's argmax of the model at ``path``."""
    model = reference_model(path, "bf16")
    prompt = [11, 12, 13, 14]
    result = await client.generate(prompt, max_new_tokens=10, temperature=0.0)
    ref = reference_logprobs(model, prompt, result.output_ids)
    for t, record in enumerate(result.records):
        assert ref[t, record.token_id] >= ref[t].max() - TIE
        assert record.logprob == pytest.approx(ref[t, record.token_id].item(), abs=2e-4)


async def test_update_mid_generation_labels_later_tokens_with_the_new_version(
    client: EngineClient, store: WeightStore, dense_path: str
) -> None:
    assert await client.get_weight_version() == 0
    await _assert_serves(client, dense_path)
    updated = asyncio.Event()

    async def keep_generating(prompt: list[int]) -> list[list[int]]:
        """Generations one after another until the update is in (each long: past the end-of-text
        token a greedy generation of the tiny model may choose within a few tokens)."""
        runs = []
        while not updated.is_set():
            result = await client.generate(prompt, max_new_tokens=400, temperature=0.0, ignore_eos=True)
            runs.append([r.weight_version for r in result.records])
        return runs

    running = [asyncio.create_task(keep_generating([1, 2, 3]))]
    await until_running(client)
    await asyncio.sleep(0.05)
    running.append(asyncio.create_task(keep_generating([4, 5, 6])))  # staggered: one is always mid-way
    reply = await client.update_weights_from_disk(store.path(1), weight_version=1)
    updated.set()
    assert reply["success"], reply
    runs = [versions for task in running for versions in await task]
    spanning = [versions for versions in runs if 0 in versions and 1 in versions]
    assert spanning, "no generation was running when the new weights were swapped in"
    for versions in spanning:  # some tokens before the update, some after, one switch
        switch = versions.index(1)
        assert 0 < switch < len(versions)
        assert versions == [0] * switch + [1] * (len(versions) - switch)
    assert await client.get_weight_version() == 1
    assert (await client.get_model_info())["weight_version"] == "1"
    await _assert_serves(client, store.path(1))


async def test_corrupt_or_incomplete_version_is_refused_and_the_old_one_kept(
    client: EngineClient, store: WeightStore, weight_root: Path, tmp_path: Path
) -> None:
    before = await client.get_weight_version()
    probe = await client.generate([21, 22, 23], max_new_tokens=8, temperature=0.0)

    weights = load_file(Path(store.path(1)) / "model.safetensors")
    corrupt = Path(store.publish(2, weights))
    shard = corrupt / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside a tensor: same size, different checksum
    shard.write_bytes(bytes(data))

    incomplete = Path(store.publish(3, weights))
    (incomplete / "manifest.json").unlink()  # as if the publisher died before finishing

    wrong = create_tiny_checkpoint(tmp_path / "wide", "qwen3", vocab_size=VOCAB, hidden_size=128)
    mismatched = Path(
        WeightStore(str(weight_root / "wide-store")).publish(4, load_file(Path(wrong) / "model.safetensors"))
    )

    cases = {
        corrupt: "sha256",
        incomplete: "manifest.json is missing",
        mismatched: "shape",
        weight_root / "nowhere": "not a checkpoint directory",
    }
    for path, reason in cases.items():
        reply = await client.update_weights_from_disk(str(path), weight_version=9)
        assert reply["success"] is False and reason in reply["message"], reply
        assert await client.get_weight_version() == before
    again = await client.generate([21, 22, 23], max_new_tokens=8, temperature=0.0)
    assert again.output_ids == probe.output_ids
    assert {r.weight_version for r in again.records} == {before}


async def test_update_weight_version_relabels_without_loading(client: EngineClient) -> None:
    before = await client.get_weight_version()
    await client.update_weight_version(before + 10)
    result = await client.generate([5, 6], max_new_tokens=3, temperature=0.0)
    assert {r.weight_version for r in result.records} == {before + 10}
    await client.update_weight_version(before)


async def test_requests_beyond_max_running_wait_in_the_queue(client: EngineClient) -> None:
    tasks = [
        asyncio.create_task(client.generate([i + 1, 2], max_new_tokens=150, temperature=0.0))
        for i in range(5)
    ]
    peak_queue = peak_running = 0
    while not all(t.done() for t in tasks):
        sample = await client.metrics()
        peak_queue = max(peak_queue, int(sample.get("sglang:num_queue_reqs", 0)))
        peak_running = max(peak_running, int(sample.get("sglang:num_running_reqs", 0)))
        await asyncio.sleep(0.02)
    results = await asyncio.gather(*tasks)
    assert all(r.completion_tokens == 150 for r in results)
    assert peak_running == 2  # --max-running-requests 2
    assert peak_queue >= 2
