"""A weight update is prepared while the engine decodes and swapped between two decode steps."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mixrl.local.processes import EngineProcess
from mixrl.rl.engine.client import EngineClient
from mixrl.rl.engine.staging import PreparationRefused, Prepared, StagedWeights
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model
from mixrl.rl.weights import WeightStore

from .conftest import VOCAB, publish, reference_model, serve_in_process

SLOW_PREPARE_S = 0.6


@pytest.mark.parametrize("preparer", ["process", "auto"])
def test_the_preparer_fills_the_staging_copy_and_the_swap_exchanges_the_tensors(
    dense_path: str, tmp_path: Path, preparer: str
) -> None:
    live = load_model(dense_path)
    other = create_tiny_checkpoint(tmp_path / "v1", "qwen3", vocab_size=VOCAB, seed=7)
    staged = StagedWeights(live.config, "fp8", torch.float32, preparer)
    try:
        before = {name: p.data_ptr() for name, p in live.named_parameters()}
        served = {name: p.clone() for name, p in live.named_parameters()}
        prepared = staged.prepare_dir(live, other)  # a directory without a manifest
    except PreparationRefused as exc:
        assert "manifest.json is missing" in str(exc)
    else:
        raise AssertionError("a directory without a manifest was prepared")
    try:
        prepared = staged.prepare_state(live, load_file(Path(other) / "model.safetensors"))
        assert prepared.manifest_version is None
        # a model of a few MiB is prepared on the calling thread unless a process is asked for
        assert staged.preparer == ("thread" if preparer == "auto" else "process")
        assert (staged._process is not None) == (preparer == "process")
        # the preparer worked on other memory: the served weights are untouched
        assert {name: p.data_ptr() for name, p in live.named_parameters()} == before
        assert all(torch.equal(p, served[name]) for name, p in live.named_parameters())
        staged.swap_into(live)
        expected = reference_model(other, "fp8")
        for (name, got), (_, want) in zip(live.named_parameters(), expected.named_parameters(), strict=True):
            assert torch.equal(got, want), name
            assert got.is_shared() == (preparer == "process")
        with pytest.raises(RuntimeError, match="nothing prepared"):
            staged.swap_into(live)  # one swap per prepared version
    finally:
        staged.close()


def test_a_bad_state_is_refused_by_the_preparer_and_a_dead_preparer_is_replaced(dense_path: str) -> None:
    live = load_model(dense_path)
    state = {k: v.clone() for k, v in live.state_dict().items()}
    key = next(k for k in state if k.endswith("q_proj.weight"))
    state[key][0, 0] = float("nan")
    staged = StagedWeights(live.config, "bf16", torch.float32, "process")
    try:
        with pytest.raises(PreparationRefused, match="NaN"):
            staged.prepare_state(live, state)
        with pytest.raises(RuntimeError, match="nothing prepared"):
            staged.swap_into(live)
        staged._process.kill()  # the preparer dies between two updates
        staged._process.join()
        state[key][0, 0] = 0.0
        staged.prepare_state(live, state)  # a new one takes over
        staged.swap_into(live)
        assert live.get_parameter(key)[0, 0].item() == 0.0
    finally:
        staged.close()


async def test_decoding_continues_while_the_next_version_is_prepared(
    dense_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_version: tuple[str, WeightStore]
) -> None:
    _, store = other_version
    real_prepare = StagedWeights.prepare_dir
    window: dict[str, float] = {}

    def slow_prepare(self: StagedWeights, live: torch.nn.Module, directory: str) -> Prepared:
        window["start"] = time.perf_counter()
        time.sleep(SLOW_PREPARE_S)  # a long preparation, as a large model's
        prepared = real_prepare(self, live, directory)
        window["end"] = time.perf_counter()
        return prepared

    monkeypatch.setattr(StagedWeights, "prepare_dir", slow_prepare)
    async with serve_in_process(model_path=dense_path, weight_root=str(tmp_path)) as (url, service):
        arrivals: list[tuple[float, int]] = []

        def on_token(now: float) -> None:
            arrivals.append((now, service.weight_version))

        service.stats.add_listener(on_token)
        async with EngineClient(url) as client:
            updated = asyncio.Event()

            async def keep_decoding() -> list[int]:
                versions: list[int] = []
                while not updated.is_set():
                    result = await client.generate([11, 12, 13], max_new_tokens=40, temperature=1.0)
                    versions += [record.weight_version for record in result.records]
                return versions

            decoding = asyncio.create_task(keep_decoding())
            while len(arrivals) < 5:
                await asyncio.sleep(0.01)
            answer = await client.update_weights_from_disk(store.path(1), 1, flush_cache=False)
            updated.set()
            versions = await decoding
    assert answer["success"], answer
    during = [v for now, v in arrivals if window["start"] < now < window["end"]]
    assert len(during) >= 3, "decoding stopped while the version was prepared"
    assert set(during) == {0}  # the old weights serve until the swap
    assert versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)  # one switch, between two tokens
    assert 0 < service.last_swap_s < 0.1


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


async def test_the_preparer_ends_with_an_engine_killed_outright(dense_path: str, tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "store"))
    publish(store, 1, dense_path)
    extra = ["--weight-root", str(tmp_path), "--weight-preparer", "process"]
    with EngineProcess(dense_path, extra_args=extra) as engine:
        async with EngineClient(engine.url) as client:
            assert (await client.update_weights_from_disk(store.path(1), 1))["success"]
        engine_pid = engine.server.process.pid
        # Beside the preparer, the engine has multiprocessing's resource tracker, which ends when
        # its pipe closes.
        [preparer] = [
            pid for pid in _children(engine_pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        os.kill(engine_pid, signal.SIGKILL)  # no exit handler runs
        deadline = time.monotonic() + 10
        while Path(f"/proc/{preparer}").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert (
            not Path(f"/proc/{preparer}").exists()
            or "Z" in Path(f"/proc/{preparer}/stat").read_text().split()[2]
        )
