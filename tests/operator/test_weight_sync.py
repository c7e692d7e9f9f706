"""The engine weight-sync sidecar: a real weight store on disk and a real torch engine process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import pytest
import torch
from transformers.utils import logging as hf_logging

from mixrl.api.launch import LABELLED_FILE
from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedPool, ResolvedRun, resolve
from mixrl.local.processes import EngineProcess
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine import weight_sync
from mixrl.rl.engine.client import EngineClient
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model
from mixrl.rl.weights import WeightStore

from ..fakes import serve
from .sglang_standin import FLUSH_REFUSED, StandInSGLang
from .support import small_run

hf_logging.disable_progress_bar()

Obj = dict[str, Any]
TOKEN = AuthToken("weight-sync-test-token-" + "w" * 24)


def resolved_run(store: Path) -> ResolvedRun:
    manifest = small_run(
        pools=[
            {
                "name": "emul",
                "gpuType": "cpu",
                "engine": "torch",
                "weightPrecision": "fp8",
                "gpusPerReplica": 0,
            },
            {"name": "b200", "gpuType": "B200", "weightPrecision": "nvfp4"},
        ]
    )
    run = parse_document(manifest)
    assert isinstance(run, RLRun)
    resolved = resolve(run)
    # The pods' store, here a directory of the test's (under /tmp, which a spec may not name).
    weights = resolved.weights.model_copy(update={"store": f"file://{store}"})
    return resolved.model_copy(update={"weights": weights})


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[str, WeightStore, ResolvedRun]:
    model_dir = create_tiny_checkpoint(tmp_path / "tiny", "qwen3", vocab_size=128, seed=5)
    store_dir = tmp_path / "store"
    run = resolved_run(store_dir)
    return model_dir, WeightStore(run.weights.store), run


def publish(store: WeightStore, model_dir: str, version: int, scale: float = 1.0) -> None:
    model = load_model(model_dir)
    state = {
        name: (t.detach().float() * scale).to(torch.bfloat16).contiguous()
        for name, t in model.state_dict().items()
    }
    store.publish(version, state, {"step": version}, model.config.to_dict())


async def test_once_links_the_checkpoint_each_pool_starts_from(
    tiny: tuple[str, WeightStore, ResolvedRun], tmp_path: Path
) -> None:
    model_dir, store, run = tiny
    waiting = asyncio.create_task(weight_sync.prepare(store, run.pool("emul"), tmp_path / "emul", 0.02, 30))
    await asyncio.sleep(0.1)
    assert not waiting.done(), "no version yet: the init container waits"
    await asyncio.to_thread(publish, store, model_dir, 0)
    assert await waiting == 0
    assert (tmp_path / "emul" / "current").resolve() == Path(
        store.path(0)
    ).resolve()  # torch: the BF16 version
    # An SGLang NVFP4 pool starts from the version converted to NVFP4, written once into the store.
    assert await weight_sync.prepare(store, run.pool("b200"), tmp_path / "b200", 0.02, 30) == 0
    converted = (tmp_path / "b200" / "current").resolve()
    assert converted == (Path(store.path(0)) / "nvfp4").resolve()
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" in config or (converted / "hf_quant_config.json").exists()


async def test_once_gives_up_after_its_timeout_with_one_line(
    tiny: tuple[str, WeightStore, ResolvedRun], tmp_path: Path
) -> None:
    _, store, run = tiny
    with pytest.raises(weight_sync.SyncError, match=r"^no weight version appeared in file://.* within 0 s$"):
        await weight_sync.prepare(store, run.pool("emul"), tmp_path / "out", 0.01, 0.05)


@pytest.mark.slow
async def test_the_sidecar_moves_a_running_engine_to_each_new_version(
    tiny: tuple[str, WeightStore, ResolvedRun], tmp_path: Path
) -> None:
    model_dir, store, run = tiny
    pool = run.pool("emul")
    output = tmp_path / "engine-weights"
    await asyncio.to_thread(publish, store, model_dir, 0)
    await weight_sync.prepare(store, pool, output, 0.02, 30)
    # The engine requires the run's token on its control endpoints, as in a pod.
    engine = EngineProcess(output / "current", weight_precision="fp8", pool="emul", auth_token=TOKEN)
    await asyncio.to_thread(engine.start)
    stop = asyncio.Event()
    try:
        async with EngineClient(engine.url, auth_token=TOKEN) as client:
            follower = asyncio.create_task(weight_sync.follow(store, pool, output, client, 0.05, stop))
            await asyncio.to_thread(publish, store, model_dir, 1, 1.5)
            # The link moves just after the engine reports the version: wait for both.
            served_v1 = Path(store.path(1)).resolve()
            for _ in range(400):
                if await client.get_weight_version() == 1 and (output / "current").resolve() == served_v1:
                    break
                await asyncio.sleep(0.05)
            assert await client.get_weight_version() == 1
            assert (output / "current").resolve() == served_v1
            # A trainer that resumes from an older checkpoint removes newer versions: follow it back.
            await asyncio.to_thread(store.storage.remove, "v00000001")
            for _ in range(400):
                if await client.get_weight_version() == 0:
                    break
                await asyncio.sleep(0.05)
            assert await client.get_weight_version() == 0
            stop.set()
            await asyncio.wait_for(follower, 10)
        # Without the token the engine refuses the update: one line, not an endless retry.
        await asyncio.to_thread(publish, store, model_dir, 2, 0.5)
        async with EngineClient(engine.url) as anonymous:
            with pytest.raises(weight_sync.SyncError) as refused:
                await asyncio.wait_for(
                    weight_sync.follow(store, pool, output, anonymous, 0.05, asyncio.Event()), 60
                )
            assert await anonymous.get_weight_version() == 0
        assert str(refused.value).startswith(
            "the engine refused the token: POST /update_weights_from_disk: HTTP 401: unauthorized"
        )
        assert TOKEN.reveal() not in engine.log_tail(200)
    finally:
        await asyncio.to_thread(engine.close)


class TwoVersions(NamedTuple):
    model_dir: str
    store: WeightStore
    pool: ResolvedPool
    output: Path
    """The engine's weights directory (``current`` links the version it serves)."""


@pytest.fixture
async def two_versions(tiny: tuple[str, WeightStore, ResolvedRun], tmp_path: Path) -> TwoVersions:
    """Versions 0 and 1 (scaled by 1.5) published; the pool ``emul`` and its engine's weights directory."""
    model_dir, store, run = tiny
    await asyncio.to_thread(publish, store, model_dir, 0)
    await asyncio.to_thread(publish, store, model_dir, 1, 1.5)
    return TwoVersions(model_dir, store, run.pool("emul"), tmp_path / "engine-weights")


@asynccontextmanager
async def serving(standin: StandInSGLang) -> AsyncIterator[str]:
    """The stand-in on a free loopback port; yields its URL."""
    runner, url = await serve(standin.app())
    try:
        yield url
    finally:
        await runner.cleanup()


@asynccontextmanager
async def following(versions: TwoVersions, engine: EngineClient, poll_s: float) -> AsyncIterator[None]:
    """The sidecar's follow loop in the background; stopped, and awaited (10 s at most), at the end."""
    stop = asyncio.Event()
    store, pool, output = versions.store, versions.pool, versions.output
    follower = asyncio.create_task(weight_sync.follow(store, pool, output, engine, poll_s, stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(follower, 10)


async def load(url: str, requests: int, tokens: int) -> list[list[list[str]]]:
    """``requests`` concurrent generations of ``tokens`` tokens; each token as [weights, label]."""
    async with aiohttp.ClientSession() as http:

        async def one() -> list[list[str]]:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": tokens}}
            async with http.post(f"{url}/generate", json=body) as resp:
                assert resp.status == 200
                return (await resp.json())["tokens"]

        return list(await asyncio.gather(*(one() for _ in range(requests))))


async def test_a_weight_update_under_load_is_one_sglang_accepts(two_versions: TwoVersions) -> None:
    _, store, pool, output = two_versions
    weight_sync.point_current(output, store.path(0))
    standin = StandInSGLang(weights=store.path(0), label="0")
    async with serving(standin) as url, EngineClient(url) as engine:
        generating = asyncio.create_task(load(url, requests=4, tokens=60))
        while len(standin.unfinished) < 4 or standin.produced < 4 * 10:
            await asyncio.sleep(0.005)
        await weight_sync.sync_engine(store, pool, output, engine, 1, served=0)
        assert len(standin.unfinished) == 4, "the update happened while all four requests ran"
        outputs = await generating
    assert standin.answers[-1]["success"] and standin.loads[-1]["flush_cache"] is False
    assert standin.label == "1" and (output / "current").resolve() == Path(store.path(1)).resolve()
    # Nothing aborted or retracted: each request finished, its early tokens from version 0,
    # its late ones from version 1, and every token labelled with the weights that produced it.
    label_of = {store.path(0): "0", store.path(1): "1"}
    for tokens in outputs:
        assert len(tokens) == 60
        assert {label for _, label in tokens} == {"0", "1"}
        assert all(label == label_of[weights] for weights, label in tokens)


async def test_the_stand_in_refuses_a_flush_after_an_in_place_pause_as_sglang_does() -> None:
    # The sequence mixrl used to send: SGLang loads the weights, refuses the flush and keeps
    # reporting the old version, so new tokens would carry the wrong label.
    standin = StandInSGLang(weights="/ckpt/v0", label="0")
    async with serving(standin) as url, EngineClient(url) as engine:
        generating = asyncio.create_task(load(url, requests=2, tokens=40))
        while len(standin.unfinished) < 2 or standin.produced < 2 * 10:
            await asyncio.sleep(0.005)
        await engine.pause_generation("in_place")
        answer = await engine.update_weights_from_disk("/ckpt/v1", 1, flush_cache=True)
        await engine.continue_generation()
        outputs = await generating
    assert answer == {"success": False, "message": FLUSH_REFUSED, "num_paused_requests": 0}
    assert standin.label == "0"
    assert any(weights == "/ckpt/v1" and label == "0" for tokens in outputs for weights, label in tokens)


async def test_an_engine_started_from_the_latest_version_is_labelled_not_reloaded(
    two_versions: TwoVersions,
) -> None:
    model_dir, store, pool, output = two_versions
    # The init container linked version 1; the engine started from it and reports SGLang's default.
    assert await weight_sync.prepare(store, pool, output, 0.02, 30) == 1
    standin = StandInSGLang(weights=str(output / "current"))
    async with (
        serving(standin) as url,
        EngineClient(url) as engine,
        following(two_versions, engine, 0.02),
    ):
        while standin.label != "1":
            await asyncio.sleep(0.01)
        assert standin.loads == [], "the same weights are not loaded again"
        # A later version is loaded as usual.
        await asyncio.to_thread(publish, store, model_dir, 2, 0.5)
        while standin.label != "2":
            await asyncio.sleep(0.01)
    assert [body["model_path"] for body in standin.loads] == [store.path(2)]


async def test_an_engine_that_comes_up_is_labelled_within_a_second_not_a_poll_interval(
    two_versions: TwoVersions,
) -> None:
    # Until it is labelled, an engine reports `default` for the tokens it serves: the sidecar
    # watches an engine that is not up, or not labelled, every UNSETTLED_POLL_S, not every --poll.
    _, store, pool, output = two_versions
    await weight_sync.prepare(store, pool, output, 0.02, 30)
    standin = StandInSGLang(weights=str(output / "current"), healthy=False)
    async with serving(standin) as url:
        async with EngineClient(url) as engine, following(two_versions, engine, 60.0):
            await asyncio.sleep(0.3)
            assert standin.label == "default"
            standin.healthy = True  # the model is loaded
            loop = asyncio.get_running_loop()
            start = loop.time()
            gate = output / LABELLED_FILE  # the pod's readiness gate: absent while unlabelled
            assert not gate.exists()
            while standin.label != "1":
                assert loop.time() - start < 5 * weight_sync.UNSETTLED_POLL_S, "not labelled promptly"
                await asyncio.sleep(0.01)
            while not gate.exists():
                assert loop.time() - start < 10 * weight_sync.UNSETTLED_POLL_S, "gate not opened"
                await asyncio.sleep(0.01)
            assert gate.read_text() == "1"
        assert standin.loads == []
        # The engine restarts: unlabelled again, so the gate closes until it is labelled once more.
        standin.label, standin.healthy = "default", False
        async with EngineClient(url) as engine, following(two_versions, engine, 60.0):
            while gate.exists():
                assert loop.time() - start < 20, "the gate stayed open for a restarted engine"
                await asyncio.sleep(0.01)


async def test_an_unlabelled_engine_behind_the_link_is_reloaded(two_versions: TwoVersions) -> None:
    # `current` names version 0 while version 1 is the latest: the engine's weights are unknown to
    # be version 1, so they are loaded.
    _, store, pool, output = two_versions
    weight_sync.point_current(output, store.path(0))
    standin = StandInSGLang(weights=str(output / "current"))
    async with serving(standin) as url, EngineClient(url) as engine:
        await weight_sync.sync_engine(store, pool, output, engine, 1, served=0)
    assert [body["model_path"] for body in standin.loads] == [store.path(1)] and standin.label == "1"


async def test_a_replica_across_nodes_started_from_the_latest_version_is_reloaded(
    two_versions: TwoVersions,
) -> None:
    # Each node of a LeaderWorkerSet group linked `current` in its own init container: the leader's
    # link naming the latest version says nothing of its workers', so the leader loads it for all.
    _, store, pool, output = two_versions
    across = pool.model_copy(update={"nodes_per_replica": 2})
    assert await weight_sync.prepare(store, across, output, 0.02, 30) == 1
    standin = StandInSGLang(weights=str(output / "current"))
    async with serving(standin) as url, EngineClient(url) as engine:
        await weight_sync.sync_engine(store, across, output, engine, 1, served=0)
    assert [body["model_path"] for body in standin.loads] == [store.path(1)] and standin.label == "1"


def test_command_line_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = resolved_run(tmp_path / "store")
    config = tmp_path / "run.json"
    config.write_text(run.model_dump_json())
    assert (
        weight_sync.main(["--config", str(config), "--pool", "nope", "--output", str(tmp_path), "--once"])
        == 1
    )
    assert capsys.readouterr().err.strip() == (
        "mixrl engine-sync: --pool: no pool named 'nope' in run 'demo' (pools: emul, b200)"
    )
    assert (
        weight_sync.main(["--config", str(tmp_path / "missing.json"), "--pool", "emul", "--output", "x"]) == 1
    )
    assert capsys.readouterr().err.strip() == (
        f"mixrl engine-sync: --config {tmp_path / 'missing.json'}: cannot read it (No such file or directory)"
    )
    assert weight_sync.main(["--config", str(config), "--pool", "emul", "--output", "x", "--poll", "0"]) == 2
    assert capsys.readouterr().err.strip() == "mixrl engine-sync: --poll: must be positive"


def test_following_needs_a_token_and_once_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MIXRL_AUTH_TOKEN", raising=False)
    run = resolved_run(tmp_path / "store")
    config = tmp_path / "run.json"
    config.write_text(run.model_dump_json())
    follow = ["--config", str(config), "--pool", "emul", "--output", str(tmp_path / "out")]
    assert weight_sync.main(follow) == 1
    assert capsys.readouterr().err.strip() == (
        "mixrl engine-sync: no auth token: give --auth-token-file PATH or set MIXRL_AUTH_TOKEN "
        "(--insecure-no-auth runs without one, open to anyone who reaches the port)"
    )
    # The init container never calls the engine: it gets as far as waiting for a version.
    assert weight_sync.main([*follow, "--once", "--poll", "0.01", "--timeout", "0.05"]) == 1
    assert capsys.readouterr().err.strip().endswith("within 0 s")
