"""The engine weight-sync sidecar: a real weight store on disk and a real torch engine process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.utils import logging as hf_logging

from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.local.processes import EngineProcess
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine import weight_sync
from mixrl.rl.engine.client import EngineClient
from mixrl.rl.models import create_tiny_checkpoint, load_model
from mixrl.rl.weights import WeightStore

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
    manifest["spec"]["weights"] = {"store": f"file://{store}"}
    run = parse_document(manifest)
    assert isinstance(run, RLRun)
    return resolve(run)


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
        # Without the token the engine refuses to pause: one line, not an endless retry.
        await asyncio.to_thread(publish, store, model_dir, 2, 0.5)
        async with EngineClient(engine.url) as anonymous:
            with pytest.raises(weight_sync.SyncError) as refused:
                await asyncio.wait_for(
                    weight_sync.follow(store, pool, output, anonymous, 0.05, asyncio.Event()), 60
                )
            assert await anonymous.get_weight_version() == 0
        assert str(refused.value).startswith(
            "the engine refused the token: POST /pause_generation: HTTP 401: unauthorized"
        )
        assert TOKEN.reveal() not in engine.log_tail(200)
    finally:
        await asyncio.to_thread(engine.close)


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
