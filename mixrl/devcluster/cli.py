"""``mixrl dev-cluster up|down|status``: a real Kubernetes control plane on this machine.

    mixrl dev-cluster up                      # etcd, API server, controller-manager, scheduler, KWOK
    mixrl dev-cluster up --real-nodes 1       # … and a real CPU node where pods run (as root)
    mixrl dev-cluster up --kueue              # … and Kueue, with queues for the fleet's GPU types (as root)
    mixrl dev-cluster up --keda               # … and KEDA (operator, external metrics API server)
    export KUBECONFIG=~/.cache/mixrl/dev-cluster/kubeconfig
    kubectl get nodes -L nvidia.com/gpu.product
    mixrl dev-cluster down                    # stops everything, removes the cluster's data

The binaries come from ``scripts/k8s-bin.sh`` (built once from pinned Go modules, then cached).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from mixrl.api.plain_text import plain_text
from mixrl.devcluster.addons import kueue_queue_objects, local_queue, start_addon, start_keda
from mixrl.devcluster.cluster import Cluster, ClusterError, default_dir
from mixrl.devcluster.kwok_fleet import DEFAULT_FLEET, describe, parse_fleet


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mixrl dev-cluster", description=plain_text(__doc__).split("\n\n")[0]
    )
    parser.add_argument("--dir", type=Path, default=None, help=f"run directory (default {default_dir()})")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start the control plane and the simulated fleet")
    up.add_argument(
        "--fleet",
        default=DEFAULT_FLEET,
        help="node groups <gpuType>=<nodes>[x<gpusPerNode>], comma-separated, or a file holding them "
        f"(default {DEFAULT_FLEET})",
    )
    up.add_argument(
        "--real-nodes",
        type=int,
        default=0,
        help="real CPU nodes (kubelet, containerd, kube-proxy; needs root) beside the KWOK fleet, "
        "so pods really run (default 0)",
    )
    up.add_argument(
        "--images",
        action="store_true",
        help="build the project's images (scripts/images.sh, cached) and import them into the real nodes; "
        "writes <dir>/chart-values.yaml for `helm install -f`",
    )
    up.add_argument(
        "--kueue",
        action="store_true",
        help="run Kueue beside the control plane (scripts/k8s-addons.sh builds it; needs root), with a "
        "ResourceFlavor per GPU type, the ClusterQueue mixrl holding the fleet's GPUs and the LocalQueue mixrl "
        "in namespace default",
    )
    up.add_argument(
        "--keda",
        action="store_true",
        help="run KEDA's operator and metrics API server beside the control plane (scripts/k8s-addons.sh "
        "builds them), the latter registered as the external metrics API, for autoscaling.engine keda",
    )
    up.add_argument("--volumes", type=int, default=8, help="pre-created PersistentVolumes (default 8)")
    up.add_argument("--timeout", type=float, default=90.0, help="seconds each component may take to start")
    commands.add_parser("down", help="stop every process and remove the cluster's data")
    status = commands.add_parser("status", help="which components run, API readiness, Ready nodes")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cluster = Cluster(args.dir)
    try:
        if args.command == "up":
            spec = Path(args.fleet).read_text() if Path(args.fleet).is_file() else args.fleet
            groups = parse_fleet(spec.replace("\n", ","))
            if args.volumes < 0:
                raise ValueError("--volumes: must be 0 or more")
            if args.kueue and os.geteuid() != 0:
                # Before the bed starts: Kueue reads its metrics certificate from a fixed path
                # under /etc, bound there in a mount namespace of its own.
                raise ClusterError("--kueue: needs root (a mount point under /etc and `unshare --mount`)")
            print(f"dev-cluster: starting in {cluster.dir} with {describe(groups)}")
            state = cluster.up(groups, volumes=args.volumes, timeout=args.timeout, real_nodes=args.real_nodes,
                               with_images=args.images)  # fmt: skip
            try:
                if args.kueue:
                    start_addon(cluster, state, "kueue", timeout=args.timeout)
                    queues = [*kueue_queue_objects(groups), local_queue("default", "mixrl", "mixrl")]
                    cluster.kubectl(state, "apply", "-f", "-", input=yaml.safe_dump_all(queues))
                if args.keda:
                    start_keda(cluster, state, timeout=args.timeout)
            except BaseException:
                cluster.down(log=lambda _: None)
                raise
            return 0
        if args.command == "down":
            cluster.down()
            return 0
        status = cluster.status()
        if args.json:
            print(json.dumps(status, indent=2))
        elif not status.get("components"):
            print(f"dev-cluster: not running ({status['dir']})")
        else:
            parts = ", ".join(
                f"{name} {'up' if alive else 'DOWN'}" for name, alive in status["components"].items()
            )
            print(f"dev-cluster: {parts}")
            if "readyz" in status:
                print(f"dev-cluster: API {'ready' if status['readyz'] else 'NOT ready'} at {status['server']}, "
                      f"{status['ready_nodes']} nodes Ready; KUBECONFIG={status['kubeconfig']}")  # fmt: skip
        return 0 if status.get("running") else 1
    except ValueError as exc:
        print(f"mixrl dev-cluster: {exc}", file=sys.stderr)
        return 2
    except (ClusterError, OSError) as exc:  # OSError: a file or a permission the bed needs
        print(f"mixrl dev-cluster: {exc}", file=sys.stderr)
        return 1
