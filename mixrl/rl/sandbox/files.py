"""The files a sandboxed command sees and leaves behind: path checks, writing them in, reading them back.

Files travel as ``{relative path: bytes}``.  Going in, they are written under a fresh host directory
that the sandbox mounts read-only and copies into its own tmpfs.  Coming out, the sandbox's wrapper
streams a tar of its working directory over a pipe and :func:`read_tar` turns it back into a dict,
never touching the host's file system: whatever the command put there (names with ``..``, links,
devices, a forged archive) can only become an entry of that dict, or be dropped.
"""

from __future__ import annotations

import io
import os
import posixpath
import tarfile
from collections.abc import Mapping

MAX_PATH_CHARS = 255
MAX_DEPTH = 16


def check_path(path: str) -> str:
    """``path`` normalized (``a/./b`` -> ``a/b``), or ValueError naming it when it is not a plain
    relative path inside the working directory."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"files: a path must be a non-empty string, got {path!r}")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:  # the OS hands a non-UTF-8 name back with lone surrogates
        raise ValueError(f"files: {_escaped(path)!r}: not a UTF-8 file name") from None
    if "\x00" in path or "\\" in path:
        raise ValueError(f"files: path {path!r} holds a NUL or a backslash")
    if path.startswith("/"):
        raise ValueError(f"files: path {path!r} is absolute; paths are relative to the working directory")
    if len(path) > MAX_PATH_CHARS:
        raise ValueError(f"files: path {path[:40]!r}... is longer than {MAX_PATH_CHARS} characters")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if not parts:
        raise ValueError(f"files: path {path!r} names the working directory itself, not a file")
    if ".." in parts:
        raise ValueError(f"files: path {path!r} climbs out with '..'")
    if len(parts) > MAX_DEPTH:
        raise ValueError(f"files: path {path!r} is deeper than {MAX_DEPTH} directories")
    return "/".join(parts)


def _escaped(path: str) -> str:
    """A name with lone surrogates as text a tokenizer can encode: its raw bytes as ``\\xff`` escapes."""
    try:
        raw = path.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no OS made (a client's JSON "\\ud800")
        return path.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def as_bytes(content: str | bytes) -> bytes:
    return content.encode() if isinstance(content, str) else bytes(content)


def write_tree(root: str, files: Mapping[str, str | bytes]) -> None:
    """Write ``files`` under the existing directory ``root`` (checked paths, mode 0644, dirs 0755)."""
    checked = {check_path(path): as_bytes(content) for path, content in files.items()}
    for path in checked:
        parent = posixpath.dirname(path)
        while parent:
            if parent in checked:
                raise ValueError(f"files: {parent!r} is both a file and the directory of {path!r}")
            parent = posixpath.dirname(parent)
    for path, content in checked.items():
        target = os.path.join(root, path)
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(content)


def read_tar(data: bytes, max_files: int) -> tuple[dict[str, bytes], list[str]]:
    """The regular files of a tar stream as ``{path: bytes}``, and a note for each entry dropped.

    Dropped: links, devices and other non-regular entries, names that fail :func:`check_path`,
    entries past ``max_files``.  A truncated or malformed stream raises ``tarfile.TarError``.
    """
    files: dict[str, bytes] = {}
    dropped: list[str] = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        for member in archive:
            if member.isdir():
                continue
            if not member.isreg():
                dropped.append(f"{member.name!r}: not a regular file")
                continue
            try:
                path = check_path(member.name)
            except ValueError as error:
                dropped.append(str(error))
                continue
            if len(files) >= max_files:
                dropped.append(f"{path!r}: more than {max_files} files")
                continue
            extracted = archive.extractfile(member)
            files[path] = extracted.read() if extracted is not None else b""
    return files, dropped
