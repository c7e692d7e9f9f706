"""Your own coding tasks, in the SWE-style layout: a repository snapshot, a problem statement, a test command.

As a directory (``environmentArgs.tasks: /path/to/tasks``), one sub-directory per task::

    tasks/
      fix-parser/
        task.json      {"problem_statement": "...", "test_command": "python3 -m unittest -v",
                        "split": "train"}          # split optional: else a hash of the id decides
        repo/          the snapshot the agent starts from (every UTF-8 file; .git and binaries left out)
        tests/         optional hidden tests: copied over the snapshot only when the episode is scored

or as rows of a JSONL/Parquet dataset (``rollout.dataset.train``), one task per row::

    {"id": "fix-parser", "repo": "/data/fix-parser/repo", "problem_statement": "...",
     "test_command": "python3 -m unittest -v", "hidden_tests": "/data/fix-parser/tests"}

(``instance_id`` is read as ``id``, as SWE-bench names it; relative paths are relative to
``environmentArgs.root``.)  The test command runs in the sandbox in ``/work``, the snapshot's root,
with no network: its test framework must be in the sandbox's interpreter (``/usr`` and the
sandbox's ``ro_paths``).  Its output is scored by :func:`mixrl.rl.environments.coding.scoring.score`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mixrl.rl.environments.base import SPLITS, Split
from mixrl.rl.environments.coding.tasks import CodingTask
from mixrl.rl.sandbox.files import check_path

MAX_SNAPSHOT_FILES = 2000
MAX_SNAPSHOT_BYTES = 32 * 1024 * 1024
SKIPPED_DIRS = frozenset({".git", "__pycache__", ".venv", "node_modules"})
HELDOUT_BUCKETS = 8


class TaskSetError(ValueError):
    """A user task cannot be read; the message is one line naming the file or field."""


def read_snapshot(root: Path) -> dict[str, str]:
    """Every UTF-8 file under ``root`` as ``{relative path: text}`` (binaries and .git left out)."""
    if not root.is_dir():
        raise TaskSetError(f"{root}: no such directory (a task's repository snapshot)")
    files: dict[str, str] = {}
    size = 0
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if any(part in SKIPPED_DIRS for part in relative.parts):
            continue
        if path.is_symlink():
            raise TaskSetError(f"{path}: a symbolic link; a snapshot holds regular files only")
        if path.is_dir():
            continue
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        size += len(data)
        if len(files) >= MAX_SNAPSHOT_FILES or size > MAX_SNAPSHOT_BYTES:
            raise TaskSetError(
                f"{root}: more than {MAX_SNAPSHOT_FILES} files or {MAX_SNAPSHOT_BYTES} bytes; trim the snapshot"
            )
        files[check_path(relative.as_posix())] = text
    return files


def _split(task_id: str, given: Any, where: str) -> Split:
    if given is None:
        bucket = int(hashlib.sha256(task_id.encode()).hexdigest(), 16) % HELDOUT_BUCKETS
        return "heldout" if bucket == 0 else "train"
    if given not in SPLITS:
        raise TaskSetError(f"{where}: split must be one of {SPLITS}, got {given!r}")
    return given


def _text_field(record: Mapping[str, Any], name: str, where: str) -> str:
    value = record.get(name)
    if not isinstance(value, str) or not value.strip():
        raise TaskSetError(f"{where}: {name} must be a non-empty string, got {value!r}")
    return value


def task_from_record(record: Mapping[str, Any], split: Split, index: int, root: Path) -> CodingTask:
    """One JSONL/Parquet row as a task (``split`` is the dataset's: the row is in that file)."""
    where = f"row {index}"
    task_id = record.get("id", record.get("instance_id"))
    if not isinstance(task_id, str) or not task_id:
        raise TaskSetError(f"{where}: id (or instance_id) must be a non-empty string, got {task_id!r}")
    repo = root / _text_field(record, "repo", where)
    hidden = record.get("hidden_tests")
    if hidden is not None and not isinstance(hidden, str):
        raise TaskSetError(f"{where}: hidden_tests must be a directory path, got {hidden!r}")
    return CodingTask(
        id=task_id,
        split=split,
        problem=_text_field(record, "problem_statement", where),
        files=read_snapshot(repo),
        hidden_tests=read_snapshot(root / hidden) if hidden else {},
        test_command=_text_field(record, "test_command", where),
    )


def load_task_dir(directory: Path, split: Split) -> list[CodingTask]:
    """The tasks of ``split`` under ``directory`` (the layout above), sorted by id."""
    if not directory.is_dir():
        raise TaskSetError(f"environmentArgs.tasks: {directory} is not a directory")
    tasks: list[CodingTask] = []
    for task_dir in sorted(path for path in directory.iterdir() if path.is_dir()):
        spec_path = task_dir / "task.json"
        if not spec_path.is_file():
            raise TaskSetError(f"{task_dir}: no task.json (problem_statement, test_command)")
        try:
            spec = json.loads(spec_path.read_text())
        except json.JSONDecodeError as exc:
            raise TaskSetError(f"{spec_path}: not JSON ({exc.msg})") from None
        if not isinstance(spec, dict):
            raise TaskSetError(f"{spec_path}: must hold a JSON object")
        if _split(task_dir.name, spec.get("split"), str(spec_path)) != split:
            continue
        hidden = task_dir / "tests"
        tasks.append(
            CodingTask(
                id=task_dir.name,
                split=split,
                problem=_text_field(spec, "problem_statement", str(spec_path)),
                files=read_snapshot(task_dir / "repo"),
                hidden_tests=read_snapshot(hidden) if hidden.is_dir() else {},
                test_command=_text_field(spec, "test_command", str(spec_path)),
            )
        )
    return tasks
