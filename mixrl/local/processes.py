"""Starting, watching and stopping the components as local processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Component:
    name: str
    args: list[str]
    log_path: Path
    health_url: str | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mixrl.cli", *self.args],
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

    def healthy(self) -> bool:
        if self.health_url is None:
            return self.alive
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as response:
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

    def stop(self, timeout: float = 15.0) -> None:
        if not self.alive:
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ComponentStartError(RuntimeError):
    """A component exited or never became healthy while starting; the message is one line naming it."""

    def __init__(self, component: Component, problem: str) -> None:
        last = component.last_log_line()
        why = f": {last}" if last else ""
        super().__init__(f"{component.name} failed to start ({problem}){why} (log: {component.log_path})")
        self.component = component


def wait_healthy(components: list[Component], timeout: float) -> None:
    """Block until every component answers its health check; ComponentStartError for the first that cannot."""
    deadline = time.monotonic() + timeout
    pending = list(components)
    while pending:
        for component in list(pending):
            if not component.alive:
                raise ComponentStartError(component, f"exited with code {component.returncode}")
            if component.healthy():
                pending.remove(component)
        if pending and time.monotonic() > deadline:
            raise ComponentStartError(pending[0], f"not healthy after {timeout:.0f}s")
        if pending:
            time.sleep(0.3)
