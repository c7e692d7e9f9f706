"""Run an aiohttp app as a component process: listen, announce the port, stop on SIGTERM or SIGINT.

The engine, the router and the buffer all serve this way; the local runner and the tests start them
with ``--port 0 --port-file F`` and read the port the OS chose from F.  The router and the buffer
share the rest of their skeleton too: an app behind the run's token with ``GET /metrics`` from a
Prometheus registry (:func:`component_app`), the same ``/metrics`` alone for the pod's metrics port
(:func:`metrics_app`), :func:`serve_component`, which serves both as the listening flags say, and
:func:`read_body`, which turns a client gone mid-body into one INFO line instead of a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mixrl.rl.auth import AuthToken, auth_middlewares

AIOHTTP_SHUTDOWN_TIMEOUT = 60.0  # aiohttp's own default wait for in-flight requests on cleanup


class ClientGone(Exception):
    """The client disconnected before its request body arrived whole: nothing was acted on."""


async def read_body(request: web.Request, log: logging.Logger) -> bytes:
    """The whole body, or :class:`ClientGone` when the client went away mid-body (one INFO line,
    no traceback: a dropped connection is the client's business, and nothing was half-done).
    A body over the app's ``client_max_size`` still answers 413 (aiohttp's own HTTP error)."""
    try:
        return await request.read()
    except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is a ConnectionResetError
        log.info("%s %s: the client went away mid-body (%s); nothing done", request.method, request.path, exc)
        raise ClientGone from None
    except asyncio.CancelledError:  # the same, in an app that cancels the handlers of gone clients
        log.info("%s %s: the client went away mid-body; nothing done", request.method, request.path)
        raise


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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What stops a component: SIGTERM (Kubernetes, the local runner), SIGINT (Ctrl-C)."""


def stop_on_signals(event: asyncio.Event) -> Callable[[], None]:
    """Make :data:`STOP_SIGNALS` set ``event`` on the running loop from now on; returns a function
    that removes the two handlers again (left in place, they go with the loop)."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, event.set)

    def remove() -> None:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)

    return remove


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
        stop_on_signals(stop)
        await stop.wait()
    finally:
        log.info("shutting down")
        if on_stop is not None:
            on_stop()
        for each in runners:
            await each.cleanup()


def metrics_handler(
    registry: CollectorRegistry, in_thread: bool = False
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /metrics`` of ``registry``; ``in_thread`` collects off the event loop (a collector that
    reads files or takes locks)."""

    async def handle(request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, registry) if in_thread else generate_latest(registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return handle


def component_app(
    metrics: Callable[[web.Request], Awaitable[web.Response]],
    auth_token: AuthToken | None,
    open_routes: Collection[tuple[str, str]],
    log: logging.Logger,
    client_max_size: int,
    count_refusal: Callable[[str], None] | None = None,
    cancel_on_disconnect: bool = False,
) -> web.Application:
    """A component's app: the run's token on every route but ``open_routes``, and ``GET /metrics``;
    ``count_refusal`` counts the refused requests (:func:`mixrl.rl.auth.refusal_counter`);
    ``cancel_on_disconnect`` cancels a request's handler when its client goes away (aiohttp's
    ``handler_cancellation``, off by default), so work done for that client stops."""
    app = web.Application(
        client_max_size=client_max_size,
        middlewares=auth_middlewares(auth_token, open_routes, log, count_refusal),
        handler_args={"handler_cancellation": cancel_on_disconnect},
    )
    app.router.add_get("/metrics", metrics)
    return app


def metrics_app(metrics: Callable[[web.Request], Awaitable[web.Response]]) -> web.Application:
    """Only ``GET /metrics``, for a separate metrics port."""
    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


def serve_component(
    app: web.Application,
    metrics: Callable[[web.Request], Awaitable[web.Response]],
    args: argparse.Namespace,
    *,
    log: logging.Logger,
    on_listening: Callable[[int], None],
    shutdown_timeout: float = AIOHTTP_SHUTDOWN_TIMEOUT,
) -> None:
    """Serve ``app`` as :func:`add_listen_arguments`' flags in ``args`` say (and ``/metrics`` alone on
    ``--metrics-port``) until SIGTERM or SIGINT."""
    asyncio.run(
        serve_app(
            app,
            args.host,
            args.port,
            log=log,
            port_file=args.port_file,
            metrics_app=metrics_app(metrics) if args.metrics_port is not None else None,
            metrics_port=args.metrics_port,
            on_listening=on_listening,
            shutdown_timeout=shutdown_timeout,
        )
    )
