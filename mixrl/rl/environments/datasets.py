"""Tasks from dataset files (JSONL, Parquet) or from the environment's own generator.

A dataset file holds one task per row: a JSON object per line of a ``.jsonl`` file (read with the
standard library), or a row of a ``.parquet`` file (read with pyarrow, the ``mixrl[datasets]``
extra; a Parquet row arrives as the ``dict`` ``pyarrow.Table.to_pylist`` makes, as a Hugging Face
``Dataset`` yields it).  The environment turns each row into a task
(:meth:`mixrl.rl.environments.base.Environment.task_from_record`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mixrl.rl.environments.base import Environment, Split, TaskT

DATASET_SUFFIXES: tuple[str, ...] = (".jsonl", ".parquet")


class DatasetError(ValueError):
    """A dataset file cannot be used; the message is one line naming the file (and line)."""


def read_records(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` rows (all when None) of a ``.jsonl`` or ``.parquet`` file."""
    path = Path(path)
    if path.suffix not in DATASET_SUFFIXES:
        raise DatasetError(f"{path}: a dataset is a {' or '.join(DATASET_SUFFIXES)} file")
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    return _read_parquet(path, limit) if path.suffix == ".parquet" else _read_jsonl(path, limit)


def _read_jsonl(path: Path, limit: int | None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise DatasetError(
                    f"{path}:{number}: a row must be a JSON object, got {type(record).__name__}"
                )
            records.append(record)
    return records


def _read_parquet(path: Path, limit: int | None) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq  # the datasets extra; JSONL needs nothing
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install 'mixrl[datasets]')") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not Parquet
        raise DatasetError(f"{path}: not a Parquet file ({exc})") from None
    records: list[dict[str, Any]] = []
    for batch in parquet.iter_batches():
        records += batch.to_pylist()
        if limit is not None and len(records) >= limit:
            return records[:limit]
    return records


def load_tasks(
    environment: Environment[TaskT], split: Split, n: int, seed: int, path: str | Path | None = None
) -> Sequence[TaskT]:
    """``n`` tasks of ``split``: the first ``n`` rows of ``path``, or the environment's generator.

    Task ids must be unique within a split (groups and evaluations are keyed by them)."""
    if path is None:
        tasks = environment.generate_tasks(split, n, seed)
    else:
        records = read_records(path, n)
        if not records:
            raise DatasetError(f"{path}: no rows")
        try:
            tasks = [
                environment.task_from_record(record, split, index) for index, record in enumerate(records)
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"{path}: {type(environment).__name__} cannot read a row: {exc}") from None
    seen: set[str] = set()
    for task in tasks:
        if task.id in seen:
            raise DatasetError(f"{path or type(environment).__name__}: task id {task.id!r} appears twice")
        seen.add(task.id)
    return tasks
