"""The weight-sync sidecar on a store of deltas, with a real torch engine process: it follows delta
versions, refuses a damaged one with one line, falls back to the newest version that loads, asks
for a snapshot, and moves on when the next publish writes one."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

from mixrl.local.processes import EngineProcess
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine import weight_sync
from mixrl.rl.engine.client import EngineClient
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model
from mixrl.rl.weights import DELTA_FILE, WeightStore, forget_rebuilt

from ..operator.test_weight_sync import resolved_run

TOKEN = AuthToken("delta-sync-test-token-" + "d" * 24)


def _publish(store: WeightStore, model_dir: str, version: int, nudge: float) -> None:
    """The base weights with one layer nudged: a delta of a few tensors, as RL steps make."""
    model = load_model(model_dir)
    state = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"] + nudge
    store.publish(version, state, {"step": version}, model.config.to_dict())


async def _until(condition, what: str, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not await condition():
        assert loop.time() - start < timeout_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_a_damaged_delta_falls_back_and_the_requested_snapshot_moves_the_engine_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    forget_rebuilt()
    model_dir = create_tiny_checkpoint(tmp_path / "tiny", "qwen3", vocab_size=128, seed=5)
    run = resolved_run(tmp_path / "store")
    pool, output = run.pool("emul"), tmp_path / "engine-weights"
    trainer_store = WeightStore(run.weights.store, snapshot_every=10)  # the trainer's publisher
    store = WeightStore(run.weights.store)  # the sidecar's view of the same store
    await asyncio.to_thread(_publish, trainer_store, model_dir, 0, 0.0)
    await asyncio.to_thread(_publish, trainer_store, model_dir, 1, 0.5)
    assert store.manifest(1)["kind"] == "delta"
    # The init container: version 1 is a delta, so the torch engine starts from its snapshot.
    assert await weight_sync.prepare(store, pool, output, 0.02, 30) == 1
    assert (output / "current").resolve() == Path(store.path(0)).resolve()
    engine = EngineProcess(output / "current", weight_precision="fp8", pool="emul", auth_token=TOKEN)
    await asyncio.to_thread(engine.start)
    stop = asyncio.Event()
    try:
        async with EngineClient(engine.url, auth_token=TOKEN) as client:

            async def serves(version: int) -> bool:
                return await client.get_weight_version() == version

            follower = asyncio.create_task(weight_sync.follow(store, pool, output, client, 0.05, stop))
            await _until(lambda: serves(1), "the engine to load delta version 1")
            stop.set()
            await asyncio.wait_for(follower, 10)

            # Version 2 arrives damaged: one byte of its delta flipped.
            await asyncio.to_thread(_publish, trainer_store, model_dir, 2, 1.0)
            delta = Path(store.path(2)) / DELTA_FILE
            data = bytearray(delta.read_bytes())
            data[-3] ^= 0xFF
            delta.write_bytes(bytes(data))
            stop = asyncio.Event()
            caplog.set_level(logging.WARNING, logger="mixrl.engine_sync")
            follower = asyncio.create_task(weight_sync.follow(store, pool, output, client, 0.05, stop))

            async def requested() -> bool:
                return store.snapshot_requested() is not None

            await _until(requested, "a snapshot request")
            refusal = (
                f"weight version 2 cannot be rebuilt: {delta}: corrupt: sha256 does not match manifest.json"
            )
            assert refusal in caplog.messages
            assert "falling back to version 1 until the requested snapshot is published" in caplog.messages
            await asyncio.sleep(0.5)  # several polls: version 2 is not tried again, 1 stays served
            assert await serves(1)
            assert sum("cannot be rebuilt" in m for m in caplog.messages) == 1

            # The trainer's next publish honours the request: a snapshot, which the engine loads.
            await asyncio.to_thread(_publish, trainer_store, model_dir, 3, 1.5)
            assert store.manifest(3)["kind"] == "snapshot" and store.snapshot_requested() is None
            await _until(lambda: serves(3), "the engine to load snapshot version 3")
            await _until(
                lambda: asyncio.sleep(0, (output / "current").resolve() == Path(store.path(3)).resolve()),
                "current to name version 3",
            )
            stop.set()
            await asyncio.wait_for(follower, 10)
    finally:
        stop.set()
        await asyncio.to_thread(engine.close)
