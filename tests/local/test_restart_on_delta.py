"""A restarted `mixrl run` whose latest weight version is a delta starts its engines from whole weights."""

from __future__ import annotations

from pathlib import Path

import torch

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.local.prepare import prepare_model
from mixrl.rl.tiny_models import load_model
from mixrl.rl.weights import WeightStore

from .conftest import ROOT


def quickstart(store: Path) -> ResolvedRun:
    run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    return run.model_copy(update={"weights": run.weights.model_copy(update={"store": str(store)})})


def test_engines_start_from_a_delta_version_written_out_in_full(tmp_path: Path, model_cache: Path) -> None:
    run = quickstart(tmp_path / "store")
    first = prepare_model(run, model_cache, tmp_path / "run")  # publishes version 0
    store = WeightStore(run.weights.store, snapshot_every=10)
    state = store.load(0)
    moved = {
        name: (t.float() * 1.001).to(t.dtype) if t.is_floating_point() else t for name, t in state.items()
    }
    store.publish(1, moved, {"step": 1}, load_model(first.initial_version_path).config.to_dict())
    assert store.manifest(1)["kind"] == "delta"

    again = prepare_model(run, model_cache, tmp_path / "run")
    assert again.initial_version == 1
    served = load_model(again.initial_version_path)  # what the engine's from_pretrained does
    for name, tensor in served.state_dict().items():
        assert torch.equal(tensor, moved[name].float()), name
