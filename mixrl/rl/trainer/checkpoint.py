"""Sharded trainer checkpoints with ``torch.distributed.checkpoint`` (DCP), loaded without running a
pickle from the run volume, resumable on any number of ranks.

What a save of step s leaves in the run directory:

    checkpoint-<s>/
      .metadata            DCP's index: each value's key, each tensor's global shape and dtype,
                           and which chunk of it lies where in which file
      __<rank>_0.distcp    what rank <rank> wrote: its FSDP2 shards of the parameters and of
                           AdamW's moments, and its share of the values every rank holds alike
                           (AdamW's step counters, the param groups, the step), which DCP writes
                           once, spread over the ranks

The state saved is ``{"model", "optimizer", "step"}``, the model and optimizer state as
``torch.distributed.checkpoint.state_dict.get_state_dict`` gives them sharded (keyed by parameter
name; under FSDP2 each tensor a DTensor holding this rank's shard, in one process the whole
tensor).  So each rank writes only what it holds, and a checkpoint written by N ranks loads on M:
each rank reads the pieces of the saved chunks that overlap the shard it holds now.  One process
without a process group saves and loads the same way (DCP's no-dist mode).

**Atomic.**  Every rank writes into ``checkpoint.tmp-<s>/``; DCP's coordinator (rank 0) writes
``.metadata`` once every rank's files are written; rank 0 then checks that it sees every file the
metadata names, with its full length (so every rank wrote into the same directory: a trainer on
several nodes needs one volume they all mount), renames the directory to ``checkpoint-<s>`` (one
``rename``) and only then removes older checkpoints.  A crash at any point leaves the previous
checkpoint whole; :func:`latest` never looks at a temporary directory, and the next save removes
it.

**No pickle runs at load.**  DCP's ``.metadata`` is a pickle (``FileSystemReader.read_metadata``
calls ``pickle.load``), and DCP loads non-tensor values with ``torch.load(weights_only=False)``.
:class:`SafeReader` unpickles the metadata with :class:`MetadataUnpickler`, which resolves only
DCP's metadata classes, ``torch.Size``, torch's dtypes, layouts and memory formats and ``pathlib``
paths (the pattern "Restricting Globals" of the ``pickle`` documentation), refuses any other global
before anything is called, and then checks that the result is DCP metadata whose files are plain
``__<rank>_<n>.distcp`` names inside the checkpoint.  :class:`WeightsOnlyPlanner` loads non-tensor
values with ``torch.load(weights_only=True)``; DCP reads tensors with ``weights_only=True`` itself.
The other way — only tensors in DCP, plain values in a JSON file beside it — would still need the
metadata pickle read safely, and would take AdamW's param groups out of the form
``set_state_dict`` expects; this way DCP stays DCP.
"""

from __future__ import annotations

import enum
import io
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from mixrl.rl.durable import fsync_path
from mixrl.rl.trainer import distributed

PREFIX = "checkpoint-"
"""``checkpoint-<step>``: a complete checkpoint."""
PENDING = "checkpoint.tmp-"
"""``checkpoint.tmp-<step>``: a save in progress, or one a crash interrupted."""
LEGACY = "trainer.pt"
"""The single-file checkpoint of mixrl before DCP (the whole state, ``torch.save``); still read."""
METADATA = ".metadata"
_SHARD_FILE = re.compile(r"__[0-9]+_[0-9]+\.distcp")
_STEP = re.compile(r"[0-9]+")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or is refused at load (one line: the path and why)."""


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint in ``run_dir``: the ``checkpoint-<step>`` directory with the
    highest step, else a single-file ``trainer.pt`` from before DCP, else None."""
    steps = [
        (int(path.name.removeprefix(PREFIX)), path)
        for path in run_dir.glob(f"{PREFIX}*")
        if _STEP.fullmatch(path.name.removeprefix(PREFIX)) and (path / METADATA).is_file()
    ]
    if steps:
        return max(steps)[1]
    legacy = run_dir / LEGACY
    return legacy if legacy.is_file() else None


def latest_on_every_rank(run_dir: Path) -> Path | None:
    """:func:`latest`, checked to be the same checkpoint on every rank (they load it together)."""
    found = latest(run_dir)
    mine = -1 if found is None else step_of(found)
    if distributed.agree_on_count(mine) != -distributed.agree_on_count(-mine):
        raise CheckpointError(
            f"{run_dir}: the trainer's ranks see different checkpoints (this rank: {found}); every"
            " rank must see the same run directory (a trainer on several nodes needs one shared volume)"
        )
    return found


def step_of(path: Path) -> int:
    """The step in a checkpoint's name (0 for a single-file ``trainer.pt``: its step is inside)."""
    suffix = path.name.removeprefix(PREFIX)
    return int(suffix) if _STEP.fullmatch(suffix) else 0


def begin(run_dir: Path, step: int, *, is_main: bool) -> Path:
    """The empty ``checkpoint.tmp-<step>`` every rank writes its part of step ``step`` into
    (collective); what earlier saves a crash interrupted is removed."""
    pending = run_dir / f"{PENDING}{step}"
    if is_main:
        for leftover in run_dir.glob(f"{PENDING}*"):
            shutil.rmtree(leftover)
        pending.mkdir(parents=True)
    distributed.barrier()  # no rank writes before the directory is there and empty
    return pending


def commit(run_dir: Path, pending: Path, *, is_main: bool) -> Path:
    """Make a completely written ``pending`` the checkpoint of its step (collective): one rename
    of a directory whose files are all synced, then older checkpoints removed."""
    final = run_dir / pending.name.replace(PENDING, PREFIX, 1)
    if is_main:
        fsync_path(pending)
        if final.exists():
            # Not in a run: after a resume from the newest checkpoint every save has a higher step.
            shutil.rmtree(final)
        pending.rename(final)
        fsync_path(run_dir)
        for older in run_dir.glob(f"{PREFIX}*"):
            if older != final:
                shutil.rmtree(older)
        (run_dir / LEGACY).unlink(missing_ok=True)
    distributed.barrier()  # the others go on once the step's checkpoint is in place
    return final


def save(run_dir: Path, step: int, state: dict[str, Any], *, is_main: bool) -> Path:
    """Write ``state`` as ``run_dir/checkpoint-<step>`` (every rank calls this with its own shards;
    collective), then remove older checkpoints.  Returns the checkpoint's path."""
    pending = begin(run_dir, step, is_main=is_main)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: meant
            writer = FileSystemWriter(pending, thread_count=1, sync_files=True)
            written = dcp.save(state, storage_writer=writer)
    except CheckpointException as exc:  # a failed write on any rank fails every rank
        raise CheckpointError(
            f"{pending}: not written, the previous checkpoint stays: {_reason(exc)}"
        ) from None
    problem = _unwritten(pending, written) if is_main else ""
    if distributed.agree_on_count(int(bool(problem))):  # every rank fails, the previous checkpoint stays
        raise CheckpointError(problem or f"{pending}: not committed: rank 0 found it incomplete")
    return commit(run_dir, pending, is_main=is_main)


def _unwritten(pending: Path, written: dcp_metadata.Metadata) -> str:
    """What is missing from a save (rank 0's view; empty when complete)."""
    needed: dict[str, int] = {}
    for info in written.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(
        name
        for name, size in needed.items()
        if not (pending / name).is_file() or (pending / name).stat().st_size < size
    )
    if not missing:
        return ""
    return (
        f"{pending}: rank 0 does not see {', '.join(missing)} that other ranks wrote: every rank"
        " must write into the same run directory (a trainer on several nodes needs one shared volume)"
    )


def load(path: Path, state: dict[str, Any]) -> None:
    """Fill ``state`` from the checkpoint at ``path``: its tensors (this rank's shards) in place,
    its other values replaced.  Every rank calls this (collective); nothing from the files is
    unpickled except through :class:`MetadataUnpickler` and ``weights_only``."""
    reader = SafeReader(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyPlanner())
    except CheckpointException as exc:  # what DCP makes of a failure on any rank
        ours = [f[0] for f in exc.failures.values() if isinstance(f[0], CheckpointError)]
        raise CheckpointError(str(ours[0]) if ours else f"{path}: not loaded: {_reason(exc)}") from None


def _reason(exc: CheckpointException) -> str:
    """DCP's exception (every failing rank's traceback) as one line: the first rank's error."""
    rank, (error, _) = min(exc.failures.items(), key=lambda item: item[0])
    lines = str(error).strip().splitlines() or [""]
    return f"rank {rank}: {type(error).__name__}: {lines[0]}"


def _allowed_globals() -> frozenset[tuple[str, str]]:
    torch_values = {
        ("torch", name)
        for name in dir(torch)
        if isinstance(getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format)
    }
    metadata_classes = {
        (dcp_metadata.__name__, cls.__name__)
        for cls in (
            dcp_metadata.Metadata,
            dcp_metadata.StorageMeta,
            dcp_metadata.MetadataIndex,
            dcp_metadata.TensorStorageMetadata,
            dcp_metadata.BytesStorageMetadata,
            dcp_metadata.ChunkStorageMetadata,
            dcp_metadata.TensorProperties,
            dcp_metadata._MEM_FORMAT_ENCODING,  # TensorProperties pickles its memory format as this enum
        )
    }
    return frozenset(
        {
            *torch_values,
            *metadata_classes,
            (_StorageInfo.__module__, _StorageInfo.__name__),
            ("torch", "Size"),
            # How torch pickles a layout: a lookup of the name among torch's layouts.
            ("torch.serialization", "_get_layout"),
            # StorageMeta.checkpoint_id: the path the writer was given.
            ("pathlib", "Path"),
            ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"),
        }
    )


ALLOWED_GLOBALS = _allowed_globals()
"""The only globals :class:`MetadataUnpickler` resolves: DCP's metadata classes, ``torch.Size``,
torch's dtype, layout and memory-format values, and ``pathlib`` paths."""


def _enum_member(owner: Any, name: Any) -> Any:
    """``getattr`` in a metadata pickle, limited to a member of an allowed enum class (found the
    first time a trainer pod on Debian's Python 3.11.2 read back its own checkpoint)."""
    allowed = isinstance(owner, type) and issubclass(owner, enum.Enum)
    allowed = allowed and (owner.__module__, owner.__name__) in ALLOWED_GLOBALS
    if not allowed or not isinstance(name, str) or name not in owner.__members__:
        raise pickle.UnpicklingError(f"getattr({owner!r}, {name!r}) is not a DCP metadata enum member")
    return owner.__members__[name]


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` resolving only :data:`ALLOWED_GLOBALS`: a pickle that names
    any other global (``os.system``, ``builtins.eval``, a class with a harmful ``__setstate__``…)
    is refused before that global is looked up, so it never runs.  The allowed classes are plain
    dataclasses and enums, whose construction and ``__setstate__`` only store values."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member  # how some Python 3.11 releases pickle an enum member: getattr(cls, name)
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not DCP metadata")


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """The checkpoint's ``.metadata``, through :class:`MetadataUnpickler`, checked to be DCP
    metadata whose files are plain ``__<rank>_<n>.distcp`` names in the checkpoint directory."""
    file = path / METADATA
    try:
        with file.open("rb") as stream:
            metadata = MetadataUnpickler(stream).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing: not a complete checkpoint") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"{file}: refused: {exc}") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{file}: refused: holds a {type(metadata).__name__}, not DCP metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{file}: refused: its index is not a mapping")
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo) or not (
            isinstance(info.relative_path, str) and _SHARD_FILE.fullmatch(info.relative_path)
        ):
            where = getattr(info, "relative_path", info)
            raise CheckpointError(f"{file}: refused: {where!r} is not a shard file of this checkpoint")
    if metadata.storage_meta is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read once, by :func:`read_metadata`, when it is made
    (so a refused checkpoint fails here with one line, before any collective)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._metadata = read_metadata(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        assert self._metadata.storage_meta is not None  # read_metadata() sets one
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor values loaded by ``torch.load(weights_only=True)``
    (DCP's own uses ``weights_only=False``, which runs whatever the file pickled)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's message is a paragraph; the line that names what was refused is enough.
            lines = [line for line in str(exc).splitlines() if line.strip()]
            reason = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else repr(exc))
            raise CheckpointError(f"{fqn}: refused (weights_only): {reason.strip()}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
