"""The weight-sync sidecar when ``current`` names a version that is gone (a trainer resumed from an
older checkpoint and removed it, or prune did): it is re-linked to the newest version that loads
even while the engine is down.  Before, the sidecar moved ``current`` only after a healthy engine
took an update, so an engine container restarted from the dangling link never came up (a crash
loop) and the sidecar waited for it forever."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mixrl.rl.engine import weight_sync
from mixrl.rl.engine.client import EngineClient
from mixrl.rl.tiny_models import create_tiny_checkpoint
from mixrl.rl.weights import WeightStore

from ..operator.sglang_standin import StandInSGLang
from ..operator.test_weight_sync import TwoVersions, following, publish, resolved_run, serving


async def _until(condition, what: str, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not condition():
        assert loop.time() - start < timeout_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize(("pool_name", "subdir"), [("emul", ""), ("b200", "nvfp4")])
async def test_a_current_naming_a_removed_version_is_relinked_while_the_engine_is_down(
    tmp_path: Path, pool_name: str, subdir: str
) -> None:
    model_dir = create_tiny_checkpoint(tmp_path / "tiny", "qwen3", vocab_size=128, seed=5)
    run = resolved_run(tmp_path / "store")
    store, pool, output = WeightStore(run.weights.store), run.pool(pool_name), tmp_path / "engine-weights"
    for version, scale in ((0, 1.0), (1, 1.5), (2, 0.5)):
        await asyncio.to_thread(publish, store, model_dir, version, scale)
    assert await weight_sync.prepare(store, pool, output, 0.02, 30) == 2
    await asyncio.to_thread(store.remove, 2)  # the trainer resumed from its checkpoint of step 1
    current = output / "current"
    assert weight_sync.current_is_gone(output)
    expected = (Path(store.path(1)) / subdir).resolve()
    # The engine container restarted from the dangling link: it cannot load, it never comes up.
    standin = StandInSGLang(weights="nothing loaded", healthy=False)
    async with (
        serving(standin) as url,
        EngineClient(url) as engine,
        following(TwoVersions(model_dir, store, pool, output), engine, 0.02),
    ):
        await _until(lambda: current.resolve() == expected, "current to name version 1")
        assert standin.loads == []
        # Up at last, unlabelled: whether it started before or after the new link cannot be told,
        # so it is loaded with version 1, not only labelled.
        standin.healthy = True
        await _until(lambda: standin.label == "1", "the engine to be synced")
    assert [Path(body["model_path"]).resolve() for body in standin.loads] == [expected]
    assert not weight_sync.current_is_gone(output)
