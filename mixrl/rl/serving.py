"""Run an aiohttp app as a component process: listen, announce the port, stop on SIGTERM or SIGINT.

The engine, the router and the buffer all serve this way; the local runner and the tests start them
with ``--port 0 --port-file F`` and read the port the OS chose from F.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

AIOHTTP_SHUTDOWN_TIMEOUT = 60.0  # aiohttp's own default wait for in-flight requests on cleanup


def add_listen_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """The flags every served component takes: --host, --port, --port-file, --metrics-port."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a container)")
    parser.add_argument(
        "--port", type=int, default=default_port, help="0 picks a free port (see --port-file)"
    )
    parser.add_argument("--port-file", type=Path, default=None, help="write the bound port here once serving")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="also serve /metrics on this port (the pod's metrics port)",
    )


def listen_problem(args: argparse.Namespace) -> str | None:
    """One line naming the bad listening flag, or None."""
    if not 0 <= args.port < 65536:
        return f"--port: {args.port} is not a TCP port"
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        return f"--metrics-port: {args.metrics_port} is not a TCP port"
    return None


def write_port_file(port_file: Path, port: int) -> None:
    """Write the port to a sibling file and rename it into place: readers never see a half-written port."""
    partial = port_file.with_name(port_file.name + ".partial")
    partial.write_text(str(port))
    partial.replace(port_file)


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    log: logging.Logger,
    port_file: Path | None = None,
    metrics_app: web.Application | None = None,
    metrics_port: int | None = None,
    on_listening: Callable[[int], None] | None = None,
    on_stop: Callable[[], None] | None = None,
    shutdown_timeout: float = AIOHTTP_SHUTDOWN_TIMEOUT,
) -> None:
    """Serve ``app`` (and ``metrics_app`` on ``metrics_port``) until SIGTERM or SIGINT.

    ``on_listening(bound_port)`` runs once the port is bound and the port file written;
    ``on_stop()`` runs after the signal and before aiohttp waits up to ``shutdown_timeout`` seconds
    for in-flight requests (a component that holds requests open answers them there).
    """
    if (metrics_app is None) != (metrics_port is None):
        raise ValueError("metrics_app and metrics_port: give both or neither")
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    runners = [runner]
    try:
        await web.TCPSite(runner, host, port).start()
        bound: int = runner.addresses[0][1]
        if metrics_app is not None:
            metrics_runner = web.AppRunner(metrics_app, access_log=None)
            await metrics_runner.setup()
            runners.insert(0, metrics_runner)  # metrics stop first: nothing scrapes a half-stopped server
            await web.TCPSite(metrics_runner, host, metrics_port).start()
        if port_file is not None:
            write_port_file(port_file, bound)
        if on_listening is not None:
            on_listening(bound)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        log.info("shutting down")
        if on_stop is not None:
            on_stop()
        for each in runners:
            await each.cleanup()
