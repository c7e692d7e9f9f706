"""What a resume leaves in the weight store while it removes the versions newer than its checkpoint.

Versions are deltas on the one before (``weights.snapshotEvery``), and engines load the newest.
Removing the redone versions oldest first left, for a moment per version, a newest version whose
base was gone: an engine's weight-sync that read it then found a broken chain (and asked for a
snapshot).  Newest first, the newest version always loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixrl.rl.weights import WeightStore

from .test_loop import offline_loop, small_run


def test_a_resume_removes_the_redone_versions_newest_first(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = small_run(tmp_path, total_steps=5)
    assert run.weights.snapshot_every > 4  # versions 1..4 are deltas on the one before
    loop = offline_loop(run, tmp_path, tiny_model_dir)
    state = loop.trainer.state_dict_for_publication()
    for version in range(5):  # a crash after publishing version 4, and no checkpoint
        state = {name: t + 1 if name.endswith("norm.weight") else t for name, t in state.items()}
        loop.store.publish(version, state, {"step": version}, loop.model_config)
    store = WeightStore(run.weights.store)
    remove = WeightStore.remove
    newest_loads: list[bool] = []

    def checked(self: WeightStore, version: int) -> None:
        newest_loads.append(store.chain_problem(store.versions()[-1]) is None)
        remove(self, version)

    monkeypatch.setattr(WeightStore, "remove", checked)
    loop.resume()
    assert store.versions() == [0] and newest_loads == [True] * 4
