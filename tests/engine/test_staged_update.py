"""A weight update is prepared while the engine decodes and swapped between two decode steps."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mixrl.rl.engine import weights_io
from mixrl.rl.engine.client import EngineClient
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model
from mixrl.rl.weights import WeightStore

from .conftest import VOCAB, reference_model, serve_in_process

SLOW_PREPARE_S = 0.6


def test_staged_weights_swap_exchanges_tensors_and_keeps_ties(dense_path: str, tmp_path: Path) -> None:
    live = load_model(dense_path)
    other = create_tiny_checkpoint(tmp_path / "v1", "qwen3", vocab_size=VOCAB, seed=7)
    state = load_file(Path(other) / "model.safetensors")
    staged = weights_io.StagedWeights(live, "fp8", torch.float32)
    before = {name: p.data_ptr() for name, p in live.named_parameters()}
    staged.prepare(live, state)
    assert {name: p.data_ptr() for name, p in live.named_parameters()} == before  # live untouched
    staged.swap_into(live)
    expected = reference_model(other, "fp8")
    for (name, got), (_, want) in zip(live.named_parameters(), expected.named_parameters(), strict=True):
        assert torch.equal(got, want), name
        assert got.data_ptr() != before[name]
    with pytest.raises(RuntimeError, match="nothing prepared"):
        staged.swap_into(live)  # one swap per prepared version


def test_a_bad_state_is_refused_by_prepare_and_the_live_model_is_kept(dense_path: str) -> None:
    live = load_model(dense_path)
    state = {k: v.clone() for k, v in live.state_dict().items()}
    key = next(k for k in state if k.endswith("q_proj.weight"))
    state[key][0, 0] = float("nan")
    staged = weights_io.StagedWeights(live, "bf16", torch.float32)
    with pytest.raises(ValueError, match="NaN"):
        staged.prepare(live, state)
    with pytest.raises(RuntimeError, match="nothing prepared"):
        staged.swap_into(live)


async def test_decoding_continues_while_the_next_version_is_prepared(
    dense_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = create_tiny_checkpoint(tmp_path / "other", "qwen3", vocab_size=VOCAB, seed=7)
    store = WeightStore(str(tmp_path / "store"))
    config = json.loads((Path(other) / "config.json").read_text())
    store.publish(1, load_file(Path(other) / "model.safetensors"), {"step": 1}, config)
    real_prepare = weights_io.StagedWeights.prepare
    window: dict[str, float] = {}

    def slow_prepare(self: weights_io.StagedWeights, live: torch.nn.Module, state: dict) -> dict:
        window["start"] = time.perf_counter()
        time.sleep(SLOW_PREPARE_S)  # a long preparation, as a large model's
        report = real_prepare(self, live, state)
        window["end"] = time.perf_counter()
        return report

    monkeypatch.setattr(weights_io.StagedWeights, "prepare", slow_prepare)
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
