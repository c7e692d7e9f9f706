"""Run one command in a fresh bubblewrap sandbox and say how it ended.

    sandbox = Sandbox()
    result = await sandbox.run("python3 -m unittest -q", {"solution.py": "...", "test_x.py": "..."})
    result.finish_reason, result.exit_code, result.stdout, result.files["solution.py"]

Every call builds a new sandbox from the files it is given and throws it away afterwards; nothing
persists between calls except what the caller keeps from ``result.files``.  There is no fallback:
when bubblewrap is missing or cannot build its namespaces, :class:`SandboxUnavailable` says why and
nothing runs.  What is and is not isolated: docs/sandbox.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Literal

from mixrl.rl.sandbox.command import COPY_FAILED, STARTED, SandboxConfig, bwrap_argv
from mixrl.rl.sandbox.files import read_tar, write_tree
from mixrl.rl.sandbox.limits import Limits
from mixrl.rl.sandbox.processes import kill_process_tree

FinishReason = Literal["ok", "timeout", "memory", "disk", "output_limit", "killed"]
FINISH_REASONS: tuple[FinishReason, ...] = ("ok", "timeout", "memory", "disk", "output_limit", "killed")
TRUNCATED = "\n[mixrl sandbox: output truncated at {cap} bytes]\n"
DRAIN_GRACE_S = 5.0
"""After the sandbox is killed its pipes close at once (every process in it is gone); this only
bounds the waits should they not."""
READ_CHUNK = 64 * 1024

MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "out of memory", "std::bad_alloc")
DISK_MARKERS = ("No space left on device",)
FILE_SIZE_MARKERS = ("File size limit exceeded", "File too large")
"""A shell's report of SIGXFSZ, and EFBIG's message: Python ignores SIGXFSZ, so its write past the
limit raises ``OSError: [Errno 27] File too large`` instead of ending by the signal."""
SIGNAL_STATUS = 128
"""A shell reports a command ended by signal n as status 128 + n."""


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot build its namespaces here; nothing was run."""


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed command ended.

    ``exit_code``: the command's exit status as its shell saw it (128 + n when signal n ended it;
    a command that itself exits 152 reads as SIGXCPU), or None when the sandbox was killed before
    the command ended (wall clock, output cap, or the command killed its own wrapper).
    ``finish_reason``: ``ok`` the command ended by itself (whatever its status); ``timeout`` wall
    clock or CPU limit; ``memory`` it ran out of address space (read from its stderr: Python's
    MemoryError, ENOMEM); ``disk`` a tmpfs full or the file size limit; ``output_limit`` stdout or
    stderr passed its cap; ``killed`` anything else that ended it by a signal.
    ``files``: ``/work`` after the command (None when none came back); ``dropped`` names what was
    left out of it (links, odd names, too many files).
    """

    exit_code: int | None
    stdout: str
    stderr: str
    finish_reason: FinishReason
    wall_s: float
    files: dict[str, bytes] | None = None
    detail: str = ""
    dropped: tuple[str, ...] = field(default=())


@dataclass
class _Streams:
    stdout: bytes = b""
    stderr: bytes = b""
    results: bytes = b""
    results_too_long: bool = False
    overflow: str = ""


class Sandbox:
    """Runs commands in bubblewrap sandboxes; at most ``config.max_concurrent`` at once."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._gate = asyncio.Semaphore(self.config.max_concurrent)

    async def run(
        self,
        command: str,
        files: Mapping[str, str | bytes] | None = None,
        limits: Limits | None = None,
    ) -> SandboxResult:
        """Run ``command`` with ``/bin/sh -c`` in ``/work``, which holds ``files`` (relative paths)."""
        if not isinstance(command, str) or not command.strip():
            raise ValueError(f"command: must be a non-empty string, got {command!r}")
        limits = limits or Limits()
        program = self._program()
        async with self._gate:
            seed = tempfile.mkdtemp(prefix="mixrl-sandbox-")
            try:
                write_tree(seed, files or {})
                if os.geteuid() == 0:
                    os.chown(seed, self.config.host_uid, self.config.host_uid)
                argv = bwrap_argv(self.config, limits, seed, command)
                argv[0] = program
                return await self._run(argv, limits)
            finally:
                shutil.rmtree(seed, ignore_errors=True)

    def _program(self) -> str:
        program = shutil.which(self.config.bwrap)
        if program is None:
            raise SandboxUnavailable(
                f"bubblewrap ({self.config.bwrap!r}) is not installed: apt-get install bubblewrap "
                "(scripts/setup.sh does it as root); no command runs unsandboxed"
            )
        return program

    def check(self, timeout_s: float = 10.0) -> None:
        """Build one sandbox now and run ``true`` in it (blocking, about 20 ms); SandboxUnavailable
        with bubblewrap's own words when it cannot, so that a worker fails at start, not mid-run."""
        program = self._program()
        seed = tempfile.mkdtemp(prefix="mixrl-sandbox-")
        read_end, write_end = os.pipe()  # the results pipe; an empty /work's archive fits its buffer
        try:
            if os.geteuid() == 0:
                os.chown(seed, self.config.host_uid, self.config.host_uid)
            argv = bwrap_argv(self.config, Limits(), seed, "true")
            argv[0] = program
            done = subprocess.run(
                argv, stdin=write_end, capture_output=True, timeout=timeout_s, env={},
                check=False, **self._drop_privileges(),
            )  # fmt: skip
            os.close(write_end)
            write_end = -1
            with os.fdopen(read_end, "rb") as results:
                read_end = -1
                started = results.read(len(STARTED)) == STARTED
        except subprocess.TimeoutExpired:
            raise SandboxUnavailable(f"bubblewrap did not run `true` within {timeout_s} s") from None
        finally:
            for descriptor in (read_end, write_end):
                if descriptor >= 0:
                    os.close(descriptor)
            shutil.rmtree(seed, ignore_errors=True)
        if done.returncode != 0 or not started:
            message = done.stderr.decode(errors="replace").strip()[:500]
            raise SandboxUnavailable(f"bubblewrap could not build the sandbox: {message}")

    async def _run(self, argv: list[str], limits: Limits) -> SandboxResult:
        started = time.monotonic()
        read_end, write_end = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=write_end,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                env={},  # bubblewrap's own PID 1 keeps the environment it starts with
                **self._drop_privileges(),
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        results_pipe = os.fdopen(read_end, "rb", buffering=0)
        streams = _Streams()
        overflowed = asyncio.Event()
        killed_for = ""
        helpers: list[asyncio.Task[Any]] = []
        try:
            assert process.stdout is not None and process.stderr is not None
            readers = [
                asyncio.create_task(
                    _drain(process.stdout, limits.output_bytes, "stdout", streams, overflowed)
                ),
                asyncio.create_task(
                    _drain(process.stderr, limits.output_bytes, "stderr", streams, overflowed)
                ),
                asyncio.create_task(_read_results(results_pipe, 2 * limits.disk_bytes + 2**20, streams)),
            ]
            ended = asyncio.create_task(process.wait())
            overflow_seen = asyncio.create_task(overflowed.wait())
            helpers = [*readers, ended, overflow_seen]
            await asyncio.wait(
                {ended, overflow_seen}, timeout=limits.wall_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not ended.done():
                killed_for = "output_limit" if overflowed.is_set() else "timeout"
                _kill(process)
                await asyncio.wait({ended}, timeout=DRAIN_GRACE_S)
            await asyncio.wait(readers, timeout=DRAIN_GRACE_S)
        finally:
            # also on cancellation: the sandbox never outlives the call
            if process.returncode is None:
                _kill(process)
                with contextlib.suppress(ProcessLookupError, TimeoutError):
                    # wait() also waits for the pipes to close; bounded should anything hold them
                    await asyncio.wait_for(process.wait(), DRAIN_GRACE_S)
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            results_pipe.close()
        wall_s = time.monotonic() - started
        return _result(streams, process.returncode, killed_for, limits, wall_s, self.config.max_files)

    def _drop_privileges(self) -> dict[str, Any]:
        """As root, start bubblewrap as the unprivileged host uid (it then builds a user namespace
        like any user would); otherwise as whoever runs mixrl."""
        if os.geteuid() != 0:
            return {}
        uid = self.config.host_uid
        return {"user": uid, "group": uid, "extra_groups": []}


def _kill(process: asyncio.subprocess.Process) -> None:
    kill_process_tree(process.pid)


async def _drain(
    stream: asyncio.StreamReader, cap: int, name: str, streams: _Streams, overflowed: asyncio.Event
) -> None:
    """Keep the first ``cap`` bytes; past them flag the overflow (the runner then kills the sandbox)
    and read on to the end without keeping anything, so the pipe always reaches its end."""
    kept = bytearray()
    while chunk := await stream.read(READ_CHUNK):
        room = cap - len(kept)
        if len(chunk) > room:
            kept += chunk[: max(room, 0)]
            if not overflowed.is_set():
                streams.overflow = name
                overflowed.set()
            continue
        kept += chunk
    setattr(streams, name, bytes(kept))


async def _read_results(pipe: BinaryIO, cap: int, streams: _Streams) -> None:
    """The wrapper's results pipe: the started line, the status line, then a tar of /work."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=READ_CHUNK)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    kept = bytearray()
    too_long = False
    try:
        while chunk := await reader.read(READ_CHUNK):
            too_long = too_long or len(kept) + len(chunk) > cap
            if not too_long:
                kept += chunk
    finally:
        transport.close()
    streams.results = bytes(kept)
    streams.results_too_long = too_long


def _result(
    streams: _Streams, returncode: int | None, killed_for: str, limits: Limits, wall_s: float, max_files: int
) -> SandboxResult:
    results = streams.results
    stderr_text = _text(streams.stderr, limits.output_bytes, streams.overflow == "stderr")
    if not results.startswith(STARTED):
        if killed_for == "timeout":
            return SandboxResult(
                None, "", "", "timeout", wall_s, detail=f"wall clock limit {limits.wall_s} s"
            )
        raise SandboxUnavailable(f"bubblewrap could not build the sandbox: {stderr_text.strip()[:500]}")
    status_line, _, archive = results[len(STARTED) :].partition(b"\n")
    status = _status(status_line)
    files: dict[str, bytes] | None = None
    dropped: list[str] = []
    detail = ""
    if streams.results_too_long:
        detail = "the files did not come back: their archive passed its cap"
    elif status is not None and archive:
        try:
            files, dropped = read_tar(archive, max_files)
        except tarfile.TarError as error:
            detail = f"the files did not come back: {error}"
    exit_code, reason, why = _ending(status, returncode, killed_for, streams.overflow, stderr_text, limits)
    return SandboxResult(
        exit_code,
        stdout=_text(streams.stdout, limits.output_bytes, streams.overflow == "stdout"),
        stderr=stderr_text,
        finish_reason=reason,
        wall_s=wall_s,
        files=files,
        detail=why or detail,
        dropped=tuple(dropped),
    )


def _ending(
    status: int | None, returncode: int | None, killed_for: str, overflow: str, stderr: str, limits: Limits
) -> tuple[int | None, FinishReason, str]:
    """The exit code, finish reason and detail of a run the sandbox was built for."""
    if killed_for == "timeout":
        return None, "timeout", f"wall clock limit {limits.wall_s} s"
    if killed_for == "output_limit":
        return None, "output_limit", f"{overflow} passed {limits.output_bytes} bytes"
    if status is None:
        if returncode == COPY_FAILED:
            return None, "disk", f"the files passed {limits.disk_bytes} bytes"
        return None, "killed", f"the sandbox's wrapper ended before the command did (status {returncode})"
    reason, why = classify(status, stderr, limits)
    return status, reason, why


def classify(status: int, stderr: str, limits: Limits) -> tuple[FinishReason, str]:
    """Why a command that ended by itself ended: its status and what it said on stderr."""
    if status == SIGNAL_STATUS + signal.SIGXCPU:
        return "timeout", f"cpu time limit {limits.cpu_s} s"
    if status == SIGNAL_STATUS + signal.SIGXFSZ:
        return "disk", f"file size limit {limits.file_bytes} bytes"
    if status != 0 and any(marker in stderr for marker in MEMORY_MARKERS):
        return "memory", f"address space limit {limits.memory_bytes} bytes"
    if status != 0 and any(marker in stderr for marker in FILE_SIZE_MARKERS):
        return "disk", f"file size limit {limits.file_bytes} bytes"
    if status != 0 and any(marker in stderr for marker in DISK_MARKERS):
        return "disk", f"/work and /tmp hold {limits.disk_bytes} bytes each"
    if SIGNAL_STATUS < status < SIGNAL_STATUS + signal.NSIG:
        number = status - SIGNAL_STATUS
        name = signal.Signals(number).name if number in signal.valid_signals() else str(number)
        return "killed", f"signal {name}"
    return "ok", ""


def _status(line: bytes) -> int | None:
    word = line.removeprefix(b"status ")
    return int(word) if word != line and word.isdigit() else None


def _text(data: bytes, cap: int, truncated: bool) -> str:
    text = data.decode(errors="replace")
    return text + TRUNCATED.format(cap=cap) if truncated else text
