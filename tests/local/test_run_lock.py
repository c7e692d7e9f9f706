"""One `mixrl run` at a time on a run directory: a second is refused in one line before it writes
anything there (a second buffer on the same logs, a new auth-token and a trainer resume that deletes
the first run's newer weight versions would follow)."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from mixrl.local.run import LOCK_FILE, RunDirectoryInUse, RunLock, clear_run_directory, main

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def held(run_dir: Path, pid: int) -> Iterator[None]:
    """The lock as another `mixrl run` holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / LOCK_FILE).open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write(f"{pid}\n")
        lock.flush()
        yield


@pytest.mark.parametrize("fresh", [[], ["--fresh"]], ids=["resume", "fresh"])
def test_a_second_run_on_a_run_directory_in_use_is_refused_in_one_line(
    tmp_path: Path, fresh: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "auth-token").write_text("the first run's token\n")
    (run_dir / "resolved.json").write_text('{"the first run": true}\n')
    spec = tmp_path / "quickstart.yaml"
    shutil.copyfile(ROOT / "examples" / "quickstart.yaml", spec)
    with held(run_dir, 4242):
        assert main([str(spec), "--run-dir", str(run_dir), *fresh]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"mixrl run: {run_dir} is in use by another mixrl run (pid 4242); stop it first or give another --run-dir"
    ]
    assert (run_dir / "auth-token").read_text() == "the first run's token\n"
    assert (run_dir / "resolved.json").read_text() == '{"the first run": true}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE, "auth-token", "resolved.json"]


def test_the_lock_names_its_run_and_is_free_again_once_released(tmp_path: Path) -> None:
    run_dir = tmp_path / "new" / "run"  # made by the lock, the first thing a run writes
    with RunLock(run_dir):
        assert (run_dir / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        with pytest.raises(RunDirectoryInUse, match=f"in use by another mixrl run \\(pid {os.getpid()}\\)"):
            RunLock(run_dir).acquire()
    with RunLock(run_dir):  # released on leaving the block (the kernel also drops it at exit)
        pass


def test_fresh_clears_the_run_directory_but_keeps_the_lock_it_holds(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        lock_file = (run_dir / LOCK_FILE).stat().st_ino
        (run_dir / "buffer").mkdir()
        (run_dir / "buffer" / "trajectories.jsonl").write_text("{}\n")
        (run_dir / "metrics.jsonl").write_text("{}\n")
        (run_dir / "weights").symlink_to(tmp_path)
        clear_run_directory(run_dir)
        assert [p.name for p in run_dir.iterdir()] == [LOCK_FILE]
        # The same file: a lock file made anew could be locked by another run at the same time.
        assert (run_dir / LOCK_FILE).stat().st_ino == lock_file
        with pytest.raises(RunDirectoryInUse):
            RunLock(run_dir).acquire()
    assert tmp_path.exists()  # a symlink is removed, not followed
