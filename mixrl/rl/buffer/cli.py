"""``mixrl buffer``: the trajectory buffer as a process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from mixrl.api.resolve import BUFFER_PORT, ResolvedRun
from mixrl.rl.auth import AuthToken, add_auth_arguments, token_from_args, warn_if_open
from mixrl.rl.buffer.server import BufferServer
from mixrl.rl.buffer.store import BufferLogError, TrajectoryBuffer
from mixrl.rl.serving import add_listen_arguments, listen_problem, serve_app

log = logging.getLogger("mixrl.buffer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixrl buffer",
        description="Collect trajectories, group them by prompt, hand full groups to the trainer; durable.",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=os.environ.get("MIXRL_BUFFER_DIR") or None,
        help="directory of the append-only logs (default: $MIXRL_BUFFER_DIR)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="resolved run as JSON: supplies --run and the three sizes below",
    )
    parser.add_argument("--prompts-per-update", type=int, default=None, help="groups per trainer step")
    parser.add_argument("--samples-per-prompt", type=int, default=None, help="trajectories per group")
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="drop groups whose oldest token is more than this many versions behind the step",
    )
    parser.add_argument("--run", default=None, help="run name for metric labels")
    add_listen_arguments(parser, BUFFER_PORT)
    add_auth_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    return parser


def _settings(args: argparse.Namespace) -> tuple[str, int, int, int | None, AuthToken | None]:
    """(run, prompts_per_update, samples_per_prompt, max_staleness, token); flags override --config."""
    if args.dir is None:
        raise ValueError("--dir: required (or set MIXRL_BUFFER_DIR)")
    problem = listen_problem(args)
    if problem is not None:
        raise ValueError(problem)
    run, prompts, samples, staleness = "", None, None, None
    if args.config is not None:
        try:
            resolved = ResolvedRun.model_validate_json(args.config.read_text())
        except OSError as exc:
            raise ValueError(f"--config: cannot read {args.config}: {exc}") from None
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"])
            raise ValueError(f"--config: {args.config}: {where}: {error['msg']}") from None
        trainer = resolved.trainer
        run, prompts, samples, staleness = (
            resolved.name,
            trainer.prompts_per_update,
            trainer.samples_per_prompt,
            trainer.max_staleness,
        )
    run = args.run if args.run is not None else run
    prompts = args.prompts_per_update if args.prompts_per_update is not None else prompts
    samples = args.samples_per_prompt if args.samples_per_prompt is not None else samples
    staleness = args.max_staleness if args.max_staleness is not None else staleness
    if prompts is None:
        raise ValueError("--prompts-per-update: required (or give --config)")
    if samples is None:
        raise ValueError("--samples-per-prompt: required (or give --config)")
    if prompts < 1:
        raise ValueError(f"--prompts-per-update: must be ≥ 1, got {prompts}")
    if samples < 1:
        raise ValueError(f"--samples-per-prompt: must be ≥ 1, got {samples}")
    if staleness is not None and staleness < 0:
        raise ValueError(f"--max-staleness: must be ≥ 0, got {staleness}")
    # Last, so that a bad size is reported as such; an AuthConfigError is a ValueError: one line.
    return run, prompts, samples, staleness, token_from_args(args)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        run, prompts, samples, staleness, auth_token = _settings(args)
    except ValueError as exc:
        print(f"mixrl buffer: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        buffer = TrajectoryBuffer(args.dir, prompts, samples, staleness)
    except (BufferLogError, OSError) as exc:
        print(f"mixrl buffer: --dir: {exc}", file=sys.stderr)
        return 2
    try:
        server = BufferServer(buffer, run, auth_token)
        asyncio.run(serve(server, args.host, args.port, args.port_file, args.metrics_port))
    finally:
        buffer.close()
    return 0


async def serve(
    server: BufferServer, host: str, port: int, port_file: Path | None, metrics_port: int | None = None
) -> None:
    """Serve until SIGTERM or SIGINT; every acknowledged write is already on disk."""

    def announce(bound: int) -> None:
        state = server.buffer.state
        log.info(
            "listening on http://%s:%d; %d prompts × %d samples per update, max staleness %s",
            host,
            bound,
            state.prompts_per_update,
            state.samples_per_prompt,
            state.max_staleness,
        )
        warn_if_open(server.auth_token, log, "post trajectories, take batches and commit steps")

    await serve_app(
        server.app(),
        host,
        port,
        log=log,
        port_file=port_file,
        metrics_app=server.metrics_app() if metrics_port is not None else None,
        metrics_port=metrics_port,
        on_listening=announce,
        shutdown_timeout=5.0,
    )
