"""Durable writes on a POSIX filesystem, shared by the buffer's logs and the weight and checkpoint
stores (torch-free, so the buffer can use it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any


def sync_file(f: IO[Any]) -> None:
    """Flush an open file's buffer and fsync it: what was written to it is on disk on return."""
    f.flush()
    os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so that the names in it survive a power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
