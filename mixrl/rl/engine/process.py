"""Run ``mixrl engine`` as a child process on a free loopback port (local runtime and tests).

The server binds port 0 itself and writes the port it got to a file, so there is no race between
choosing a free port and binding it.  ``stop()`` sends SIGTERM (the server aborts in-flight requests
and exits), then SIGKILL if it has not exited in time.

``auth_token``: the engine requires it on its control endpoints (written to a 0600 file in the
process's own temporary directory and passed as ``--auth-token-file``); without one the engine
runs with ``--insecure-no-auth``, which is what a test of generation alone wants.
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
from collections.abc import Sequence
from pathlib import Path

from mixrl.rl.auth import INSECURE_FLAG, TOKEN_FILE_FLAG, AuthToken, write_token_file

STARTUP_TIMEOUT_S = 120.0


class EngineStartError(RuntimeError):
    """The engine process exited or did not become healthy; the message ends with its last log lines."""


class EngineProcess:
    """``with EngineProcess(model_path, weight_precision="fp8") as engine: engine.url``."""

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
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self._workdir = tempfile.TemporaryDirectory(prefix="mixrl-engine-")
        self.port_file = Path(self._workdir.name) / "port"
        if auth_token is None:
            auth_args = [INSECURE_FLAG]
        else:
            token_file = Path(self._workdir.name) / "auth-token"
            write_token_file(token_file, auth_token)
            auth_args = [TOKEN_FILE_FLAG, str(token_file)]
        self.log_path = Path(log_path) if log_path else Path(self._workdir.name) / "engine.log"
        self.args = [
            sys.executable,
            "-m",
            "mixrl.cli",
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
            str(self.port_file),
            "--torch-threads",
            str(torch_threads),
            *auth_args,
            *extra_args,
        ]
        self.process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("engine not started")
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------ sync API
    def start(self) -> EngineProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing after we return
        try:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                raise EngineStartError(
                    f"engine exited with code {self.process.returncode} during startup:\n{self.log_tail()}"
                )
            if self.port is None and self.port_file.exists():
                self.port = int(self.port_file.read_text())
            if self.port is not None and self._healthy():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise EngineStartError(
                    f"engine not healthy after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """Terminate the engine; returns its exit code (None if it was never started)."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

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
