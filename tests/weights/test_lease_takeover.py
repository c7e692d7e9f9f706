"""Taking over a conversion lease whose holder died, when several waiters find it at once: one
takes it over, and nobody removes the lease or the conversion of the one that did."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from mixrl.rl import weights
from mixrl.rl.weights import MANIFEST, WeightStore

KEY = "layers.0.mlp.up_proj.weight"
LEASE = "convert-v00000001-fp8.lease"


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    return {KEY: torch.randn(64, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)}


def test_a_waiter_does_not_remove_the_lease_another_took_over_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two waiters judged the dead holder's lease stale.  The other one takes it over and creates
    its own just before this one acts: this one must leave that live lease alone (and wait for
    it), not remove it and convert beside its holder."""
    timeout_s = 0.5
    monkeypatch.setattr(weights, "LEASE_POLL_S", 0.02)
    store = WeightStore(str(tmp_path / "weights"), lease_timeout_s=timeout_s)
    store.publish(1, _tensors(1))
    assert store.storage.create_flag(LEASE, "elsewhere:1:dead\n")
    lease = tmp_path / "weights" / ".flags" / LEASE
    os.utime(lease, (time.time() - 60, time.time() - 60))  # its holder died a minute ago

    other_took_over_at: list[float] = []
    real_rename, real_unlink = os.rename, os.unlink

    def the_other_waiter_takes_over_first(path: object) -> None:
        if Path(str(path)) == lease and not other_took_over_at:
            real_unlink(lease)
            assert store.storage.create_flag(LEASE, "elsewhere:2:other\n")
            other_took_over_at.append(time.time())

    def rename(source: str | Path, target: str | Path) -> None:
        the_other_waiter_takes_over_first(source)
        real_rename(source, target)

    def unlink(path: str | Path, *args: object, **kwargs: object) -> None:
        the_other_waiter_takes_over_first(path)
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "unlink", unlink)
    started: list[float] = []
    real_convert = WeightStore._convert

    def convert(self: WeightStore, version: int, precision: str, name: str) -> None:
        started.append(time.time())
        real_convert(self, version, precision, name)

    monkeypatch.setattr(WeightStore, "_convert", convert)
    store.convert(1, "fp8")
    assert other_took_over_at and len(started) == 1
    # The other waiter's lease stood until its own heartbeat went stale (it never converts here).
    assert started[0] - other_took_over_at[0] >= 0.9 * timeout_s, "converted beside a live lease holder"
    assert not lease.exists() and not [p.name for p in lease.parent.iterdir()], "nothing left in .flags"


def test_a_conversion_committed_by_another_converter_meanwhile_is_not_discarded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """This converter found no conversion, then another (holding a lease it took over) committed a
    valid one: discarding it as stale would throw away good work and leave engines to wait."""
    store = WeightStore(str(tmp_path / "weights"))
    other = WeightStore(str(tmp_path / "weights"))
    store.publish(1, _tensors(1))
    committed = Path(other.convert(1, "fp8"))
    before = (committed / MANIFEST).stat()
    looks = 0
    real_converted = store._converted

    def converted(version: int, name: str) -> bool:
        nonlocal looks
        looks += 1
        return looks > 2 and real_converted(version, name)  # its two looks came before the commit

    monkeypatch.setattr(store, "_converted", converted)
    caplog.set_level(logging.WARNING, logger="mixrl.rl.weights")
    assert Path(store.convert(1, "fp8")) == committed
    after = (committed / MANIFEST).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "it was replaced"
    assert not any("stale" in message for message in caplog.messages)
