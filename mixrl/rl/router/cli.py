"""``mixrl router``: the session router as a process."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mixrl.api.loader import RunConfigError, load_resolved
from mixrl.api.resolve import ENGINE_PORT, ROUTER_PORT
from mixrl.rl.auth import AuthConfigError, add_auth_arguments, token_from_args, warn_if_open
from mixrl.rl.health.routing import policy_of
from mixrl.rl.router.config import RouterConfigError, from_resolved_run, load_replicas_file
from mixrl.rl.router.server import Router, RouterSettings, body_limit
from mixrl.rl.serving import add_listen_arguments, listen_problem, serve_component


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixrl router",
        description="Assign agent sessions to sampler pools by capacity, keep them there, proxy /generate.",
    )
    parser.add_argument(
        "--config", type=Path, required=True, help="resolved run as JSON: the pools and their capacities"
    )
    parser.add_argument(
        "--replicas",
        type=Path,
        default=None,
        help="file of each pool's replicas, {pool: [url, ...]} (mixrl run writes it); without it the "
        "router finds them by DNS (--discover-dns) or is told them (PUT /pools/{name})",
    )
    add_listen_arguments(parser, ROUTER_PORT)
    parser.add_argument("--run", default="", help="run name for metric labels (default: from the config)")
    parser.add_argument(
        "--discover-dns",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="find each pool's replicas by resolving its headless Service <run>-<pool> "
        "(default: on without --replicas)",
    )
    parser.add_argument(
        "--dns-suffix", default=None, help="appended to <run>-<pool> for discovery (default .<namespace>.svc)"
    )
    parser.add_argument(
        "--engine-port", type=int, default=ENGINE_PORT, help="engine port behind discovered IPs"
    )
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between replica probes")
    parser.add_argument(
        "--max-inflight-per-replica",
        type=int,
        default=0,
        help="hold requests above this many outstanding per replica (0 = no limit)",
    )
    parser.add_argument("--session-ttl", type=float, default=900.0, help="forget sessions idle this long (s)")
    parser.add_argument(
        "--request-timeout", type=float, default=900.0, help="longest /generate at a replica (s)"
    )
    parser.add_argument(
        "--buffer",
        default=None,
        help="buffer URL where the trainer's per-pool mismatch is read: required by mismatch-aware"
        " routing (spec.health.routing) and refused without it (the router then routes by capacity)",
    )
    add_auth_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    return parser


def _check(args: argparse.Namespace) -> str | None:
    for name in ("health_interval", "session_ttl", "request_timeout"):
        if getattr(args, name) <= 0:
            return f"--{name.replace('_', '-')}: must be > 0"
    if args.max_inflight_per_replica < 0:
        return "--max-inflight-per-replica: must be ≥ 0"
    if (problem := listen_problem(args)) is not None:
        return problem
    return None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    problem = _check(args)
    if problem:
        print(f"mixrl router: {problem}", file=sys.stderr)
        return 2
    try:
        run = load_resolved(args.config)
        replicas = load_replicas_file(args.replicas, run) if args.replicas is not None else None
        config = from_resolved_run(run, args.dns_suffix, replicas)
        auth_token = token_from_args(args)
    except (RunConfigError, RouterConfigError, AuthConfigError) as exc:
        print(f"mixrl router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = RouterSettings(
        run=args.run or config.run,
        health_interval=args.health_interval,
        request_timeout=args.request_timeout,
        max_inflight_per_replica=args.max_inflight_per_replica,
        session_ttl=args.session_ttl,
        discover_dns=args.replicas is None if args.discover_dns is None else args.discover_dns,
        engine_port=args.engine_port,
        auth_token=auth_token,
        max_request_bytes=body_limit(run.model.max_context_tokens),
        buffer_url=args.buffer,
        health_policy=policy_of(run.health.routing) if run.health.routing is not None else None,
    )
    if settings.health_policy is not None and args.buffer is None:
        print(
            "mixrl router: --buffer: required by spec.health.routing (the mismatch is read there)",
            file=sys.stderr,
        )
        return 2
    if settings.health_policy is None and args.buffer is not None:
        print(
            "mixrl router: --buffer: only read for spec.health.routing, which this run does not set"
            " (the router routes by capacity)",
            file=sys.stderr,
        )
        return 2
    router = Router(config, settings)
    log = logging.getLogger("mixrl.router")

    def announce(bound: int) -> None:
        pools = ", ".join(f"{p.name} ({len(p.replicas)} replicas)" for p in router.state.pools.values())
        log.info("listening on http://%s:%d; pools: %s", args.host, bound, pools)
        warn_if_open(auth_token, log, "reload every engine's weights and change pools")

    # Until SIGTERM or SIGINT, then a clean stop: in-flight requests get their answers.
    serve_component(router.app(), router.metrics, args, log=log, on_listening=announce)
    return 0
