"""A conversion that outlives its version: removed (a resumed trainer, prune) or removed and published
again while it ran.  It must never recreate the version's directory (which then blocked publishing
that version again, forever) nor be served as the new version's conversion."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mixrl.rl import checkpoint_formats
from mixrl.rl.weights import MANIFEST, WeightStore, WeightStoreError, load_checkpoint_dir

KEY = "layers.0.mlp.up_proj.weight"


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    return {KEY: torch.randn(64, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)}


def _manifest_sha256(directory: str | Path) -> str:
    return hashlib.sha256((Path(directory) / MANIFEST).read_bytes()).hexdigest()


def _during_conversion(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> None:
    """Run ``action`` once while the next conversion runs (after it loaded its version)."""
    real = checkpoint_formats.convert_state_dict

    def converting(*args, **kwargs):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(checkpoint_formats, "convert_state_dict", real)
        action()
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_formats, "convert_state_dict", converting)


def test_a_conversion_whose_version_is_removed_meanwhile_is_refused_and_leaves_nothing(
    store: WeightStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.publish(1, _tensors(1))
    store.publish(2, _tensors(2))
    _during_conversion(monkeypatch, lambda: store.remove(2))  # a resume to the checkpoint of step 1
    with pytest.raises(WeightStoreError) as exc:
        store.convert(2, "fp8")
    assert str(exc.value) == (
        f"{store.path(2)}/fp8: stale: v00000002 was removed while this was written; discarded"
    )
    assert not Path(store.path(2)).exists(), "the removed version's directory was recreated"
    assert store.versions() == [1]
    store.publish(2, _tensors(20))  # the redone step publishes its version again
    assert store.versions() == [1, 2]


def test_a_conversion_whose_version_is_republished_meanwhile_is_refused(
    store: WeightStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.publish(1, _tensors(1))

    def resume_and_redo() -> None:
        store.remove(1)
        store.publish(1, _tensors(10))  # the redone step's weights

    _during_conversion(monkeypatch, resume_and_redo)
    with pytest.raises(WeightStoreError, match=r"/fp8: stale: v00000001 was republished while"):
        store.convert(1, "fp8")
    assert not (Path(store.path(1)) / "fp8").exists(), "the old weights were served as version 1"
    converted, manifest = load_checkpoint_dir(store.convert(1, "fp8"))
    assert manifest["source_manifest_sha256"] == _manifest_sha256(store.path(1))
    expected = checkpoint_formats.convert_state_dict(_tensors(10), "fp8").tensors
    assert torch.equal(converted[KEY].view(torch.uint8), expected[KEY].view(torch.uint8))


@pytest.mark.parametrize("republish", [False, True])
def test_a_version_that_goes_between_the_check_and_the_rename_is_still_refused(
    store: WeightStore, monkeypatch: pytest.MonkeyPatch, republish: bool
) -> None:
    """The narrowest window: the version passes the check, then goes (and comes back) before the
    conversion's rename."""
    store.publish(1, _tensors(1))
    real_rename = os.rename

    def racing(source: str | Path, target: str | Path) -> None:
        if Path(target).name == "fp8":
            monkeypatch.setattr(os, "rename", real_rename)
            store.remove(1)
            if republish:
                store.publish(1, _tensors(10))
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", racing)
    word = "republished" if republish else "removed"
    with pytest.raises(WeightStoreError, match=rf"/fp8: stale: v00000001 was {word} while"):
        store.convert(1, "fp8")
    assert not (Path(store.path(1)) / "fp8").exists(), "the old weights stayed as version 1's conversion"
    assert store.versions() == ([1] if republish else [])
    assert not any(Path(store.path(1)).parent.glob("*/fp8")), "nothing left anywhere"


def test_a_stale_conversion_already_in_place_is_discarded_and_redone(
    store: WeightStore, tmp_path: Path
) -> None:
    # What a conversion by an older mixrl left: the old weights' conversion inside the new version.
    store.publish(1, _tensors(1))
    stale = tmp_path / "stale-fp8"
    shutil.copytree(store.convert(1, "fp8"), stale)
    store.remove(1)
    store.publish(1, _tensors(10))
    shutil.copytree(stale, Path(store.path(1)) / "fp8")
    converted, manifest = load_checkpoint_dir(store.convert(1, "fp8"))
    assert manifest["source_manifest_sha256"] == _manifest_sha256(store.path(1))
    expected = checkpoint_formats.convert_state_dict(_tensors(10), "fp8").tensors
    assert torch.equal(converted[KEY].view(torch.uint8), expected[KEY].view(torch.uint8))
    # A current conversion is returned as it is.
    before = (Path(store.path(1)) / "fp8" / MANIFEST).stat().st_mtime_ns
    store.convert(1, "fp8")
    assert (Path(store.path(1)) / "fp8" / MANIFEST).stat().st_mtime_ns == before


def _leftover(store: WeightStore, version: int) -> Path:
    """A version directory holding only a conversion, no manifest (what a late conversion left)."""
    directory = Path(store.path(version))
    (directory / "nvfp4").mkdir(parents=True)
    (directory / "nvfp4" / MANIFEST).write_text(json.dumps({"format": "mixrl.weights/v1", "files": {}}))
    return directory


def test_publish_clears_a_leftover_directory_of_its_version(store: WeightStore) -> None:
    store.publish(1, _tensors(1))
    leftover = _leftover(store, 2)
    assert store.versions() == [1]
    store.publish(2, _tensors(2))  # failed "already exists; published entries are immutable"
    assert store.versions() == [1, 2]
    assert not (leftover / "nvfp4").exists()
    assert torch.equal(store.load(2)[KEY], _tensors(2)[KEY])


def test_prune_clears_leftover_directories(store: WeightStore) -> None:
    for version in (1, 2, 3):
        store.publish(version, _tensors(version))
    old, new = _leftover(store, 0), _leftover(store, 9)
    assert store.prune(keep=2) == [1]
    assert not old.exists() and not new.exists()
    assert store.versions() == [2, 3]


def test_prune_is_not_stopped_by_a_staging_entry_gone_since_the_listing(store: WeightStore) -> None:
    # A dangling link: its stat() raises FileNotFoundError, as an entry that a converter promoted
    # or removed between prune's listing and its stat() does.
    store.publish(1, _tensors(1))
    staging = Path(store.path(1)).parent / ".staging"
    staging.mkdir(exist_ok=True)
    os.symlink(staging / "gone", staging / "v00000002__fp8.promoted")
    assert store.prune(keep=1) == []
    assert store.versions() == [1]
