"""``mixrl sandbox-exec``: the tiny HTTP server inside a sandbox pod that runs one command per request.

    POST /run     {"command": "...", "files": {"path": "<base64>"}, "limits": {"wall_s": 10, ...}}
               -> {"exitCode": 0, "stdout": "...", "stderr": "...", "finishReason": "ok",
                   "wallS": 0.1, "files": {"path": "<base64>"} | null, "detail": "", "dropped": []}
    GET  /health  -> 200 once it serves

The pod is the sandbox (docs/sandbox.md#sandbox-pods-in-a-cluster): its own kernel under gVisor
or Kata, no network, no token, non-root, no capabilities.  Inside it each command gets what the
local backend gives it apart from the namespaces: a fresh working directory holding the files it
was given, a cleared environment, the same rlimits (``prlimit``, :func:`mixrl.rl.sandbox.limits.prlimit_args`),
the wall clock and output caps (its process group is killed), the same finish reasons
(:func:`mixrl.rl.sandbox.runner.classify`).  ``disk_bytes`` is checked on what the command left in
its directory (``disk`` when more; the pod's tmpfs ``/work`` bounds it meanwhile).  One command
runs at a time; the rollout worker deletes the pod after one.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from mixrl.api.plain_text import plain_text
from mixrl.rl.sandbox.files import check_path, write_tree
from mixrl.rl.sandbox.limits import Limits, prlimit_args
from mixrl.rl.sandbox.processes import become_subreaper, kill_descendants_of_self, kill_process_tree
from mixrl.rl.sandbox.runner import FINISH_REASONS, TRUNCATED, SandboxResult, classify

READ_CHUNK = 64 * 1024
DRAIN_GRACE_S = 5.0
EXIT_POLL_S = 0.02
MAX_FILES = 2000
MAX_REQUEST_BYTES = 256 * 1024 * 1024
COMMAND_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}
"""The command's whole environment, with ``HOME`` its own directory and ``TMPDIR`` a fresh one beside
it: nothing of the executor's own environment reaches it."""


# ----------------------------------------------------------------------------- the wire format (pure)


def encode_request(command: str, files: Mapping[str, str | bytes], limits: Limits) -> dict[str, Any]:
    return {
        "command": command,
        "files": {path: _b64(content) for path, content in files.items()},
        "limits": dataclasses.asdict(limits),
    }


def decode_request(body: object) -> tuple[str, dict[str, bytes], Limits]:
    """The command, files and limits of a request, or ValueError naming the bad field."""
    if not isinstance(body, dict):
        raise ValueError("request: must be a JSON object")
    unknown = set(body) - {"command", "files", "limits"}
    if unknown:
        raise ValueError(f"request: unknown fields {sorted(unknown)}")
    command = body.get("command")
    if not isinstance(command, str) or not command.strip():
        raise ValueError("command: must be a non-empty string")
    files_in = body.get("files", {})
    if not isinstance(files_in, dict) or not all(isinstance(v, str) for v in files_in.values()):
        raise ValueError("files: must map paths to base64 strings")
    try:
        files = {check_path(path): base64.b64decode(text, validate=True) for path, text in files_in.items()}
    except (ValueError, TypeError) as error:
        raise ValueError(f"files: {error}") from None
    limits_in = body.get("limits", {})
    if not isinstance(limits_in, dict):
        raise ValueError("limits: must be an object")
    known = {field.name for field in dataclasses.fields(Limits)}
    if set(limits_in) - known:
        raise ValueError(f"limits: unknown fields {sorted(set(limits_in) - known)}")
    return command, files, Limits(**limits_in)


def encode_result(result: SandboxResult) -> dict[str, Any]:
    return {
        "exitCode": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "finishReason": result.finish_reason,
        "wallS": result.wall_s,
        "files": None if result.files is None else {p: _b64(c) for p, c in result.files.items()},
        "detail": result.detail,
        "dropped": list(result.dropped),
    }


def decode_result(body: object) -> SandboxResult:
    """A result as the executor sent it, or ValueError when it is not one."""
    if not isinstance(body, dict) or body.get("finishReason") not in FINISH_REASONS:
        raise ValueError(f"sandbox executor: not a result: {str(body)[:200]}")
    files = body.get("files")
    return SandboxResult(
        exit_code=body.get("exitCode"),
        stdout=str(body.get("stdout", "")),
        stderr=str(body.get("stderr", "")),
        finish_reason=body["finishReason"],
        wall_s=float(body.get("wallS", 0.0)),
        files=None if files is None else {path: base64.b64decode(text) for path, text in files.items()},
        detail=str(body.get("detail", "")),
        dropped=tuple(body.get("dropped", ())),
    )


def _b64(content: str | bytes) -> str:
    data = content.encode() if isinstance(content, str) else bytes(content)
    return base64.b64encode(data).decode()


# ----------------------------------------------------------------------------- running one command


async def execute(
    command: str, files: Mapping[str, bytes], limits: Limits, work_root: str, *, sole_parent: bool = False
) -> SandboxResult:
    """Run ``command`` with ``/bin/sh -c`` under ``prlimit`` in a fresh directory of ``work_root``
    holding ``files``; at its end, the wall clock or an output cap kill what it started.

    ``sole_parent``: every child of this process is the command's (the sandbox pod's executor,
    which runs one command at a time and to which orphans are reparented); then what the command
    left running in a session of its own is found and killed too, not only its process tree.
    ValueError, as from the local backend, when the files cannot all be written (one in another's
    way) or the command cannot be passed to a process (a NUL)."""
    workspace = tempfile.mkdtemp(prefix="run-", dir=work_root)
    # Temporary files go beside the workspace, as the local backend's go to its own /tmp: they
    # neither come back with the files nor count to disk_bytes.
    scratch = tempfile.mkdtemp(prefix="tmp-", dir=work_root)
    try:
        write_tree(workspace, files)
        return await _run(command, limits, workspace, scratch, sole_parent)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


async def _run(
    command: str, limits: Limits, workspace: str, scratch: str, sole_parent: bool
) -> SandboxResult:
    started = time.monotonic()
    env = {**COMMAND_ENV, "HOME": workspace, "TMPDIR": scratch}
    process = await asyncio.create_subprocess_exec(
        "prlimit", *prlimit_args(limits), "--", "/bin/sh", "-c", command,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=workspace, env=env, start_new_session=True,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    overflowed = asyncio.Event()
    kept: dict[str, bytes] = {}
    overflow: list[str] = []
    readers = [
        asyncio.create_task(
            _drain(process.stdout, "stdout", limits.output_bytes, kept, overflow, overflowed)
        ),
        asyncio.create_task(
            _drain(process.stderr, "stderr", limits.output_bytes, kept, overflow, overflowed)
        ),
    ]
    exited = asyncio.create_task(_exited(process))
    overflow_seen = asyncio.create_task(overflowed.wait())
    ended = asyncio.create_task(process.wait())
    killed_for = ""
    cleaned_up = False
    try:
        # ended: the usual way (the pipes close as the command exits); exited: a process the
        # command left in a session of its own holds them
        await asyncio.wait(
            {ended, exited, overflow_seen}, timeout=limits.wall_s, return_when=asyncio.FIRST_COMPLETED
        )
        if not (ended.done() or exited.done()):
            killed_for = "output_limit" if overflowed.is_set() else "timeout"
        _kill_leftovers(process.pid, sole_parent)  # also what the command left running in the background
        cleaned_up = True
        await asyncio.wait({ended}, timeout=DRAIN_GRACE_S)
        await asyncio.wait(readers, timeout=DRAIN_GRACE_S)
    finally:
        if not cleaned_up:  # cancelled or failed before the kill above
            _kill_leftovers(process.pid, sole_parent)
        for task in (*readers, exited, overflow_seen, ended):
            task.cancel()
        await asyncio.gather(*readers, exited, overflow_seen, ended, return_exceptions=True)
    wall_s = time.monotonic() - started
    stdout = _text(kept.get("stdout", b""), limits.output_bytes, "stdout" in overflow)
    stderr = _text(kept.get("stderr", b""), limits.output_bytes, "stderr" in overflow)
    if killed_for == "timeout":
        return SandboxResult(
            None, stdout, stderr, "timeout", wall_s, detail=f"wall clock limit {limits.wall_s} s"
        )
    if killed_for == "output_limit":
        detail = f"{overflow[0]} passed {limits.output_bytes} bytes"
        return SandboxResult(None, stdout, stderr, "output_limit", wall_s, detail=detail)
    returncode = process.returncode if process.returncode is not None else -signal.SIGKILL
    status = returncode if returncode >= 0 else 128 - returncode  # as a shell reports a signal
    files, dropped, size = read_workspace(workspace, MAX_FILES)
    if size > limits.disk_bytes:
        detail = f"the command left {size} bytes in /work, more than {limits.disk_bytes}"
        return SandboxResult(status, stdout, stderr, "disk", wall_s, detail=detail)
    reason, why = classify(status, stderr, limits)
    return SandboxResult(status, stdout, stderr, reason, wall_s, files, why, tuple(dropped))


async def _drain(
    stream: asyncio.StreamReader,
    name: str,
    cap: int,
    kept: dict[str, bytes],
    overflow: list[str],
    overflowed: asyncio.Event,
) -> None:
    """Keep the first ``cap`` bytes; past them flag the overflow and read on without keeping."""
    data = bytearray()
    while chunk := await stream.read(READ_CHUNK):
        room = cap - len(data)
        data += chunk[: max(room, 0)]
        if len(chunk) > room and not overflowed.is_set():
            overflow.append(name)
            overflowed.set()
        kept[name] = bytes(data)


async def _exited(process: asyncio.subprocess.Process) -> None:
    """Return when the command's own process has ended.  ``process.wait()`` also waits for its
    pipes to close, which a process it left running in another session keeps open."""
    while process.returncode is None:
        await asyncio.sleep(EXIT_POLL_S)


def _kill_leftovers(pid: int, sole_parent: bool) -> None:
    kill_process_tree(pid)
    if sole_parent:
        kill_descendants_of_self(keep_waited=pid)


def _text(data: bytes, cap: int, truncated: bool) -> str:
    text = data.decode(errors="replace")
    return text + TRUNCATED.format(cap=cap) if truncated else text


def read_workspace(root: str, max_files: int) -> tuple[dict[str, bytes], list[str], int]:
    """The regular files under ``root`` (links and devices dropped, never followed), the notes of
    what was dropped (also what the command made unreadable), and the bytes of every regular file
    (kept or not)."""
    files: dict[str, bytes] = {}
    dropped: list[str] = []
    size = 0

    def unreadable(error: OSError) -> None:
        relative = os.path.relpath(error.filename or root, root)
        dropped.append(f"{relative!r}: cannot be read ({error.strerror})")

    for directory, subdirs, names in os.walk(root, onerror=unreadable, followlinks=False):
        for name in [*names, *(d for d in subdirs if os.path.islink(os.path.join(directory, d)))]:
            full = os.path.join(directory, name)
            relative = os.path.relpath(full, root)
            try:
                info = os.lstat(full)
            except OSError as error:  # in a directory the command left without search permission
                unreadable(error)
                continue
            if not stat.S_ISREG(info.st_mode):
                dropped.append(f"{relative!r}: not a regular file")
                continue
            size += info.st_size
            if len(files) >= max_files:
                dropped.append(f"{relative!r}: more than {max_files} files")
                continue
            try:
                path = check_path(relative)
            except ValueError as error:
                dropped.append(str(error))
                continue
            try:
                descriptor = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(descriptor, "rb") as handle:
                    files[path] = handle.read()
            except OSError as error:  # a mode the command set (chmod 000): its file, not our failure
                unreadable(error)
    return files, dropped, size


# ----------------------------------------------------------------------------- the server


def make_app(work_root: str, *, sole_parent: bool = False) -> web.Application:
    """``sole_parent``: as :func:`execute`'s (the commands are this process's only children)."""
    lock = asyncio.Lock()

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def run(request: web.Request) -> web.Response:
        try:
            command, files, limits = decode_request(await request.json())
        except ValueError as error:
            return web.json_response({"error": str(error)}, status=400)
        async with lock:
            try:
                result = await execute(command, files, limits, work_root, sole_parent=sole_parent)
            except ValueError as error:
                # What the local backend refuses before it runs anything too (a file in another's
                # way, a NUL in the command): the request's fault, so not a 500.
                return web.json_response({"error": str(error)}, status=400)
        return web.json_response(encode_result(result))

    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app.router.add_get("/health", health)
    app.router.add_post("/run", run)
    return app


def serve(host: str, port: int, work_dir: str) -> None:
    """Serve until killed (the sandbox pod's only process: orphans of its commands are its own,
    to be killed after each)."""
    if not os.path.isdir(work_dir):
        raise SystemExit(f"--work-dir: {work_dir} is not a directory")
    if shutil.which("prlimit") is None:
        raise SystemExit(
            "sandbox-exec: prlimit (util-linux) is not installed; no command runs without limits"
        )
    if not become_subreaper() and os.getpid() != 1:
        print(
            "sandbox-exec: the kernel refused PR_SET_CHILD_SUBREAPER and this is not PID 1: a process "
            "a command leaves in a session of its own outlives it until the pod goes",
            flush=True,
        )
    app = make_app(work_dir, sole_parent=True)
    web.run_app(app, host=host, port=port, print=lambda text: print(text, flush=True))


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="mixrl sandbox-exec", description=plain_text(__doc__).splitlines()[0]
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--work-dir", required=True, help="where each command's fresh directory is made")
    args = parser.parse_args(argv)
    serve(args.host, args.port, args.work_dir)
    return 0
