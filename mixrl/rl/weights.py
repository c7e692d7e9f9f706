"""The weight store: versioned safetensors checkpoints, published atomically, verified on load.

Layout under the store's root (a local path or ``file://`` URL; object stores plug in as another
`Storage`)::

    v00000003/                  one published version (the trainer's tensors, as given)
      model.safetensors           or model-0000i-of-0000n.safetensors + model.safetensors.index.json
      config.json                 when the publisher passed a transformers config
      manifest.json               written last: sha256 and size of every file, version, metadata
      nvfp4/                      a per-precision conversion, in the layout SGLang loads
        model.safetensors, config.json (+ hf_quant_config.json), manifest.json

A version is visible only when complete: it is written into a private staging directory, every file
is fsynced, the manifest goes in last, and one rename publishes it. Loaders verify the manifest and
refuse a version that lacks one (incomplete) or whose files do not match it (corrupt).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from mixrl.rl import checkpoint_formats, quant
from mixrl.rl.durable import fsync_path

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


class WeightStoreError(Exception):
    """A version is missing, incomplete or corrupt, or a store operation cannot proceed."""


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


# ------------------------------------------------------------------------------------------ storage


class Storage(Protocol):
    """Where entries (version directories, conversions) live.

    An entry is visible only once `staging` has committed it. An object-store backend would stage in
    a local temporary directory, upload every file, upload the manifest last, and list only prefixes
    whose manifest exists; `local_dir` would download (and cache) an entry for loaders.
    """

    def exists(self, name: str) -> bool: ...
    def list_top(self) -> list[str]: ...
    def local_dir(self, name: str) -> Path: ...
    def staging(self, name: str) -> contextlib.AbstractContextManager[Path]: ...
    def remove(self, name: str) -> None: ...
    def remove_stale_staging(self, older_than_s: float) -> int: ...


class LocalStorage:
    """A directory on a local or shared POSIX filesystem (PVC, NFS): atomic rename publishes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._staging_root = self.root / ".staging"
        self._trash_root = self.root / ".trash"

    def exists(self, name: str) -> bool:
        return (self.root / name / MANIFEST).is_file()

    def list_top(self) -> list[str]:
        return sorted(entry.name for entry in self.root.iterdir() if entry.is_dir())

    def local_dir(self, name: str) -> Path:
        return self.root / name

    @contextlib.contextmanager
    def staging(self, name: str) -> Iterator[Path]:
        self._staging_root.mkdir(exist_ok=True)
        tmp = self._staging_root / f"{name.replace('/', '__')}.{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            yield tmp
            fsync_path(tmp)
            self._promote(tmp, self.root / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _promote(self, tmp: Path, final: Path) -> None:
        """One rename makes the entry visible; a rename onto an existing entry fails."""
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            raise WeightStoreError(f"{final}: already exists; published entries are immutable")
        try:
            os.rename(tmp, final)
        except OSError as exc:
            raise WeightStoreError(f"{final}: cannot publish: {exc.strerror}") from exc
        fsync_path(final.parent)

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
                if entry.stat().st_mtime < cutoff:
                    shutil.rmtree(entry, ignore_errors=True)
                    removed += 1
        return removed


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
        f.flush()
        os.fsync(f.fileno())


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

    Raises WeightStoreError with one line naming the file and the reason: manifest missing
    (incomplete), a listed file missing, or a size / checksum / format mismatch (corrupt).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise WeightStoreError(f"{directory}: not a checkpoint directory")
    manifest = _read_manifest(directory)
    verify_checkpoint_dir(directory, manifest, verify)
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
    return tensors, manifest


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


class WeightStore:
    """Versioned checkpoints under ``url`` (see the module docstring for the layout)."""

    def __init__(self, url: str, storage: Storage | None = None) -> None:
        self.url = url
        self.storage = storage if storage is not None else storage_for(url)

    def path(self, version: int) -> str:
        return str(self.storage.local_dir(version_dir_name(_check_version(version))))

    def versions(self) -> list[int]:
        """Complete versions, oldest first (directories without a manifest are not versions)."""
        found = (_VERSION_DIR.match(name) for name in self.storage.list_top())
        return sorted(int(m.group(1)) for m in found if m and self.storage.exists(m.group(0)))

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, Tensor],
        metadata: dict | None = None,
        config: Mapping[str, Any] | None = None,
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        files: Mapping[str, Path] | None = None,
    ) -> str:
        """Write ``state_dict`` (stored as given) as ``version``; visible only once complete.

        ``config`` (a transformers config dict) is stored as config.json, which makes the directory
        loadable with ``AutoModelForCausalLM.from_pretrained``. ``metadata`` (JSON) goes into the manifest.
        ``files`` (name -> source, e.g. :func:`tokenizer_files`) are copied in beside the weights and
        listed in the manifest like them, so ``AutoTokenizer.from_pretrained`` loads the version too.
        """
        name = version_dir_name(_check_version(version))
        if not isinstance(state_dict, Mapping) or not state_dict:
            raise ValueError("state_dict: expected a non-empty mapping of names to tensors")
        for key, tensor in state_dict.items():
            if not isinstance(key, str) or not isinstance(tensor, Tensor):
                raise ValueError(f"state_dict: entry {key!r} is not a str -> torch.Tensor pair")
        if config is not None and not isinstance(config, Mapping):
            raise ValueError("config: expected a dict (for example model.config.to_dict())")
        if self.storage.exists(name):
            raise WeightStoreError(f"{self.path(version)}: version {version} already exists")
        with self.storage.staging(name) as tmp:
            _write_shards(tmp, state_dict, max_shard_bytes, f"publish v{version}")
            if config is not None:
                _write_json(tmp / "config.json", dict(config))
            for name, source in (files or {}).items():
                if (
                    Path(name).name != name
                    or name in (MANIFEST, "config.json")
                    or name.endswith(".safetensors")
                ):
                    raise ValueError(f"files: {name!r} is not a plain file name beside the weights")
                shutil.copyfile(source, tmp / name)
            _write_manifest(tmp, _manifest(tmp, version, len(state_dict), metadata))
        log.info(
            "published weight version %d (%d tensors) at %s", version, len(state_dict), self.path(version)
        )
        return self.path(version)

    def load(self, version: int, verify: bool = True) -> dict[str, Tensor]:
        path = self.path(version)
        if not Path(path).exists():
            raise WeightStoreError(f"{path}: version {version} does not exist (have {self.versions()})")
        return load_checkpoint_dir(path, verify)[0]

    def convert(self, version: int, precision: str) -> str:
        """The checkpoint of ``version`` at a pool's precision, in the layout SGLang loads.

        Idempotent (an existing conversion is returned as is) and atomic like `publish`.
        """
        if precision not in quant.WEIGHT_FORMATS:
            raise ValueError(
                f"precision: unknown {precision!r}; expected one of {', '.join(quant.WEIGHT_FORMATS)}"
            )
        source_name = version_dir_name(_check_version(version))
        name = f"{source_name}/{precision}"
        if self.storage.exists(name):
            return str(self.storage.local_dir(name))
        tensors, manifest = load_checkpoint_dir(self.path(version))
        if precision == "bf16" and checkpoint_formats.is_serving_bf16(tensors):
            return self.path(version)
        source_dir = self.storage.local_dir(source_name)
        config_path = source_dir / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else None
        progress = _Progress(f"convert v{version} to {precision}")
        converted = checkpoint_formats.convert_state_dict(tensors, precision, progress.update)
        source_sha256 = _sha256(source_dir / MANIFEST)
        try:
            with self.storage.staging(name) as tmp:
                what = f"write v{version}/{precision}"
                _write_shards(tmp, converted.tensors, DEFAULT_MAX_SHARD_BYTES, what)
                for filename, payload in checkpoint_formats.config_files(converted, config).items():
                    _write_json(tmp / filename, payload)
                extra = {"quantization": converted.note(), "source_manifest_sha256": source_sha256}
                tensor_count = len(converted.tensors)
                _write_manifest(tmp, _manifest(tmp, version, tensor_count, manifest.get("metadata"), **extra))
        except WeightStoreError:
            if not self.storage.exists(name):  # another converter finishing first is not an error
                raise
        log.info("converted weight version %d to %s", version, precision)
        return str(self.storage.local_dir(name))

    def remove(self, version: int) -> None:
        """Remove one version (and its converted checkpoints), e.g. one a resumed trainer will redo."""
        self.storage.remove(version_dir_name(_check_version(version)))

    def prune(self, keep: int, protect: Collection[int] = ()) -> list[int]:
        """Remove all but the newest ``keep`` versions and those in ``protect`` (and stale staging
        leftovers); returns the removed."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep: expected an integer ≥ 1, got {keep!r}")
        doomed = [v for v in self.versions()[:-keep] if v not in protect]
        for version in doomed:
            self.remove(version)
        self.storage.remove_stale_staging(STALE_STAGING_S)
        return doomed
