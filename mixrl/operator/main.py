"""``mixrl operator``: run the kopf operator for one or more namespaces or the whole cluster.

In a cluster it logs in with its service account; with ``--dev`` it uses your kubeconfig and a
high peering priority, so it takes over from the in-cluster operator while it runs (kopf's
development mode).  Peering makes sure only one operator acts at a time: the chart creates the
(Cluster)KopfPeering object named by ``--peering``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from mixrl.operator.objects import Images

DEV_PRIORITY = 666  # kopf's convention: a developer's operator outranks the deployed one


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mixrl operator",
        description="Run the mixrl Kubernetes operator for some namespaces or the whole cluster.",
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="watch this namespace (repeatable)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--peering", default="mixrl", help="kopf peering object name (default: mixrl)")
    parser.add_argument("--standalone", action="store_true", help="no peering (only one operator may run)")
    parser.add_argument("--priority", type=int, default=None, help="peering priority (highest one acts)")
    parser.add_argument(
        "--dev", action="store_true", help="kubeconfig login, verbose logs, peering priority 666"
    )
    parser.add_argument(
        "--components-image",
        default=Images().components,
        help="image of router, rollout, buffer and weight sync",
    )
    parser.add_argument(
        "--monitoring",
        choices=("auto", "podmonitor", "annotations"),
        default="auto",
        help="PodMonitor (Prometheus Operator) or scrape annotations; auto asks API discovery",
    )
    parser.add_argument(
        "--keda",
        choices=("auto", "on", "off"),
        default="auto",
        help="ScaledObjects for runs with autoscaling.engine keda; auto asks API discovery for keda.sh",
    )
    parser.add_argument(
        "--no-builtin-autoscaler",
        dest="builtin_autoscaler",
        action="store_false",
        help="do not run the built-in autoscaler (pools of builtin runs keep their replicas)",
    )
    parser.add_argument(
        "--drain-seconds", type=int, default=300, help="how long engines may drain on shutdown"
    )
    parser.add_argument(
        "--liveness", default=None, metavar="URL", help="health endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.drain_seconds < 0:
        parser.error("--drain-seconds: must be 0 or more")
    if args.namespaces and any(not ns for ns in args.namespaces):
        parser.error("--namespace: must not be empty")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import kopf  # late: `mixrl operator --help` should not pay for kopf

    from mixrl.operator.autoscaling_loop import LoopSettings
    from mixrl.operator.handlers import OperatorConfig, build_registry

    kopf.configure(verbose=args.verbose or args.dev, debug=args.verbose)
    logging.getLogger("mixrl").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    config = OperatorConfig(
        images=Images(components=args.components_image),
        monitoring=args.monitoring,
        drain_seconds=args.drain_seconds,
        keda=args.keda,
        autoscaling=LoopSettings() if args.builtin_autoscaler else None,
        login=kopf.login_via_client if args.dev else None,
    )
    registry, _ = build_registry(config)
    priority = DEV_PRIORITY if args.dev and args.priority is None else args.priority
    kopf.run(
        registry=registry,
        clusterwide=args.all_namespaces,
        namespaces=args.namespaces or (),
        peering_name=None if args.standalone else args.peering,
        standalone=args.standalone,
        priority=priority,
        liveness_endpoint=args.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
