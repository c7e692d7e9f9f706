"""The weight store: versioned checkpoints, published atomically, stored as snapshots or deltas,
verified on load, converted once per precision.

Layout under the store's root (a local path or ``file://`` URL; object stores plug in as another
`Storage`)::

    v00000010/                  a snapshot: the whole version (the trainer's tensors, as given)
      model.safetensors           or model-0000i-of-0000n.safetensors + model.safetensors.index.json
      config.json                 when the publisher passed a transformers config
      manifest.json               written last: sha256 and size of every file, version, metadata,
                                  kind (snapshot), tensors_sha256 (a digest of the tensors themselves)
      nvfp4/                      a per-precision conversion, in the layout SGLang loads
        model.safetensors, config.json (+ hf_quant_config.json), manifest.json
    v00000011/                  a delta: the change from its base (the version published before)
      model.delta                 per tensor the zlib'd XOR of its words with the base's, or the
                                  tensor whole when new or reshaped; unchanged tensors are absent
      config.json, manifest.json  kind (delta), base, base_tensors_sha256, tensors_sha256
      bf16/                       a delta version served by SGLang at BF16 is materialised here
    .flags/                     small files: a snapshot request, conversion leases

A version is visible only when complete: it is written into a private staging directory, every file
is fsynced, the manifest goes in last, and one rename publishes it. Loaders verify the manifest and
refuse a version that lacks one (incomplete) or whose files do not match it (corrupt).

**Deltas.** ``WeightStore(url, snapshot_every=N)`` publishes a full snapshot every N versions (N=1:
every version whole) and a delta (mixrl.rl.weight_deltas) in between, because consecutive RL
versions differ in few BF16 words.  Loading a delta version (`load_checkpoint_dir` on its
directory; the store root is its parent) rebuilds it from the chain back to the last snapshot and
checks the result against the manifest's ``tensors_sha256``.  The last version rebuilt or published
in this process is kept in memory, so a loader that follows the versions one by one reads one delta
per version (the price: one more copy of the weights in this process's memory).  A missing or
damaged link is refused with one line naming the file; whoever notices (the weight-sync sidecar)
asks for a snapshot with `WeightStore.request_snapshot`, which the next publish honours.  `prune`
keeps every version that a kept version's chain needs.

**One converter per precision.** `WeightStore.convert` takes a lease (a file created exclusively
under ``.flags/``, its mtime refreshed while converting); the other replicas of a pool wait for the
conversion to appear and load it.  A lease whose holder is a process of this host that is gone, or
whose heartbeat is older than ``lease_timeout_s`` (its
holder died) is taken over, by one waiter only (the lease is renamed away, which one caller wins).  A conversion is committed only into its version as it was when the
conversion began (the sha256 of its manifest, recorded in the conversion's): one whose version was
removed or republished meanwhile is refused, and one that does not match is discarded and redone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from mixrl.rl import activation_quant, checkpoint_formats, quant
from mixrl.rl.durable import fsync_path, sync_file
from mixrl.rl.weight_deltas import DeltaError, apply_delta, encode_delta, tensors_sha256

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "mixrl.weights/v1"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 4 << 30
STALE_STAGING_S = 3600.0
_VERSION_DIR = re.compile(r"^v(\d{8})$")
MAX_VERSION = 10**8 - 1
"""Versions are directory names of eight digits: [0, MAX_VERSION]."""
MAX_MANIFEST_BYTES = 16 << 20
"""A manifest lists a few hundred shards at most; a larger one is not ours."""
MAX_SHOWN_CHARS = 200
DELTA_FILE = "model.delta"
SNAPSHOT, DELTA = "snapshot", "delta"
"""A version's ``kind`` in its manifest (a manifest without one, from before deltas, is a snapshot)."""
SNAPSHOT_REQUEST = "snapshot-requested"
"""The flag a loader that found a broken chain leaves for the publisher: write the next one whole."""
LEASE_TIMEOUT_S = 120.0
"""A conversion lease whose heartbeat is older than this is taken over (its holder died).  Far
above the heartbeat period and any clock skew between the nodes sharing the store."""
LEASE_POLL_S = 0.5
WAIT_LOG_S = 10.0


class WeightStoreError(Exception):
    """A version is missing, incomplete or corrupt, or a store operation cannot proceed."""


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


# ------------------------------------------------------------------------------------------ storage


class Storage(Protocol):
    """Where entries (version directories, conversions) live.

    An entry is visible only once `staging` has committed it. An object-store backend would stage in
    a local temporary directory, upload every file, upload the manifest last, and list only prefixes
    whose manifest exists; `local_dir` would download (and cache) an entry for loaders.  A nested
    entry (``vN/<precision>``) is committed only into a version that exists, and with
    ``parent_manifest_sha256`` only into the one whose manifest has that sha256: a conversion that
    finishes after its version was removed or republished is refused, never committed.
    """

    def exists(self, name: str) -> bool: ...
    def list_top(self) -> list[str]: ...
    def local_dir(self, name: str) -> Path: ...
    def staging(
        self, name: str, parent_manifest_sha256: str | None = None
    ) -> contextlib.AbstractContextManager[Path]: ...
    def remove(self, name: str) -> None: ...
    def remove_stale_staging(self, older_than_s: float) -> int: ...

    # Flags: small files beside the entries (a snapshot request, conversion leases).  An object
    # store would create one with a conditional put (If-None-Match) and read its age from metadata.
    def create_flag(self, name: str, text: str) -> bool: ...
    def write_flag(self, name: str, text: str) -> None: ...
    def read_flag(self, name: str) -> str | None: ...
    def flag_age_s(self, name: str) -> float | None: ...
    def touch_flag(self, name: str) -> None: ...
    def remove_flag(self, name: str) -> None: ...
    def take_over_flag(self, name: str, text: str, older_than_s: float) -> bool: ...


class LocalStorage:
    """A directory on a local or shared POSIX filesystem (PVC, NFS): atomic rename publishes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._staging_root = self.root / ".staging"
        self._trash_root = self.root / ".trash"
        self._flags_root = self.root / ".flags"

    def exists(self, name: str) -> bool:
        return (self.root / name / MANIFEST).is_file()

    def list_top(self) -> list[str]:
        return sorted(entry.name for entry in self.root.iterdir() if entry.is_dir())

    def local_dir(self, name: str) -> Path:
        return self.root / name

    @contextlib.contextmanager
    def staging(self, name: str, parent_manifest_sha256: str | None = None) -> Iterator[Path]:
        self._staging_root.mkdir(exist_ok=True)
        tmp = self._staging_root / f"{name.replace('/', '__')}.{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            yield tmp
            fsync_path(tmp)
            self._promote(tmp, self.root / name, parent_manifest_sha256)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _promote(self, tmp: Path, final: Path, parent_manifest_sha256: str | None = None) -> None:
        """One rename makes the entry visible; a rename onto an existing entry fails.

        A nested entry's parent is never created here: a version without its manifest (removed by
        a resumed trainer or by prune while a conversion of it ran) would be left holding only the
        conversion, invisible to `versions` and blocking the version's next publish."""
        if final.parent != self.root:
            self._check_parent(final, parent_manifest_sha256)
        if final.exists():
            raise WeightStoreError(f"{final}: already exists; published entries are immutable")
        try:
            os.rename(tmp, final)
        except FileNotFoundError:  # the version went after the check
            raise WeightStoreError(
                f"{final}: stale: {final.parent.name} was removed while this was written; discarded"
            ) from None
        except OSError as exc:
            raise WeightStoreError(f"{final}: cannot publish: {exc.strerror}") from exc
        if final.parent != self.root:
            # Checked again: a version removed and republished between the check and the rename
            # would otherwise hold this entry made from its predecessor.
            try:
                self._check_parent(final, parent_manifest_sha256)
            except WeightStoreError:
                with contextlib.suppress(FileNotFoundError):  # gone with its version
                    self.remove(str(final.relative_to(self.root)))
                raise
        fsync_path(final.parent)

    @staticmethod
    def _check_parent(final: Path, parent_manifest_sha256: str | None) -> None:
        """Refuse to commit ``final`` unless its version is there (and is the one it was made from)."""
        version = final.parent.name
        try:
            digest = _sha256(final.parent / MANIFEST)
        except (FileNotFoundError, NotADirectoryError):
            raise WeightStoreError(
                f"{final}: stale: {version} was removed while this was written; discarded"
            ) from None
        if parent_manifest_sha256 is not None and digest != parent_manifest_sha256:
            raise WeightStoreError(
                f"{final}: stale: {version} was republished while this was written; discarded"
            )

    def remove(self, name: str) -> None:
        # Rename out of sight first, so a half-deleted entry is never seen as a corrupt version.
        self._trash_root.mkdir(exist_ok=True)
        doomed = self._trash_root / f"{name.replace('/', '__')}.{uuid.uuid4().hex}"
        os.rename(self.root / name, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def remove_stale_staging(self, older_than_s: float) -> int:
        removed = 0
        cutoff = time.time() - older_than_s
        for parent in (self._staging_root, self._trash_root):
            for entry in parent.iterdir() if parent.is_dir() else ():
                try:
                    mtime = entry.stat().st_mtime
                except FileNotFoundError:  # promoted or removed by its writer since the listing
                    continue
                if mtime < cutoff:
                    shutil.rmtree(entry, ignore_errors=True)
                    removed += 1
        return removed

    def _flag(self, name: str) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError(f"flag: {name!r} is not a plain file name")
        return self._flags_root / name

    def create_flag(self, name: str, text: str) -> bool:
        """Create the flag holding ``text`` unless it exists (O_EXCL: exactly one creator wins)."""
        path = self._flag(name)
        self._flags_root.mkdir(exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
            sync_file(f)
        return True

    def write_flag(self, name: str, text: str) -> None:
        path = self._flag(name)
        self._flags_root.mkdir(exist_ok=True)
        staged = path.with_name(f".{name}.{uuid.uuid4().hex}")
        staged.write_text(text)
        os.replace(staged, path)

    def read_flag(self, name: str) -> str | None:
        try:
            return self._flag(name).read_text()
        except FileNotFoundError:
            return None

    def flag_age_s(self, name: str) -> float | None:
        try:
            return time.time() - self._flag(name).stat().st_mtime
        except FileNotFoundError:
            return None

    def touch_flag(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._flag(name))

    def remove_flag(self, name: str) -> None:
        self._flag(name).unlink(missing_ok=True)

    def take_over_flag(self, name: str, text: str, older_than_s: float) -> bool:
        """Remove the flag if it still holds ``text`` and its mtime is older than ``older_than_s``;
        True for exactly one of several callers racing to do so.

        A read-then-remove would let two waiters that both judged a lease dead remove it in turn,
        the second removing the lease the first had since created (and both would convert).  One
        rename to a name of our own is atomic: only one caller gets the file.  The one that does
        checks that it moved the lease it judged (text and age); a live lease, created or refreshed
        in between, is put back with a link, which never replaces a lease created since."""
        path = self._flag(name)
        taken = path.with_name(f".{name}.taken.{uuid.uuid4().hex}")
        try:
            os.rename(path, taken)
        except FileNotFoundError:
            return False  # released, or another waiter took it over first
        try:
            if taken.read_text() == text and time.time() - taken.stat().st_mtime > older_than_s:
                return True
            with contextlib.suppress(FileExistsError):  # a new lease is there: it stands
                os.link(taken, path)
            return False
        finally:
            taken.unlink(missing_ok=True)


def storage_for(url: str) -> Storage:
    """A local path or ``file://`` URL; other schemes name the backend that is missing."""
    if not isinstance(url, str) or not url:
        raise ValueError("url: expected a local path or file:// URL")
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"url: file:// URLs name a local path, got host {parsed.netloc!r}")
        return LocalStorage(Path(parsed.path).resolve())
    if parsed.scheme == "":
        return LocalStorage(Path(url).expanduser().resolve())
    raise ValueError(
        f"url: scheme {parsed.scheme!r} has no storage backend yet (supported: local paths, file://)"
    )


# ---------------------------------------------------------------------------------- files and hashes


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, payload: Any) -> None:
    with path.open("w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")
        sync_file(f)


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    _write_json(directory / MANIFEST, manifest)


def _manifest(
    directory: Path, version: int, tensors: int, metadata: dict | None, **extra: Any
) -> dict[str, Any]:
    """The manifest of a fully written directory: every other file's sha256 and size."""
    return {
        "format": MANIFEST_FORMAT,
        "files": _file_entries(directory),
        "metadata": metadata or {},
        "tensors": tensors,
        "created_unix": time.time(),
        **extra,
        "version": version,
    }


def _file_entries(directory: Path) -> dict[str, dict[str, Any]]:
    return {
        path.name: {"sha256": _sha256(path), "bytes": path.stat().st_size}
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MANIFEST
    }


def _storable(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """CPU, contiguous, detached; tied tensors copied (safetensors refuses tensors sharing memory)."""
    seen: set[int] = set()
    out: dict[str, Tensor] = {}
    for key, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        pointer = t.untyped_storage().data_ptr()
        if t.numel() and pointer in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


class _Progress:
    """Logs a line every few seconds with rate and ETA while a long write or conversion runs."""

    def __init__(self, what: str, every_s: float = 5.0) -> None:
        self.what, self.every_s = what, every_s
        self.start = self.last = time.monotonic()

    def update(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s or done >= total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        eta = (total - done) / rate if rate > 0 else float("inf")
        log.info("%s: %d/%d tensors, %.1f tensors/s, ETA %.0f s", self.what, done, total, rate, eta)


def _write_shards(directory: Path, tensors: Mapping[str, Tensor], max_shard_bytes: int, what: str) -> None:
    """safetensors shards in the transformers layout (one file, or n files and an index)."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    progress = _Progress(what)
    done = 0
    for name, shard in zip(names, shards, strict=True):
        save_file(_storable(shard), directory / name, metadata={"format": "pt"})
        fsync_path(directory / name)
        done += len(shard)
        progress.update(done, len(tensors))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {key: name for name, shard in zip(names, shards, strict=True) for key in shard}
        _write_json(directory / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


# ------------------------------------------------------------------------------------------ loading


def _shown(value: object) -> str:
    """repr() of a manifest value for an error message, cut short (a manifest may hold anything)."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "…"


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise WeightStoreError(f"{path}: incomplete checkpoint: manifest.json is missing")
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise WeightStoreError(f"{path}: corrupt manifest: larger than {MAX_MANIFEST_BYTES >> 20} MiB")
        manifest = json.loads(raw)
    except RecursionError:
        raise WeightStoreError(f"{path}: corrupt manifest: nested too deeply") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightStoreError(f"{path}: corrupt manifest: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise WeightStoreError(f"{path}: corrupt manifest: format is not {MANIFEST_FORMAT!r}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise WeightStoreError(f"{path}: corrupt manifest: no 'files' table")
    for name, entry in files.items():
        problem = _entry_problem(name, entry)
        if problem is not None:
            raise WeightStoreError(f"{path}: corrupt manifest: files entry {_shown(name)}: {problem}")
    return manifest


def _entry_problem(name: str, entry: object) -> str | None:
    """Why a manifest's file entry is unusable, or None.

    Names must be plain file names: the manifest describes one directory, and a name with a
    separator or ``..`` would make a loader read (or report the size of) a file elsewhere.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        return "is not a plain file name in the version directory"
    if name == MANIFEST:
        return "the manifest cannot list itself"
    if not isinstance(entry, dict):
        return f"expected an object with sha256 and bytes, got {_shown(entry)}"
    size, digest = entry.get("bytes"), entry.get("sha256")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return f"bytes: expected a non-negative integer, got {_shown(size)}"
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return f"sha256: expected 64 hex digits, got {_shown(digest)}"
    return None


def verify_checkpoint_dir(directory: Path, manifest: Mapping[str, Any], verify: bool = True) -> None:
    """Every listed file exists with its size; with ``verify``, its sha256 matches too.

    A listed name that resolves outside ``directory`` (a symbolic link out of it) is refused
    before anything about its target is looked at.
    """
    root = directory.resolve()
    for name, entry in manifest["files"].items():
        path = directory / name
        if path.resolve().parent != root:
            raise WeightStoreError(f"{path}: is not a file inside {directory} (listed in {MANIFEST})")
        if not path.is_file():
            raise WeightStoreError(f"{path}: missing (listed in {MANIFEST})")
        actual_bytes = path.stat().st_size
        if actual_bytes != entry.get("bytes"):
            raise WeightStoreError(
                f"{path}: corrupt: {actual_bytes} bytes, {MANIFEST} says {entry.get('bytes')}"
            )
        if verify and _sha256(path) != entry.get("sha256"):
            raise WeightStoreError(f"{path}: corrupt: sha256 does not match {MANIFEST}")


def load_checkpoint_dir(path: str, verify: bool = True) -> tuple[dict[str, Tensor], dict]:
    """All tensors of a published (or converted) directory and its manifest, after verification.

    A delta version is rebuilt from its chain (the store root is the directory's parent) and, with
    ``verify``, checked against its manifest's ``tensors_sha256``.  Raises WeightStoreError with one
    line naming the file and the reason: manifest missing (incomplete), a listed file or a base
    missing, or a size / checksum / format mismatch (corrupt).  The tensors may be shared with this
    process's cache of the last rebuilt version: read them, do not modify them in place.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise WeightStoreError(f"{directory}: not a checkpoint directory")
    manifest = _read_manifest(directory)
    verify_checkpoint_dir(directory, manifest, verify)
    if manifest.get("kind") == DELTA:
        return _rebuild(directory, manifest, verify), manifest
    tensors = _read_shards(directory, manifest)
    if manifest.get("kind") == SNAPSHOT and _deltas_may_follow(manifest):
        _remember(directory.parent, manifest, tensors)
    return tensors, manifest


def _read_shards(directory: Path, manifest: Mapping[str, Any]) -> dict[str, Tensor]:
    """The tensors of the safetensors files a verified manifest lists."""
    tensors: dict[str, Tensor] = {}
    for name in sorted(manifest["files"]):
        if not name.endswith(".safetensors"):
            continue
        try:
            shard = load_file(directory / name)
        except (SafetensorError, OSError) as exc:
            raise WeightStoreError(f"{directory / name}: corrupt safetensors file: {exc}") from exc
        duplicated = tensors.keys() & shard.keys()
        if duplicated:
            raise WeightStoreError(
                f"{directory / name}: corrupt: tensor {sorted(duplicated)[0]!r} is in two files"
            )
        tensors.update(shard)
    if not tensors:
        raise WeightStoreError(f"{directory}: incomplete checkpoint: no safetensors file in {MANIFEST}")
    return tensors


# ----------------------------------------------------------------------------------- delta chains


@dataclass(frozen=True)
class _Rebuilt:
    root: Path
    version: int
    digest: str
    tensors: dict[str, Tensor]


_last_rebuilt: _Rebuilt | None = None
_last_rebuilt_lock = threading.Lock()


def _deltas_may_follow(manifest: Mapping[str, Any]) -> bool:
    """Whether caching a loaded snapshot can save a read: its publisher wrote deltas after snapshots."""
    every = manifest.get("snapshot_every")
    return isinstance(every, int) and every > 1 and isinstance(manifest.get("tensors_sha256"), str)


def _remember(root: Path, manifest: Mapping[str, Any], tensors: dict[str, Tensor]) -> None:
    """Keep one version in memory: the base of the next delta a follower loads (or a publisher writes)."""
    global _last_rebuilt
    digest, version = manifest.get("tensors_sha256"), manifest.get("version")
    if isinstance(digest, str) and isinstance(version, int):
        with _last_rebuilt_lock:
            _last_rebuilt = _Rebuilt(root.resolve(), version, digest, tensors)


def _recall(root: Path, version: int, digest: object) -> dict[str, Tensor] | None:
    """The cached tensors of ``version`` in the store at ``root``, if they are the ones with ``digest``."""
    with _last_rebuilt_lock:
        cached = _last_rebuilt
    if cached is None or not isinstance(digest, str):
        return None
    if (cached.root, cached.version, cached.digest) != (root.resolve(), version, digest):
        return None
    return dict(cached.tensors)


def forget_rebuilt() -> None:
    """Drop the cached version (its memory), e.g. in a process that is done loading versions."""
    global _last_rebuilt
    with _last_rebuilt_lock:
        _last_rebuilt = None


def _base_of(directory: Path, manifest: Mapping[str, Any]) -> tuple[int, Path]:
    base, version = manifest.get("base"), manifest.get("version")
    if (
        isinstance(base, bool)
        or not isinstance(base, int)
        or not isinstance(version, int)
        or not 0 <= base < version
    ):
        raise WeightStoreError(
            f"{directory / MANIFEST}: corrupt manifest: a delta needs a 'base' version below its own"
        )
    return base, directory.parent / version_dir_name(base)


def _delta_links(
    directory: Path, manifest: dict[str, Any], verify: bool, use_cache: bool
) -> tuple[list[tuple[Path, dict[str, Any]]], dict[str, Tensor]]:
    """The deltas to apply (oldest first) and the tensors they start from: the last snapshot's, or
    a cached version's when the chain reaches it first."""
    links = [(directory, manifest)]
    while len(links) <= MAX_VERSION:
        current_dir, current = links[-1]
        base, base_dir = _base_of(current_dir, current)
        expected = current.get("base_tensors_sha256")
        cached = _recall(directory.parent, base, expected) if use_cache else None
        if cached is not None:
            return links[::-1], cached
        if not (base_dir / MANIFEST).is_file():
            raise WeightStoreError(
                f"{base_dir}: missing: the base of delta version {current.get('version')} ({current_dir.name})"
            )
        base_manifest = _read_manifest(base_dir)
        verify_checkpoint_dir(base_dir, base_manifest, verify)
        digest = base_manifest.get("tensors_sha256")
        if isinstance(digest, str) and digest != expected:
            raise WeightStoreError(
                f"{base_dir / MANIFEST}: replaced: its tensors_sha256 is not the base that "
                f"{current_dir.name} was written against"
            )
        if base_manifest.get("kind") != DELTA:
            return links[::-1], _read_shards(base_dir, base_manifest)
        links.append((base_dir, base_manifest))
    raise WeightStoreError(f"{directory}: corrupt: its chain of deltas does not end")


def _apply_delta_file(
    directory: Path, manifest: Mapping[str, Any], base: dict[str, Tensor]
) -> dict[str, Tensor]:
    path = directory / DELTA_FILE
    if DELTA_FILE not in manifest["files"]:
        raise WeightStoreError(f"{directory / MANIFEST}: incomplete checkpoint: a delta without {DELTA_FILE}")
    try:
        return apply_delta(base, path.read_bytes())
    except DeltaError as exc:
        raise WeightStoreError(f"{path}: corrupt delta: {exc}") from None
    except OSError as exc:
        raise WeightStoreError(f"{path}: unreadable: {exc.strerror}") from None


def _rebuild(
    directory: Path, manifest: dict[str, Any], verify: bool, use_cache: bool = True
) -> dict[str, Tensor]:
    """A delta version's tensors: its chain applied to the last snapshot (or the cached version).

    With ``verify`` the result must equal the manifest's ``tensors_sha256``; a mismatch after
    starting from the cache (which a caller could have modified in place) is retried from disk.
    """
    links, tensors = _delta_links(directory, manifest, verify, use_cache)
    for link_dir, link_manifest in links:
        tensors = _apply_delta_file(link_dir, link_manifest, tensors)
    if verify and tensors_sha256(tensors) != manifest.get("tensors_sha256"):
        if use_cache:
            return _rebuild(directory, manifest, verify, use_cache=False)
        raise WeightStoreError(
            f"{directory / MANIFEST}: corrupt: the tensors rebuilt from {len(links)} delta(s) do not "
            "match its tensors_sha256"
        )
    _remember(directory.parent, manifest, tensors)
    return tensors


def load_dequantized(path: str, verify: bool = True) -> dict[str, Tensor]:
    """A converted directory's tensors dequantized to a BF16 serving-layout state dict (a plain
    version directory is returned as stored)."""
    tensors, manifest = load_checkpoint_dir(path, verify)
    note = manifest.get("quantization")
    return checkpoint_formats.dequantize_checkpoint(tensors, note) if note else tensors


# -------------------------------------------------------------------------------------------- store


def _check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version: expected an integer in [0, {MAX_VERSION}], got {_shown(version)}")
    return version


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
"""The files of a Hugging Face tokenizer that a checkpoint directory may hold."""


def tokenizer_files(directory: str | Path | None) -> dict[str, Path]:
    """The Hugging Face tokenizer files in ``directory`` (none for a ``tiny:`` model, a missing
    directory or one without a tokenizer): what each published version carries beside its weights."""
    if directory is None or str(directory).startswith("tiny:"):
        return {}
    root = Path(str(directory).removeprefix("file://"))
    return {name: root / name for name in TOKENIZER_FILES if (root / name).is_file()}


@dataclass
class _DeltaBase:
    """What a delta is written against: the version published before and its tensors."""

    version: int
    digest: str
    depth: int
    tensors: dict[str, Tensor]


class WeightStore:
    """Versioned checkpoints under ``url`` (see the module docstring for the layout).

    ``snapshot_every``: every how many versions `publish` writes a full snapshot (1: all of them,
    the default; the trainer passes ``weights.snapshotEvery``).  ``lease_timeout_s``: how old a
    conversion lease's heartbeat may be before another converter takes it over.
    """

    def __init__(
        self,
        url: str,
        storage: Storage | None = None,
        *,
        snapshot_every: int = 1,
        lease_timeout_s: float = LEASE_TIMEOUT_S,
    ) -> None:
        if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 1:
            raise ValueError(f"snapshot_every: expected an integer ≥ 1, got {_shown(snapshot_every)}")
        if not lease_timeout_s > 0:
            raise ValueError(
                f"lease_timeout_s: expected a positive number of seconds, got {lease_timeout_s!r}"
            )
        self.url = url
        self.storage = storage if storage is not None else storage_for(url)
        self.snapshot_every = snapshot_every
        self.lease_timeout_s = float(lease_timeout_s)

    def path(self, version: int) -> str:
        return str(self.storage.local_dir(version_dir_name(_check_version(version))))

    def versions(self) -> list[int]:
        """Complete versions, oldest first (directories without a manifest are not versions)."""
        found = (_VERSION_DIR.match(name) for name in self.storage.list_top())
        return sorted(int(m.group(1)) for m in found if m and self.storage.exists(m.group(0)))

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def manifest(self, version: int) -> dict[str, Any]:
        """The manifest of a published version (WeightStoreError when missing or corrupt)."""
        return _read_manifest(Path(self.path(version)))

    # ------------------------------------------------------------------------------- publish

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, Tensor],
        metadata: dict | None = None,
        config: Mapping[str, Any] | None = None,
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        files: Mapping[str, Path] | None = None,
        snapshot: bool = False,
    ) -> str:
        """Write ``state_dict`` (stored as given) as ``version``; visible only once complete.

        ``config`` (a transformers config dict) is stored as config.json, which makes the directory
        loadable with ``AutoModelForCausalLM.from_pretrained`` (a snapshot's, not a delta's).
        ``metadata`` (JSON) goes into the manifest. ``files`` (name -> source, e.g.
        :func:`tokenizer_files`) are copied in beside the weights and listed in the manifest like
        them, so ``AutoTokenizer.from_pretrained`` loads the version too.  The version is a delta on
        the newest older version unless ``snapshot``, ``snapshot_every`` or a pending snapshot
        request says to write it whole.
        """
        name = version_dir_name(_check_version(version))
        if not isinstance(state_dict, Mapping) or not state_dict:
            raise ValueError("state_dict: expected a non-empty mapping of names to tensors")
        for key, tensor in state_dict.items():
            if not isinstance(key, str) or not isinstance(tensor, Tensor):
                raise ValueError(f"state_dict: entry {key!r} is not a str -> torch.Tensor pair")
        if config is not None and not isinstance(config, Mapping):
            raise ValueError("config: expected a dict (for example model.config.to_dict())")
        for filename in files or {}:
            if (
                Path(filename).name != filename
                or filename in (MANIFEST, "config.json", DELTA_FILE)
                or (filename.endswith(".safetensors"))
            ):
                raise ValueError(f"files: {filename!r} is not a plain file name beside the weights")
        if self.storage.exists(name):
            raise WeightStoreError(f"{self.path(version)}: version {version} already exists")
        self._remove_leftovers([name])
        tensors = _storable(state_dict)
        deltas = self.snapshot_every > 1
        base = None if snapshot or not deltas else self._delta_base(version)
        extra: dict[str, Any] = {
            "kind": SNAPSHOT if base is None else DELTA,
            "snapshot_every": self.snapshot_every,
            "serving_bf16": checkpoint_formats.is_serving_bf16(tensors),
        }
        if deltas:
            extra["tensors_sha256"] = tensors_sha256(tensors)
        with self.storage.staging(name) as tmp:
            if base is None:
                _write_shards(tmp, tensors, max_shard_bytes, f"publish v{version}")
                extra["depth"] = 0
            else:
                extra |= self._write_delta(tmp, base, tensors, version)
            if config is not None:
                _write_json(tmp / "config.json", dict(config))
            for filename, source in (files or {}).items():
                shutil.copyfile(source, tmp / filename)
            _write_manifest(tmp, _manifest(tmp, version, len(tensors), metadata, **extra))
        if base is None and self.storage.read_flag(SNAPSHOT_REQUEST) is not None:
            self.storage.remove_flag(SNAPSHOT_REQUEST)  # honoured: this version is whole
        if deltas:  # the next version's base, without reading it back
            _remember(self.storage.local_dir(name).parent, extra | {"version": version}, _copied(tensors))
        log.info(
            "published weight version %d (%d tensors, %s) at %s",
            version,
            len(tensors),
            "snapshot" if base is None else f"delta on {base.version}",
            self.path(version),
        )
        return self.path(version)

    def _delta_base(self, version: int) -> _DeltaBase | None:
        """The base to write ``version`` against, or None when it must be a snapshot (and why, logged)."""
        request = self.storage.read_flag(SNAPSHOT_REQUEST)
        if request is not None:
            log.info("publishing version %d as a snapshot: requested (%s)", version, request.strip()[:200])
            return None
        older = [v for v in self.versions() if v < version]
        if not older:
            return None
        base_version = older[-1]
        try:
            manifest = self.manifest(base_version)
            depth = manifest.get("depth", 0) if manifest.get("kind") == DELTA else 0
            if not isinstance(depth, int) or depth + 1 >= self.snapshot_every:
                return None
            digest = manifest.get("tensors_sha256")
            root = self.storage.local_dir(version_dir_name(base_version)).parent
            tensors = _recall(root, base_version, digest)
            if tensors is None:
                tensors = self.load(base_version)
                digest = digest if isinstance(digest, str) else tensors_sha256(tensors)
        except WeightStoreError as exc:
            log.warning("publishing version %d as a snapshot: its base cannot be loaded: %s", version, exc)
            return None
        return _DeltaBase(base_version, digest, depth, tensors)  # type: ignore[arg-type]

    @staticmethod
    def _write_delta(
        directory: Path, base: _DeltaBase, tensors: dict[str, Tensor], version: int
    ) -> dict[str, Any]:
        """Write ``model.delta`` (``tensors`` against ``base``); the manifest fields of a delta."""
        blob, stats = encode_delta(base.tensors, tensors)
        path = directory / DELTA_FILE
        with path.open("wb") as f:
            f.write(blob)
            sync_file(f)
        log.info(
            "v%d as a delta on v%d: %d tensors changed, %d unchanged, %d whole, %d removed; "
            "%d bytes, %.1f%% of a full copy",
            version,
            base.version,
            stats.changed,
            stats.unchanged,
            stats.whole,
            stats.removed,
            stats.delta_bytes,
            100.0 * stats.delta_bytes / max(stats.raw_bytes, 1),
        )
        return {"base": base.version, "base_tensors_sha256": base.digest, "depth": base.depth + 1}

    def request_snapshot(self, reason: str) -> None:
        """Ask the publisher to write its next version whole (a loader found a broken chain)."""
        self.storage.write_flag(SNAPSHOT_REQUEST, reason.replace("\n", " ")[:1000] + "\n")

    def snapshot_requested(self) -> str | None:
        """The reason of a pending snapshot request, or None."""
        return self.storage.read_flag(SNAPSHOT_REQUEST)

    # ---------------------------------------------------------------------------------- load

    def load(self, version: int, verify: bool = True) -> dict[str, Tensor]:
        path = self.path(version)
        if not Path(path).exists():
            raise WeightStoreError(f"{path}: version {version} does not exist (have {self.versions()})")
        return load_checkpoint_dir(path, verify)[0]

    def chain(self, version: int) -> list[int]:
        """The versions ``version`` is rebuilt from, its last snapshot first and itself last.

        Reads only manifests; WeightStoreError when one is missing or corrupt."""
        chain = [_check_version(version)]
        manifest = self.manifest(version)
        while manifest.get("kind") == DELTA:
            base, base_dir = _base_of(Path(self.path(chain[-1])), manifest)
            if not (base_dir / MANIFEST).is_file():
                raise WeightStoreError(f"{base_dir}: missing: the base of delta version {chain[-1]}")
            chain.append(base)
            manifest = self.manifest(base)
        return chain[::-1]

    def chain_problem(self, version: int, verify_snapshot: bool = True) -> str | None:
        """Why ``version`` cannot be rebuilt from the files in the store (one line), or None.

        Checks every link's manifest and files: the deltas' checksums always (they are small), the
        snapshot's only with ``verify_snapshot`` (a whole model to hash), and that every base is
        the one its delta was written against.  Decodes nothing.
        """
        try:
            chain = self.chain(version)
            previous_digest: object = None
            for link in chain:
                directory = Path(self.path(link))
                manifest = _read_manifest(directory)
                is_delta = manifest.get("kind") == DELTA
                verify_checkpoint_dir(directory, manifest, verify=is_delta or verify_snapshot)
                if is_delta and DELTA_FILE not in manifest["files"]:
                    raise WeightStoreError(f"{directory / MANIFEST}: incomplete checkpoint: no {DELTA_FILE}")
                if (
                    is_delta
                    and isinstance(previous_digest, str)
                    and previous_digest != manifest.get("base_tensors_sha256")
                ):
                    raise WeightStoreError(f"{directory / MANIFEST}: its base was replaced")
                previous_digest = manifest.get("tensors_sha256")
        except WeightStoreError as exc:
            return str(exc)
        return None

    def newest_loadable(self, below: int | None = None, verify_snapshot: bool = True) -> int | None:
        """The newest version (below ``below``) whose chain is whole: where a loader falls back to.
        ``verify_snapshot`` as in `chain_problem` (False: the snapshots' files are not hashed)."""
        for version in reversed(self.versions()):
            if (below is None or version < below) and self.chain_problem(version, verify_snapshot) is None:
                return version
        return None

    # ------------------------------------------------------------------------------- convert

    def convert(self, version: int, precision: str) -> str:
        """The checkpoint of ``version`` at a pool's precision, in the layout SGLang loads.

        Idempotent (an existing conversion is returned as is) and atomic like `publish`.  One caller
        per (version, precision) converts, holding a lease; the others wait for its result.  A
        snapshot already in the serving BF16 layout is its own ``bf16`` checkpoint; a delta version
        is materialised as ``vN/bf16`` (SGLang loads a directory).

        A conversion records the sha256 of the manifest it was made from: one that does not match
        the version's manifest now (made before the version was removed and published again) is
        stale, and is discarded and redone, never served.  A conversion whose version is removed or
        republished while it runs is refused (WeightStoreError, one line) rather than written.
        """
        if precision not in quant.WEIGHT_FORMATS:
            raise ValueError(
                f"precision: unknown {precision!r}; expected one of {', '.join(quant.WEIGHT_FORMATS)}"
            )
        source_name = version_dir_name(_check_version(version))
        name = f"{source_name}/{precision}"
        if precision == "bf16" and self._serves_bf16_as_is(version):
            return self.path(version)
        lease = f"convert-{source_name}-{precision}.lease"
        holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        waited_since = time.monotonic()
        while not self._converted(version, name):
            if self.storage.create_flag(lease, holder):
                with _heartbeat(self.storage, lease, holder, self.lease_timeout_s / 4):
                    if not self._converted(version, name):
                        self._discard_stale(version, name)
                        self._convert(version, precision, name)
                break
            self._wait_for_conversion(version, name, lease, waited_since)
        return str(self.storage.local_dir(name))

    def manifest_sha256(self, version: int) -> str | None:
        """The sha256 of ``version``'s manifest, or None without one: what tells a version apart
        from another of the same number published after it was removed (a resumed trainer redoing
        a step), as its conversions record and the weight-sync sidecar checks."""
        try:
            return _sha256(self.storage.local_dir(version_dir_name(version)) / MANIFEST)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _converted(self, version: int, name: str) -> bool:
        """Whether the conversion ``name`` exists and was made from ``version`` as it is now (its
        recorded source manifest is the version's manifest): not a stale one of a removed version."""
        if not self.storage.exists(name):
            return False
        source = self.manifest_sha256(version)
        try:
            recorded = _read_manifest(self.storage.local_dir(name)).get("source_manifest_sha256")
        except WeightStoreError:
            return False
        return source is not None and recorded == source

    def _discard_stale(self, version: int, name: str) -> None:
        """Move an existing conversion of ``version`` that is not made from its manifest as it is
        now to the trash.

        Judged again here rather than trusted from the caller's `_converted`: another converter
        (one that took over a lease this one then also held) may have committed a valid conversion
        since, and that one must stay.  Removed only while the version's manifest is there and the
        conversion records another (or none: it cannot be shown to be this version's)."""
        if not self.storage.exists(name):
            return
        source = self.manifest_sha256(version)
        try:
            recorded = _read_manifest(self.storage.local_dir(name)).get("source_manifest_sha256")
        except WeightStoreError:
            recorded = None  # unreadable: it cannot be served either
        if source is None or recorded == source:
            return  # the version is gone (its conversions with it), or the conversion is current
        log.warning("%s: not made from the version's manifest as it is now (stale); discarded", name)
        with contextlib.suppress(FileNotFoundError):
            self.storage.remove(name)

    def _serves_bf16_as_is(self, version: int) -> bool:
        """Whether the version directory itself is the ``bf16`` checkpoint (a serving-layout BF16
        snapshot): from the manifest, or for a manifest from before it said so, from the tensors."""
        manifest = self.manifest(version)
        if manifest.get("kind") == DELTA:
            return False
        said = manifest.get("serving_bf16")
        if isinstance(said, bool):
            return said
        return checkpoint_formats.is_serving_bf16(load_checkpoint_dir(self.path(version))[0])

    def _wait_for_conversion(self, version: int, name: str, lease: str, since: float) -> None:
        """Wait (a progress line every WAIT_LOG_S) until ``name`` appears or ``lease`` is released
        or stale; a stale lease (its holder died) is removed so the next try can take it."""
        last_log = time.monotonic()
        while not self._converted(version, name):
            holder, age = self.storage.read_flag(lease), self.storage.flag_age_s(lease)
            if age is None:
                return  # released: the holder finished (or failed); look again
            dead = _holder_gone(holder)
            if holder is not None and (dead or age > self.lease_timeout_s):
                # Atomically, and only the lease judged: of several waiters that judged it dead,
                # one removes it; the others must not remove the lease the first creates next.
                if self.storage.take_over_flag(lease, holder, 0.0 if dead else self.lease_timeout_s):
                    log.warning(
                        "conversion %s: lease of %s %s; taking over",
                        name,
                        holder.strip(),
                        "whose process is gone" if dead else f"is {age:.0f} s without a heartbeat",
                    )
                return  # look again: the lease is gone, another waiter's, or was alive after all
            now = time.monotonic()
            if now - last_log >= WAIT_LOG_S:
                log.info(
                    "waiting for %s to convert %s (%.0f s so far)", (holder or "?").strip(), name, now - since
                )
                last_log = now
            time.sleep(LEASE_POLL_S)

    def _convert(self, version: int, precision: str, name: str) -> None:
        """The conversion itself (the lease holder only): load (rebuilding a delta), convert, write."""
        log.info("converting weight version %d to %s (holding the lease)", version, precision)
        # Taken before loading, checked again at the rename: a version removed or republished in
        # between (a resumed trainer, prune) is refused there rather than served from older files.
        source_sha256 = self.manifest_sha256(version)
        tensors, manifest = load_checkpoint_dir(self.path(version))
        if source_sha256 is None:  # no manifest when this began, yet it loaded: republished meanwhile
            raise WeightStoreError(
                f"{self.path(version)}: version {version} was replaced while the conversion began; retry"
            )
        source_dir = self.storage.local_dir(version_dir_name(version))
        config_path = source_dir / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else None
        input_amax, calibration = self._calibrate(version, precision, tensors, config)
        progress = _Progress(f"convert v{version} to {precision}")
        converted = checkpoint_formats.convert_state_dict(
            tensors, precision, progress.update, input_amax, calibration
        )
        try:
            with self.storage.staging(name, parent_manifest_sha256=source_sha256) as tmp:
                what = f"write v{version}/{precision}"
                _write_shards(tmp, converted.tensors, DEFAULT_MAX_SHARD_BYTES, what)
                for filename, payload in checkpoint_formats.config_files(converted, config).items():
                    _write_json(tmp / filename, payload)
                extra = {"quantization": converted.note(), "source_manifest_sha256": source_sha256}
                tensor_count = len(converted.tensors)
                _write_manifest(tmp, _manifest(tmp, version, tensor_count, manifest.get("metadata"), **extra))
        except WeightStoreError:
            # Another converter that took over a stale lease may have finished first: fine when
            # its conversion is of the version as it is now.
            if not self._converted(version, name):
                raise
        log.info("converted weight version %d to %s", version, precision)

    @staticmethod
    def _calibrate(
        version: int, precision: str, tensors: dict[str, Tensor], config: dict[str, Any] | None
    ) -> tuple[dict[str, Tensor], str]:
        """The checkpoint's calibrated GEMM-input maxima where its precision has a calibrated scale
        (nvfp4) and the model can run here (a config.json, at most
        CHECKPOINT_CALIBRATION_MAX_PARAMS); else none, said in the log and the manifest."""
        if precision != "nvfp4":  # the other formats' activation scales are dynamic
            return {}, ""
        params = sum(t.numel() for t in tensors.values())
        if config is None or params > activation_quant.CHECKPOINT_CALIBRATION_MAX_PARAMS:
            why = "no config.json" if config is None else f"{params / 1e9:.1f} B parameters"
            log.warning("v%d/%s: input scales left uncalibrated (%s)", version, precision, why)
            return {}, ""
        started = time.monotonic()
        amax = activation_quant.calibrate_checkpoint(config, tensors, precision)
        log.info("v%d/%s: input scales calibrated in %.1f s", version, precision, time.monotonic() - started)
        rows, tokens = activation_quant.CALIBRATION_ROWS, activation_quant.CALIBRATION_TOKENS
        return amax, f"max |x| over {rows}×{tokens} seeded token ids, as the torch engine calibrates"

    # ---------------------------------------------------------------------------- remove, prune

    def remove(self, version: int) -> None:
        """Remove one version (and its converted checkpoints), e.g. one a resumed trainer will redo.

        A delta written on it is left unloadable (refused with one line): remove those too."""
        self.storage.remove(version_dir_name(_check_version(version)))

    def prune(self, keep: int, protect: Collection[int] = ()) -> list[int]:
        """Remove all but the newest ``keep`` versions and those in ``protect`` (and stale staging
        leftovers); returns the removed.  A version a kept version's chain needs stays (its
        conversions go: nobody serves it)."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep: expected an integer ≥ 1, got {keep!r}")
        versions = self.versions()
        kept = set(versions[-keep:]) | (set(protect) & set(versions))
        needed = {link for version in kept for link in self._chain_present(version)}
        doomed = [v for v in versions[:-keep] if v not in protect and v not in needed]
        for version in doomed:
            self.remove(version)
        for version in sorted(needed - kept):
            self._remove_conversions(version)
        self._remove_leftovers(self.storage.list_top())
        self.storage.remove_stale_staging(STALE_STAGING_S)
        return doomed

    def _remove_leftovers(self, names: Collection[str]) -> None:
        """Move the version directories among ``names`` that have no manifest to the trash.

        No writer of this store leaves one (a version appears whole, with its manifest, in one
        rename; a conversion is refused a version that is gone), but a conversion by an older mixrl
        that finished after its version was removed left ``vN/`` holding only ``<precision>/``: not
        a version, so nothing else removes it, and in the way of publishing version N again."""
        present = set(self.storage.list_top())
        for name in names:
            if _VERSION_DIR.match(name) and name in present and not self.storage.exists(name):
                log.warning("%s: a version directory without a manifest (a leftover); removed", name)
                with contextlib.suppress(FileNotFoundError):
                    self.storage.remove(name)

    def _chain_present(self, version: int) -> list[int]:
        """The links of ``version``'s chain that exist (a broken chain keeps what is left of it)."""
        links = [version]
        with contextlib.suppress(WeightStoreError):
            manifest = self.manifest(version)
            while manifest.get("kind") == DELTA:
                base, _ = _base_of(Path(self.path(links[-1])), manifest)
                manifest = self.manifest(base)
                links.append(base)
        return links

    def _remove_conversions(self, version: int) -> None:
        source = version_dir_name(version)
        for precision in quant.WEIGHT_FORMATS:
            if self.storage.exists(f"{source}/{precision}"):
                self.storage.remove(f"{source}/{precision}")


def _copied(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Private copies: a publisher's tensors may be its live parameters, changed by the next step."""
    return {name: tensor.clone() for name, tensor in tensors.items()}


def _holder_gone(holder: str | None) -> bool:
    """Whether a lease's holder (``host:pid:token``) is a process of this host that no longer
    exists: then it died, and nobody need wait out the heartbeat timeout.  A holder elsewhere (or
    unreadable) is judged by its heartbeat alone."""
    host, _, rest = (holder or "").strip().partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, as another user
    return False


@contextlib.contextmanager
def _heartbeat(storage: Storage, lease: str, holder: str, every_s: float) -> Iterator[None]:
    """Hold ``lease`` while the body runs: refresh its mtime every ``every_s``, release it after
    (only if it is still ours: a waiter may have taken it over from a holder it thought dead)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            with contextlib.suppress(OSError):
                storage.touch_flag(lease)

    thread = threading.Thread(target=beat, name=f"lease {lease}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if storage.read_flag(lease) == holder:
            storage.remove_flag(lease)
