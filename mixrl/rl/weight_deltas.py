"""The delta codec of the weight store: one version as the change from its predecessor.

Pure (no store, no manifests): :func:`encode_delta` turns two state dicts into the bytes of one
``model.delta`` file, :func:`apply_delta` turns a base state dict and those bytes back into the
new state dict, and :func:`tensors_sha256` is the digest a loader checks the rebuilt result by.

Why XOR and zlib: consecutive RL versions published in BF16 differ in few words.  An RL-sized
learning rate (1e-6) moves an FP32 master weight by far less than one BF16 step (2^-8 of its
value), so most BF16 words round to the same bits as before.  The XOR of two versions' words is
then mostly zero bytes, which zlib at level 1 (fast) compresses to almost nothing; the words that
did change keep their sign and exponent, so even their XOR is mostly zero high bytes.

Per tensor the file holds one of:

- ``xor``: same name, dtype and shape as in the base, some bytes changed: zlib(base XOR new);
- ``whole``: new, or its dtype or shape changed: its raw bytes;
- nothing: unchanged (the base's tensor is kept as it is);

and the names of tensors the base had and the new version has not (``removed``).

Layout of ``model.delta``: the magic line, an 8-byte little-endian header length, the JSON header
(``{"tensors": {name: {"dtype", "shape", "encoding", "offset", "bytes"}}, "removed": [...]}``,
offsets relative to the end of the header), then the payloads.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

MAGIC = b"MIXRL-DELTA/1\n"
ZLIB_LEVEL = 1
"""Fast: a delta is mostly zero bytes, which level 1 already compresses to almost nothing."""
MAX_HEADER_BYTES = 64 << 20
_LENGTH = struct.Struct("<Q")
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}
"""The dtypes a delta may hold (names as torch prints them, without ``torch.``)."""


class DeltaError(ValueError):
    """A delta file that cannot be read or does not fit its base (the message says which tensor)."""


@dataclass
class DeltaStats:
    """What one encoding did, for the publisher's log line and the tests."""

    changed: int = 0
    unchanged: int = 0
    whole: int = 0
    removed: int = 0
    raw_bytes: int = 0
    """Bytes of the new state dict (a full copy's tensor data)."""
    delta_bytes: int = 0
    """Bytes of the encoded delta file."""


def _dtype_name(tensor: Tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise DeltaError(f"tensor dtype {name} cannot be stored in a delta")
    return name


def raw_bytes(tensor: Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (no copy for a contiguous CPU tensor)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def tensors_sha256(tensors: Mapping[str, Tensor]) -> str:
    """sha256 over the sorted names, dtypes, shapes and raw bytes: what a rebuilt version must equal.

    Independent of files and shards, so a snapshot and a delta of the same weights have one digest.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        header = json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode()
        digest.update(_LENGTH.pack(len(header)) + header)
        digest.update(raw_bytes(tensor).data)
    return digest.hexdigest()


def _same_layout(base: Tensor, new: Tensor) -> bool:
    return base.dtype == new.dtype and tuple(base.shape) == tuple(new.shape)


def encode_delta(base: Mapping[str, Tensor], new: Mapping[str, Tensor]) -> tuple[bytes, DeltaStats]:
    """The bytes of the ``model.delta`` file that turns ``base`` into ``new``, and what it holds."""
    stats = DeltaStats()
    entries: dict[str, dict[str, Any]] = {}
    payloads: list[bytes | memoryview] = []
    offset = 0
    for name, tensor in new.items():
        data = raw_bytes(tensor)
        stats.raw_bytes += data.nbytes
        previous = base.get(name)
        if previous is not None and _same_layout(previous, tensor):
            xor = np.bitwise_xor(raw_bytes(previous), data)
            if not xor.any():
                stats.unchanged += 1
                continue
            payload: bytes | memoryview = zlib.compress(xor.data, ZLIB_LEVEL)
            encoding = "xor"
            stats.changed += 1
        else:
            payload, encoding = data.data, "whole"
            stats.whole += 1
        size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        entries[name] = {
            "dtype": _dtype_name(tensor),
            "shape": list(tensor.shape),
            "encoding": encoding,
            "offset": offset,
            "bytes": size,
        }
        payloads.append(payload)
        offset += size
    removed = sorted(set(base) - set(new))
    stats.removed = len(removed)
    header = json.dumps({"tensors": entries, "removed": removed}, sort_keys=True).encode()
    blob = b"".join([MAGIC, _LENGTH.pack(len(header)), header, *payloads])
    stats.delta_bytes = len(blob)
    return blob, stats


def _header(blob: bytes) -> tuple[dict[str, Any], int]:
    """The parsed header and where the payloads start; DeltaError for anything malformed."""
    if not blob.startswith(MAGIC):
        raise DeltaError(f"not a delta file (it does not start with {MAGIC!r})")
    start = len(MAGIC) + _LENGTH.size
    if len(blob) < start:
        raise DeltaError("truncated before the header length")
    (length,) = _LENGTH.unpack_from(blob, len(MAGIC))
    if length > MAX_HEADER_BYTES or start + length > len(blob):
        raise DeltaError(f"header length {length} runs past the end of the file ({len(blob)} bytes)")
    try:
        header = json.loads(blob[start : start + length])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise DeltaError(f"header is not JSON: {str(exc)[:200]}") from None
    if (
        not isinstance(header, dict)
        or not isinstance(header.get("tensors"), dict)
        or not isinstance(header.get("removed"), list)
    ):
        raise DeltaError("header lacks its 'tensors' table or 'removed' list")
    return header, start + length


def _entry_layout(name: str, entry: object) -> tuple[torch.dtype, tuple[int, ...], str, int, int]:
    """dtype, shape, encoding, offset and size of one header entry, checked."""
    if not isinstance(entry, dict):
        raise DeltaError(f"tensor {name!r}: header entry is not an object")
    dtype, shape, encoding = entry.get("dtype"), entry.get("shape"), entry.get("encoding")
    offset, size = entry.get("offset"), entry.get("bytes")
    if dtype not in DTYPES:
        raise DeltaError(f"tensor {name!r}: unknown dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise DeltaError(f"tensor {name!r}: shape is not a list of sizes")
    if encoding not in ("xor", "whole"):
        raise DeltaError(f"tensor {name!r}: unknown encoding {str(encoding)[:40]!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, size)):
        raise DeltaError(f"tensor {name!r}: offset and bytes must be non-negative integers")
    return DTYPES[dtype], tuple(shape), encoding, offset, size  # type: ignore[return-value]


def _tensor_from(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    return torch.from_numpy(data).view(dtype).reshape(shape)


def apply_delta(base: Mapping[str, Tensor], blob: bytes) -> dict[str, Tensor]:
    """``base`` changed by the delta ``blob``: a new dict (changed tensors new, unchanged shared)."""
    header, start = _header(blob)
    removed = set(map(str, header["removed"]))
    result = {name: tensor for name, tensor in base.items() if name not in removed}
    for name, entry in header["tensors"].items():
        dtype, shape, encoding, offset, size = _entry_layout(name, entry)
        if start + offset + size > len(blob):
            raise DeltaError(f"tensor {name!r}: payload runs past the end of the file")
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        payload = blob[start + offset : start + offset + size]
        if encoding == "whole":
            if size != nbytes:
                raise DeltaError(f"tensor {name!r}: {size} bytes stored, its shape needs {nbytes}")
            result[name] = _tensor_from(np.frombuffer(payload, np.uint8).copy(), dtype, shape)
            continue
        previous = base.get(name)
        if previous is None or previous.dtype != dtype or tuple(previous.shape) != shape:
            raise DeltaError(f"tensor {name!r}: the base has no {dtype} tensor of shape {list(shape)}")
        try:
            xor = zlib.decompress(payload)
        except zlib.error as exc:
            raise DeltaError(f"tensor {name!r}: payload does not decompress ({exc})") from None
        if len(xor) != nbytes:
            raise DeltaError(f"tensor {name!r}: {len(xor)} bytes after decompression, expected {nbytes}")
        data = np.bitwise_xor(raw_bytes(previous), np.frombuffer(xor, np.uint8))
        result[name] = _tensor_from(data, dtype, shape)
    return result
