"""Real mixrl servers on loopback, for the test folders that need one beside their own subject,
and ``mixrl <component>`` run as a process (:func:`cli_server`; a rank of it under torchrun:
:func:`rank_pid`)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from aiohttp import web

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.api.trajectory_check import TrajectoryLimits
from mixrl.rl.auth import AuthToken
from mixrl.rl.buffer.client import BufferClient
from mixrl.rl.buffer.server import BufferServer
from mixrl.rl.buffer.store import TrajectoryBuffer

from .fakes import serve


def limits(run: str = "test", samples_per_prompt: int = 2, candidates: int = 8) -> TrajectoryLimits:
    """A run's trajectory contract for tests (no vocabulary: ids are only checked to be ≥ 0)."""
    return TrajectoryLimits(run, samples_per_prompt, candidates, max_context_tokens=32768, vocab_size=None)


@asynccontextmanager
async def buffer_at(
    directory: Path, prompts_per_update: int = 1, samples_per_prompt: int = 2, run: str = "test"
) -> AsyncIterator[str]:
    """The real buffer of run ``run`` over ``directory`` (its logs survive for a second one); yields its URL."""
    buffer = TrajectoryBuffer(
        directory, prompts_per_update=prompts_per_update, samples_per_prompt=samples_per_prompt
    )
    server = BufferServer(buffer, limits(run, samples_per_prompt), max_body_bytes=64 << 20)
    runner, url = await serve(server.app(), shutdown_timeout=0.5)
    try:
        yield url
    finally:
        await runner.cleanup()
        buffer.close()


@dataclass
class RunningBuffer:
    buffer: TrajectoryBuffer
    server: BufferServer
    url: str
    client: BufferClient
    """A client of the buffer with one retry, 50 ms apart, carrying the buffer's token."""


StartBuffer = Callable[..., Awaitable[RunningBuffer]]


@asynccontextmanager
async def started_buffers(directory: Path) -> AsyncIterator[StartBuffer]:
    """``await start(...)`` serves a real buffer of run ``test`` (over ``directory`` unless it names
    another); each is stopped, its client closed and its logs closed at the end."""
    started: list[tuple[web.AppRunner, RunningBuffer]] = []

    async def start(
        prompts_per_update: int = 2,
        samples_per_prompt: int = 4,
        max_staleness: int | None = None,
        directory: Path = directory,
        auth_token: AuthToken | None = None,
        max_body_bytes: int = 64 << 20,
        candidates: int = 8,
    ) -> RunningBuffer:
        buffer = TrajectoryBuffer(directory, prompts_per_update, samples_per_prompt, max_staleness)
        contract = limits("test", samples_per_prompt, candidates)
        server = BufferServer(buffer, contract, auth_token=auth_token, max_body_bytes=max_body_bytes)
        runner, url = await serve(server.app(), shutdown_timeout=0.5)
        client = BufferClient(url, retries=1, backoff_s=0.05, auth_token=auth_token)
        running = RunningBuffer(buffer, server, url, client)
        started.append((runner, running))
        return running

    yield start
    for runner, running in started:
        await running.client.close()
        await runner.cleanup()
        running.buffer.close()


EXAMPLE_RUN = Path(__file__).parents[1] / "examples" / "rlrun-mixed.yaml"


def write_example_config(path: Path) -> ResolvedRun:
    """examples/rlrun-mixed.yaml resolved and written to ``path`` (a ``--config``); returns it."""
    resolved = resolve(load_rlrun(EXAMPLE_RUN))
    path.write_text(resolved.model_dump_json())
    return resolved


def free_port() -> int:
    """A TCP port free on 127.0.0.1 a moment ago (for a flag that takes no 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def environment_without_token(**extra: str) -> dict[str, str]:
    """This process's environment without ``MIXRL_AUTH_TOKEN`` (the shell's must not leak in), plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k != "MIXRL_AUTH_TOKEN"}, **extra}


def run_cli(
    component: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``mixrl <component> *args`` run to its end (60 s at most), its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "mixrl.cli", component, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


class ServerProcess(NamedTuple):
    """A ``mixrl`` server process (its stderr piped) and the URL it serves."""

    process: asyncio.subprocess.Process
    url: str


@asynccontextmanager
async def cli_server(
    component: str,
    port_file: Path,
    *args: str,
    env: dict[str, str] | None = None,
) -> AsyncIterator[ServerProcess]:
    """``mixrl <component> *args --port 0 --port-file <port_file>`` as a process, yielded with its
    URL once it has written its port (one that exits first fails the test with its stderr). At the
    end a process still running gets SIGTERM (SIGKILL after 30 s); a test that means a clean stop
    sends SIGTERM itself and checks the exit code."""
    port_file.unlink(missing_ok=True)
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "mixrl.cli", component, *args),
        *("--port", "0", "--port-file", str(port_file)),
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        for _ in range(600):
            if port_file.exists():
                break
            if process.returncode is not None:
                said = (await process.stderr.read()).decode()  # type: ignore[union-attr]
                raise AssertionError(f"mixrl {component} exited with {process.returncode}: {said}")
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"mixrl {component} wrote no port within 30 s")
        yield ServerProcess(process, f"http://127.0.0.1:{port_file.read_text()}")
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()


def rank_pid(torchrun_pid: int, local_rank: int) -> int:
    """The pid of one rank torchrun started (its children carry LOCAL_RANK in their environment)."""
    children = Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split()
    for child in map(int, children):
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"LOCAL_RANK={local_rank}".encode() in environ:
            return child
    raise AssertionError(f"torchrun {torchrun_pid} has no rank {local_rank} among {children}")
