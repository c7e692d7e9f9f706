"""Helpers of the sandbox tests: a sandbox, and what the host sees of the processes it ran."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mixrl.rl.sandbox import Sandbox

needs_bwrap = pytest.mark.needs_bwrap  # tests/conftest.py fails these without the binary


@pytest.fixture
def sandbox() -> Sandbox:
    return Sandbox()


@pytest.fixture(autouse=True)
def no_seed_directory_left(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Every test: the host directories the sandboxes' files were written to are gone afterwards.

    The test gets a temporary directory of its own (``tempfile.tempdir``, world-writable like
    /tmp, for the unprivileged uid the sandbox runs as), so the sandboxes of tests running at the
    same time in another process (make test runs on both cores) are not counted as left over."""
    tmp_path_factory.getbasetemp()  # pytest's own tmp_path stays where it is
    own = Path(tempfile.mkdtemp(prefix="sandbox-test-tmp-"))
    own.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(own))
    try:
        yield
        assert list(own.glob("mixrl-sandbox-*")) == []
    finally:
        shutil.rmtree(own, ignore_errors=True)


@pytest.fixture
def token() -> str:
    """A word to put in a command line, to find its processes on the host afterwards."""
    return f"mixrltoken{uuid.uuid4().hex[:12]}"


def host_processes(token: str) -> list[int]:
    """Host pids whose command line holds ``token`` (this test process's own excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline and b"pytest" not in cmdline:
            found.append(int(entry.name))
    return found


def host_uid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
