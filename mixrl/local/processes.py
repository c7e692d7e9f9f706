"""Starting, watching and stopping mixrl components as local processes: ``mixrl run``'s supervisor
and the tests that need a real engine.

One launcher, :class:`Process`: it runs a command line from the launch table
(:func:`mixrl.api.launch.component_command`) with its output in a log file.  A server listens on
port 0 and writes the port it bound to its port file, which the launcher reads back: no "free port"
is chosen first and then lost to another process before the server binds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixrl.rl.auth import INSECURE_FLAG, TOKEN_FILE_FLAG, AuthToken, write_token_file

MIXRL = (sys.executable, "-m", "mixrl.cli")
"""How a local process runs ``mixrl``: this interpreter, so the children see the same packages."""


@dataclass
class Process:
    name: str
    command: list[str]
    log_path: Path
    port_file: Path | None = None
    """Where the server writes the port it bound (it listens on port 0); None: not a server."""
    host: str = "127.0.0.1"
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    port: int | None = None

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.port_file is not None:  # a port from an earlier start is not this one's
            self.port_file.unlink(missing_ok=True)
            self.port = None
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # Ctrl-C reaches the supervisor only; it stops children in order
        )
        log.close()
        # Operators (and the tests) find a component's process here, e.g. to kill a trainer.
        self.log_path.with_suffix(".pid").write_text(f"{self.process.pid}\n")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name} is not serving yet")
        return f"http://{self.host}:{self.port}"

    def healthy(self) -> bool:
        """A server: it has written its port and answers /health; any other process: it runs."""
        if self.port_file is None:
            return self.alive
        if self.port is None:
            try:
                self.port = int(self.port_file.read_text())
            except (OSError, ValueError):  # not written yet (it is renamed into place whole)
                return False
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def last_log_line(self, limit: int = 300) -> str:
        """The last non-empty line of the log: a component that refuses to start says why there."""
        lines = [line.strip() for line in self.log_tail(5).splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        return last if len(last) <= limit else last[:limit] + "…"

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited in time; its exit code (None: never started).

        Both go to the process's whole group, which it leads (``start_new_session``): a component's
        own children (torchrun's ranks, a sandboxed command) are stopped with it: when this returns,
        the process has exited and every process left in its group has been sent SIGKILL."""
        if self.process is None:
            return None
        if self.alive:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait()
            # Members that outlived their leader (it ignored or mishandled SIGTERM) would run on as
            # orphans no one stops.  The leader has only just been reaped, and the kernel reuses no
            # id while a process of its group is left, so this reaches this group or no one.
            self._signal_group(signal.SIGKILL)
        return self.process.returncode

    def _signal_group(self, signum: int) -> None:
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):  # the group is empty: nothing left to signal
            os.killpg(self.process.pid, signum)


class StopSignals:
    """``with StopSignals(Interrupted) as signals:`` SIGINT and SIGTERM while a supervisor runs.

    The first of them raises ``exception`` in the main thread, so the supervisor stops what it
    started; every later one is ignored, as is any once the supervisor sets ``stopping`` (its
    shutdown has begun): a second Ctrl-C or a service manager's repeated SIGTERM must not cut the
    shutdown short, since the children run in their own sessions and nothing else would ever stop
    them.  The previous handlers are back on leaving the block.

    A handler's exception is lost when it runs inside a finalizer (one the garbage collector ran in
    the main thread prints and drops it): loops that wait call :meth:`check` between waits, which
    raises it again, so a signal stops them within one wait whatever the handler ran inside."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, exception: type[BaseException]) -> None:
        self.exception = exception
        self.stopping = False
        self.received: int | None = None  # the first signal, once one came
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            # (None: a handler not set from Python, which cannot be put back; the default then)
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stopping:
            return
        self.stopping = True  # before raising: the next one finds the shutdown under way
        self.received = signum
        raise self.exception

    def check(self) -> None:
        """Raise ``exception`` if a signal came: called where the first raise would have been caught,
        it is there only if that raise was lost."""
        if self.received is not None:
            raise self.exception


class ProcessStartError(RuntimeError):
    """A component exited or never became healthy while starting; the message is one line naming it."""

    def __init__(self, component: Process, problem: str) -> None:
        last = component.last_log_line()
        why = f": {last}" if last else ""
        super().__init__(f"{component.name} failed to start ({problem}){why} (log: {component.log_path})")
        self.server = component


def wait_healthy(
    components: Sequence[Process],
    timeout: float,
    poll: float = 0.3,
    between_polls: Callable[[], None] | None = None,
) -> None:
    """Block until every component answers its health check; ProcessStartError for the first that
    cannot.  ``between_polls`` runs after each wait (:meth:`StopSignals.check`)."""
    deadline = time.monotonic() + timeout
    pending = list(components)
    while pending:
        for component in list(pending):
            if not component.alive:
                raise ProcessStartError(component, f"exited with code {component.returncode}")
            if component.healthy():
                pending.remove(component)
        if pending and time.monotonic() > deadline:
            raise ProcessStartError(pending[0], f"not healthy after {timeout:.0f}s")
        if pending:
            time.sleep(poll)
            if between_polls is not None:
                between_polls()


# ----------------------------------------------------------------------------- one engine, for tests

STARTUP_TIMEOUT_S = 120.0


class EngineStartError(RuntimeError):
    """The engine process exited or did not become healthy; the message ends with its last log lines."""


class EngineProcess:
    """``with EngineProcess(model_path, weight_precision="fp8") as engine: engine.url``: one torch
    engine on loopback, outside any run (the engine, router and weight-sync tests).

    ``auth_token``: the engine requires it on its control endpoints (written to a 0600 file in the
    process's own temporary directory and passed as ``--auth-token-file``); without one the engine
    runs with ``--insecure-no-auth``, which is what a test of generation alone wants.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        weight_precision: str = "bf16",
        kv_cache_dtype: str = "bf16",
        weight_version: int = 0,
        pool: str = "default",
        max_running_requests: int = 64,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        torch_threads: int = 1,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        auth_token: AuthToken | None = None,
    ) -> None:
        self.startup_timeout_s = startup_timeout_s
        self._workdir = tempfile.TemporaryDirectory(prefix="mixrl-engine-")
        workdir = Path(self._workdir.name)
        if auth_token is None:
            auth_args = [INSECURE_FLAG]
        else:
            write_token_file(workdir / "auth-token", auth_token)
            auth_args = [TOKEN_FILE_FLAG, str(workdir / "auth-token")]
        command = [
            *MIXRL,
            "engine",
            "--model-path",
            str(model_path),
            "--weight-precision",
            weight_precision,
            "--kv-cache-dtype",
            kv_cache_dtype,
            "--weight-version",
            str(weight_version),
            "--pool",
            pool,
            "--max-running-requests",
            str(max_running_requests),
            "--host",
            host,
            "--port",
            "0",
            "--port-file",
            str(workdir / "port"),
            "--torch-threads",
            str(torch_threads),
            *auth_args,
            *extra_args,
        ]
        log = Path(log_path) if log_path else workdir / "engine.log"
        self.server = Process("engine", command, log, port_file=workdir / "port", host=host)

    @property
    def host(self) -> str:
        return self.server.host

    @property
    def port(self) -> int | None:
        return self.server.port

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def log_path(self) -> Path:
        return self.server.log_path

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.server.process

    def log_tail(self, lines: int = 30) -> str:
        return self.server.log_tail(lines)

    # ------------------------------------------------------------------ sync API
    def start(self) -> EngineProcess:
        self.server.start()
        try:
            wait_healthy([self.server], self.startup_timeout_s, poll=0.05)
        except ProcessStartError as exc:
            self.stop()
            raise EngineStartError(f"{exc}:\n{self.log_tail()}") from None
        return self

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """Terminate the engine; returns its exit code (None if it was never started)."""
        code = self.server.stop(timeout_s)
        self.server.process = None
        return code

    def close(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            self._workdir.cleanup()

    def __enter__(self) -> EngineProcess:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ async API
    async def __aenter__(self) -> EngineProcess:
        try:
            return await asyncio.to_thread(self.start)
        except BaseException:
            await asyncio.to_thread(self.close)
            raise

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)
