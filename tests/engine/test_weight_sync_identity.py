"""The weight-sync sidecar tells versions apart by number and manifest, not by number alone.

A trainer that resumes from an older checkpoint removes the versions after it and publishes the
same numbers again with other weights; version 0 is also what an unlabelled engine reports.  These
drive ``weight_sync.follow`` against a real store on disk (tiny tensors) and a fake engine that
records which weights it holds: the timeline in the manifest of the checkpoint it last loaded."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mixrl.api.launch import LABELLED_FILE
from mixrl.api.resolve import ResolvedPool
from mixrl.rl import weights
from mixrl.rl.engine import weight_sync
from mixrl.rl.weights import DELTA_FILE, WeightStore, WeightStoreError, forget_rebuilt, load_checkpoint_dir

from ..operator.test_weight_sync import resolved_run

POLL_S = 0.02


class FakeEngine:
    """What the sidecar sees of an engine: its label (0 while unlabelled, as SGLang's ``default``
    reads) and the weights it holds, as (timeline, version) of the checkpoint it last loaded."""

    def __init__(self, label: int, started_from: Path | None = None, up: bool = True) -> None:
        self.label, self.up = label, up
        self.holds = None if started_from is None else _timeline_of(started_from)
        self.loads: list[tuple[int, str]] = []
        self.when_labelled: Callable[[], None] | None = None
        """Run once, on the next label: what happens in the store meanwhile."""

    async def health(self) -> bool:
        return self.up

    async def get_weight_version(self) -> int:
        return self.label

    async def update_weight_version(self, version: int, abort_all_requests: bool = False) -> None:
        self.label = version
        if self.when_labelled is not None:
            meanwhile, self.when_labelled = self.when_labelled, None
            await asyncio.to_thread(meanwhile)

    async def pause_generation(self, mode: str) -> None:
        pass

    async def continue_generation(self) -> None:
        pass

    async def update_weights_from_disk(
        self, target: str, version: int, abort_all_requests: bool = False, flush_cache: bool = False
    ) -> dict:
        try:  # refused as the real engines refuse a checkpoint that does not verify
            load_checkpoint_dir(target)
        except WeightStoreError as exc:
            return {"success": False, "message": str(exc)}
        self.holds = _timeline_of(Path(target))
        self.label = version
        self.loads.append((version, self.holds[0]))
        return {"success": True}


def _timeline_of(checkpoint: Path) -> tuple[str, int]:
    manifest = load_checkpoint_dir(str(checkpoint), verify=False)[1]
    return manifest["metadata"]["timeline"], manifest["version"]


def _publish(store: WeightStore, version: int, timeline: str) -> None:
    """FP32 weights (an SGLang BF16 pool converts them), different for each (version, timeline)."""
    seed = version * 100 + ord(timeline[0])
    tensors = {"l.weight": torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))}
    store.publish(version, tensors, {"timeline": timeline})


def _pool(tmp_path: Path, engine: str) -> ResolvedPool:
    run = resolved_run(tmp_path / "store")
    if engine == "torch":
        return run.pool("emul")
    return run.pool("b200").model_copy(update={"weight_precision": "bf16"})


def _a_snapshot_and_a_delta(tmp_path: Path) -> tuple[WeightStore, WeightStore, ResolvedPool, Path]:
    """Version 1 a snapshot, version 2 its delta (timeline A), for a torch pool: the trainer's store
    (it publishes deltas) and the sidecar's, on the same directory."""
    forget_rebuilt()
    trainer = WeightStore(str(tmp_path / "store"), snapshot_every=10)
    _publish(trainer, 1, "A")
    _publish(trainer, 2, "A")
    store = WeightStore(str(tmp_path / "store"))
    return trainer, store, _pool(tmp_path, "torch"), tmp_path / "engine-weights"


async def _started(
    tmp_path: Path, versions: int, label: int
) -> tuple[WeightStore, ResolvedPool, Path, FakeEngine]:
    """A store holding versions 0 … ``versions - 1`` (timeline A) and an SGLang pool's engine
    started from the checkpoint its init container linked, reporting ``label``."""
    pool, output = _pool(tmp_path, "sglang"), tmp_path / "engine-weights"
    store = WeightStore(str(tmp_path / "store"))
    for version in range(versions):
        _publish(store, version, "A")
    assert await weight_sync.prepare(store, pool, output, POLL_S, 10) == versions - 1
    return store, pool, output, FakeEngine(label=label, started_from=output / "current")


async def _follow_until(
    store: WeightStore,
    pool: ResolvedPool,
    output: Path,
    engine: FakeEngine,
    done: Callable[[], bool],
    what: str,
    timeout_s: float = 10.0,
) -> None:
    """Run the sidecar until ``done()`` (failing after ``timeout_s``), then stop it."""
    stop = asyncio.Event()
    follower = asyncio.create_task(weight_sync.follow(store, pool, output, engine, POLL_S, stop))  # type: ignore[arg-type]
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not done():
            assert not follower.done(), f"the sidecar stopped: {follower.exception()!r}"
            assert loop.time() - start < timeout_s, f"timed out waiting for {what}"
            await asyncio.sleep(POLL_S)
    finally:
        stop.set()
        await asyncio.wait_for(follower, 10)


async def test_an_engine_follows_a_version_republished_under_the_same_number(tmp_path: Path) -> None:
    store, pool, output, engine = await _started(tmp_path, versions=4, label=0)
    await _follow_until(store, pool, output, engine, lambda: engine.label == 3, "the engine to be labelled")
    assert engine.loads == [], "started from version 3: labelled, not reloaded"
    # The trainer resumes from its checkpoint of step 2 and redoes step 3 with other weights.
    store.remove(3)
    _publish(store, 3, "B")
    await _follow_until(store, pool, output, engine, lambda: engine.holds == ("B", 3), "the new version 3")
    assert engine.loads == [(3, "B")] and engine.label == 3
    assert (output / LABELLED_FILE).read_text() == "3"
    assert store.snapshot_requested() is None


async def test_a_sidecar_busy_converting_when_the_trainer_resumes_ends_on_the_new_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine serves version 3; while its sidecar converts version 4, the trainer restarts from
    # its checkpoint of step 2: versions 3 and 4 go, and the redone step 3 is published.
    store, pool, output, engine = await _started(tmp_path, versions=4, label=3)
    _publish(store, 4, "A")
    real = WeightStore._calibrate

    def calibrate(version: int, precision: str, tensors: dict, config: dict | None) -> tuple[dict, str]:
        if version == 4:
            monkeypatch.setattr(WeightStore, "_calibrate", staticmethod(real))
            store.remove(4)
            store.remove(3)
            _publish(store, 3, "B")
        return real(version, precision, tensors, config)

    monkeypatch.setattr(WeightStore, "_calibrate", staticmethod(calibrate))
    await _follow_until(store, pool, output, engine, lambda: engine.holds == ("B", 3), "the new version 3")
    assert engine.loads == [(3, "B")] and engine.label == 3
    assert (output / "current").resolve() == (Path(store.path(3)) / "bf16").resolve()
    # Version 4 was removed, not broken: the trainer's next publish stays a delta.
    assert store.snapshot_requested() is None


async def test_a_restarted_sidecar_reloads_a_version_republished_while_it_was_down(tmp_path: Path) -> None:
    store, pool, output, engine = await _started(tmp_path, versions=3, label=0)
    await _follow_until(store, pool, output, engine, lambda: engine.label == 2, "the engine to be labelled")
    # A sidecar restarted with nothing changed trusts what it recorded: no reload.
    rounds = 0

    def a_few_polls() -> bool:
        nonlocal rounds
        rounds += 1
        return rounds > 10

    await _follow_until(store, pool, output, engine, a_few_polls, "a few polls")
    assert engine.loads == []
    # The sidecar is down while the trainer resumes and republishes version 2.
    store.remove(2)
    _publish(store, 2, "B")
    await _follow_until(store, pool, output, engine, lambda: engine.holds == ("B", 2), "the new version 2")
    assert engine.loads == [(2, "B")]


@pytest.mark.parametrize("recorded", [True, False], ids=["init-container", "no-record"])
async def test_version_0_republished_while_an_unlabelled_engine_starts_is_loaded_not_labelled(
    tmp_path: Path, recorded: bool
) -> None:
    # A new replica starts from version 3, unlabelled (it reports 0); the trainer, without a
    # checkpoint yet, restarts from step 0: every version goes and version 0 is published again.
    pool, output = _pool(tmp_path, "sglang"), tmp_path / "engine-weights"
    store = WeightStore(str(tmp_path / "store"))
    for version in range(4):
        _publish(store, version, "A")
    if recorded:
        await weight_sync.prepare(store, pool, output, POLL_S, 10)
    else:  # as an init container of an older mixrl left it: no record of what the engine holds
        weight_sync.point_current(output, weight_sync.checkpoint_for(store, pool, 3))
    engine = FakeEngine(label=0, started_from=output / "current", up=False)
    for version in store.versions():
        store.remove(version)
    _publish(store, 0, "B")
    relinked = output / "current"
    await _follow_until(
        store,
        pool,
        output,
        engine,
        lambda: relinked.resolve() == (Path(store.path(0)) / "bf16").resolve(),
        "current to be re-linked",
    )
    engine.up = True  # the engine finished starting, from version 3's weights
    await _follow_until(
        store, pool, output, engine, lambda: (output / LABELLED_FILE).exists(), "the readiness gate"
    )
    assert engine.loads == [(0, "B")] and engine.holds == ("B", 0)
    assert (output / LABELLED_FILE).read_text() == "0"


async def test_a_good_version_republished_under_a_broken_ones_number_is_loaded(tmp_path: Path) -> None:
    trainer, store, pool, output = _a_snapshot_and_a_delta(tmp_path)
    delta = Path(store.path(2)) / DELTA_FILE
    data = bytearray(delta.read_bytes())
    data[-3] ^= 0xFF  # version 2 arrives damaged
    delta.write_bytes(bytes(data))
    assert await weight_sync.prepare(store, pool, output, POLL_S, 10) == 1
    engine = FakeEngine(label=0, started_from=output / "current")

    def resume() -> None:
        # While the sidecar falls back, the trainer resumes from its checkpoint of step 1 and redoes
        # step 2: a good version 2 (a snapshot, as requested), not to be taken for the broken one.
        assert store.snapshot_requested() is not None
        store.remove(2)
        _publish(trainer, 2, "B")
        assert store.manifest(2)["kind"] == "snapshot"

    engine.when_labelled = resume
    await _follow_until(store, pool, output, engine, lambda: engine.holds == ("B", 2), "the good version 2")
    assert engine.loads == [(2, "B")] and engine.label == 2


def test_a_version_removed_during_its_sync_is_not_reported_broken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = WeightStore(str(tmp_path / "store"))
    _publish(store, 1, "A")
    _publish(store, 2, "A")
    store.remove(2)  # a resumed trainer (or prune) removed it while the sidecar synced it
    caplog.set_level(logging.INFO, logger="mixrl.engine_sync")
    assert weight_sync.fall_back(store, 2) == 1
    assert store.snapshot_requested() is None, "the trainer's next publish would be a full snapshot"
    assert not any("cannot be rebuilt" in message for message in caplog.messages)
    with pytest.raises(weight_sync.SyncError, match=r"^version 1 was removed and no older version loads$"):
        store.remove(1)
        weight_sync.fall_back(store, 1)


async def test_choosing_the_starting_checkpoint_hashes_no_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The init container falls back from a broken latest version: the snapshot it picks is checked
    # by its files' sizes only; the engine's load hashes it.
    _, store, pool, output = _a_snapshot_and_a_delta(tmp_path)
    (Path(store.path(2)) / DELTA_FILE).write_bytes(b"\0" * (Path(store.path(2)) / DELTA_FILE).stat().st_size)
    hashed: list[str] = []
    real = weights._sha256

    def sha256(path: Path) -> str:
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(weights, "_sha256", sha256)
    assert await weight_sync.prepare(store, pool, output, POLL_S, 10) == 1
    assert [name for name in hashed if name.endswith(".safetensors")] == []
    assert DELTA_FILE in hashed, "a delta is small: it is hashed"
