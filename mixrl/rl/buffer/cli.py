"""``mixrl buffer``: the trajectory buffer as a process."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from mixrl.api.loader import load_resolved
from mixrl.api.resolve import BUFFER_PORT, ResolvedRun
from mixrl.api.trajectory_check import limits_of_run
from mixrl.rl.auth import AuthToken, add_auth_arguments, token_from_args, warn_if_open
from mixrl.rl.buffer.server import BufferServer, body_limit
from mixrl.rl.buffer.store import BufferLogError, TrajectoryBuffer
from mixrl.rl.serving import add_listen_arguments, listen_problem, serve_component

log = logging.getLogger("mixrl.buffer")


def model_vocab_size(path: str) -> int | None:
    """The vocabulary of the model at ``path`` (``vocab_size`` of its config.json, or of its
    ``text_config``), or None where that file cannot be read here (a ``tiny:`` model is built by
    the trainer's side; a cluster's model volume is not mounted in the buffer's pod)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") if isinstance(config, dict) else None):
        size = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


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
        required=True,
        help="resolved run as JSON: its name, groups per step, trajectories per group, max staleness",
    )
    parser.add_argument(
        "--model-path",
        default=None,
        help="the model's directory, whose config.json gives the vocabulary posted token ids are checked"
        " against (default: the spec's model.path; where neither is readable, the trainer checks them)",
    )
    add_listen_arguments(parser, BUFFER_PORT)
    add_auth_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    return parser


def _settings(args: argparse.Namespace) -> tuple[ResolvedRun, AuthToken | None]:
    if args.dir is None:
        raise ValueError("--dir: required (or set MIXRL_BUFFER_DIR)")
    problem = listen_problem(args)
    if problem is not None:
        raise ValueError(problem)
    run = load_resolved(args.config)  # a RunConfigError is a ValueError: one line
    return run, token_from_args(args)  # so is an AuthConfigError


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        run, auth_token = _settings(args)
    except ValueError as exc:
        print(f"mixrl buffer: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        trainer = run.trainer
        buffer = TrajectoryBuffer(
            args.dir, trainer.prompts_per_update, trainer.samples_per_prompt, trainer.max_staleness
        )
    except (BufferLogError, OSError) as exc:
        print(f"mixrl buffer: --dir: {exc}", file=sys.stderr)
        return 2
    model_path = args.model_path or run.model.path
    vocab_size = model_vocab_size(model_path)
    if vocab_size is None:
        log.info(
            "token ids are checked against the vocabulary by the trainer, not here: %s has no "
            "config.json this process can read",
            model_path,
        )
    limits = limits_of_run(run, vocab_size)
    server = BufferServer(buffer, limits, auth_token, max_body_bytes=body_limit(run))

    def announce(bound: int) -> None:
        state = buffer.state
        log.info(
            "listening on http://%s:%d; %d prompts × %d samples per update, max staleness %s, bodies up to %d MiB",
            args.host,
            bound,
            state.prompts_per_update,
            state.samples_per_prompt,
            state.max_staleness,
            server.max_body_bytes >> 20,
        )
        warn_if_open(auth_token, log, "post trajectories, take batches and commit steps")

    try:  # until SIGTERM or SIGINT; every acknowledged write is already on disk
        serve_component(
            server.app(), server.metrics, args, log=log, on_listening=announce, shutdown_timeout=5.0
        )
    finally:
        buffer.close()
    return 0
