"""Real processes on one store: one converter per (version, precision), a converter or a loader
killed with SIGKILL in the middle, and what the next one finds.

The children are ``python -c`` processes over the same store directory.  The only stand-ins are
pause points: a child replaces one internal step (the conversion, or the application of a delta)
with the same step after a wait, or with a wait that never ends, so a kill lands at a known moment.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mixrl.rl.weights import WeightStore, forget_rebuilt, load_checkpoint_dir

CHILD = textwrap.dedent(
    """
    import logging, os, sys, time
    from mixrl.rl import weights, checkpoint_formats
    root, action, pause, lease_timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    weights.WAIT_LOG_S = 0.5
    weights.LEASE_POLL_S = 0.05

    def paused(real, forever):
        def step(*args, **kwargs):
            print("PAUSED", flush=True)
            time.sleep(120 if forever else 1.5)
            return real(*args, **kwargs)
        return step

    if pause == "convert-slowly":
        checkpoint_formats.convert_state_dict = paused(checkpoint_formats.convert_state_dict, False)
    elif pause == "convert-forever":
        checkpoint_formats.convert_state_dict = paused(checkpoint_formats.convert_state_dict, True)
    elif pause == "apply-forever":
        weights.apply_delta = paused(weights.apply_delta, True)
    # Imports done (seconds under load): say so beside the store, then wait for the start signal.
    (weights.Path(root).parent / f"ready-{os.getpid()}").touch()
    go = weights.Path(root) / "go"
    while not go.exists():
        time.sleep(0.01)
    store = weights.WeightStore(root, lease_timeout_s=lease_timeout)
    if action == "load":
        store.load(1)
        print("LOADED", flush=True)
    else:
        print("RESULT", store.convert(1, action), flush=True)
    """
)


def _start(root: Path, action: str, pause: str = "none", lease_timeout_s: float = 30.0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), action, pause, str(lease_timeout_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _go(root: Path, children: list[subprocess.Popen], timeout: float = 120.0) -> None:
    """Start the children's work together, once every one has imported what it needs: a child
    still importing when another had finished would find the work done instead of waiting for it."""
    deadline = time.monotonic() + timeout
    ready = [root.parent / f"ready-{child.pid}" for child in children]
    while not all(marker.exists() for marker in ready):
        assert time.monotonic() < deadline, "the children did not start"
        assert all(child.poll() is None for child in children), "a child exited before the start"
        time.sleep(0.05)
    (root / "go").touch()


def _wait_paused(child: subprocess.Popen) -> None:
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "PAUSED", child.stderr.read() if child.stderr else line


def _kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    child.communicate()


def _published(tmp_path: Path) -> WeightStore:
    """Version 0 a snapshot, version 1 a delta on it: every conversion and load rebuilds a chain."""
    store = WeightStore(str(tmp_path / "w"), snapshot_every=10)
    g = torch.Generator().manual_seed(0)
    state = {
        f"layers.{i}.mlp.up_proj.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16)
        for i in range(3)
    }
    store.publish(0, state)
    state = {name: tensor.clone() for name, tensor in state.items()}
    state["layers.1.mlp.up_proj.weight"][5] += 1.0
    store.publish(1, state)
    return store


def _visible_files(root: Path) -> dict[str, str]:
    """Every file a reader of the store can see (not the private staging, trash and flags)."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.relative_to(root).parts[0].startswith(".") and path.name != "go"
    }


def test_four_converters_of_one_version_do_the_work_once(tmp_path: Path) -> None:
    store = _published(tmp_path)
    root = Path(store.path(0)).parent
    children = [_start(root, "nvfp4", "convert-slowly") for _ in range(4)]
    _go(root, children)
    outputs = [child.communicate(timeout=120) for child in children]
    assert [child.returncode for child in children] == [0] * 4, [err for _, err in outputs]
    results = {line for out, _ in outputs for line in out.splitlines() if line.startswith("RESULT")}
    assert results == {f"RESULT {Path(store.path(1)) / 'nvfp4'}"}
    logs = [err for _, err in outputs]
    converting = [log for log in logs if "converting weight version 1 to nvfp4 (holding the lease)" in log]
    assert len(converting) == 1, logs
    assert sum("waiting for" in log and "to convert v00000001/nvfp4" in log for log in logs) == 3, logs
    assert not list((root / ".flags").iterdir())  # the lease is released
    forget_rebuilt()
    assert load_checkpoint_dir(str(Path(store.path(1)) / "nvfp4"))[0]


def test_a_killed_converter_is_taken_over_once_its_heartbeat_stops(tmp_path: Path) -> None:
    store = _published(tmp_path)
    root = Path(store.path(0)).parent
    holder = _start(root, "fp8", "convert-forever", lease_timeout_s=1.0)
    _go(root, [holder])
    _wait_paused(holder)
    # While the holder lives its heartbeat keeps the lease fresh: a second converter waits.
    lease = root / ".flags" / "convert-v00000001-fp8.lease"
    time.sleep(1.5)
    assert time.time() - lease.stat().st_mtime < 1.0
    waiter = _start(root, "fp8", lease_timeout_s=1.0)
    time.sleep(1.0)
    assert waiter.poll() is None and not (Path(store.path(1)) / "fp8").exists()
    _kill(holder)
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    # On one host the dead holder's process is seen gone at once (a holder on another node is
    # judged by its heartbeat: tests/weights/test_store.py).
    assert "whose process is gone; taking over" in err and "converting weight version 1 to fp8" in err
    assert out.strip().endswith(str(Path(store.path(1)) / "fp8"))
    assert not lease.exists()
    assert load_checkpoint_dir(str(Path(store.path(1)) / "fp8"))[0]


@pytest.mark.parametrize("action", ["load", "bf16"])
def test_a_loader_killed_while_applying_a_delta_leaves_nothing_half_visible(
    tmp_path: Path, action: str
) -> None:
    """A torch engine's load writes nothing; an SGLang sidecar's materialisation of ``v1/bf16``
    is staged: a kill in the middle of either leaves the store as it was, and the next succeeds."""
    store = _published(tmp_path)
    root = Path(store.path(0)).parent
    before = _visible_files(root)
    child = _start(root, action, "apply-forever", lease_timeout_s=1.0)
    _go(root, [child])
    _wait_paused(child)
    _kill(child)
    assert _visible_files(root) == before
    assert store.versions() == [0, 1] and not (Path(store.path(1)) / "bf16").exists()
    forget_rebuilt()
    expected = store.load(1)
    after = _start(root, action, lease_timeout_s=1.0)
    out, err = after.communicate(timeout=60)
    assert after.returncode == 0, err
    if action == "bf16":
        materialised = load_checkpoint_dir(str(Path(store.path(1)) / "bf16"))[0]
        assert all(torch.equal(materialised[name], expected[name]) for name in expected)
    else:
        assert "LOADED" in out
    assert not (root / ".flags").exists() or os.listdir(root / ".flags") == []  # no lease left
