"""``mixrl operator``: run the kopf operator for one or more namespaces or the whole cluster.

In a cluster it logs in with its service account; with ``--dev`` it uses your kubeconfig and a
high peering priority, so it takes over from the in-cluster operator while it runs (kopf's
development mode).  Peering makes sure only one operator acts at a time: the chart creates the
(Cluster)KopfPeering object named by ``--peering``.

kopf pauses *every* operator that sees a live peer with its own priority, so replicas of one
Deployment must not share one: the chart passes ``--replica-id $(POD_NAME)`` and each replica takes
a distinct priority below zero from it.  The highest acts, the others wait as warm standbys and
take over when its peering record expires; ``--dev`` (666) and an operator started by hand
(kopf's default, 0) outrank them all.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import re
import sys
from collections.abc import Callable
from typing import TypeVar

from mixrl.api.gpus import GPU_TABLE
from mixrl.operator.builders import labels as L
from mixrl.operator.builders.objects import Images, Scrapers
from mixrl.operator.install.cluster_policy import Policy, flag_problem, prefix_problem, unique

DEV_PRIORITY = 666  # kopf's convention: a developer's operator outranks the deployed one
REPLICA_PRIORITY_SPAN = 10**9
PEERING = "mixrl"
STATUS_SECONDS = 15.0
STATUS_WRITE_SECONDS = 30.0
"""Replica priorities lie in [-SPAN, -1]: two replicas collide with odds of about one in a billion."""

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
T = TypeVar("T")
OWN_LABELS = frozenset({L.NAME, L.INSTANCE, L.COMPONENT, L.MANAGED_BY})
"""Labels the operator sets on each run's objects; a PodMonitor label may not replace them."""


def replica_priority(replica_id: str) -> int:
    """A stable peering priority below zero for one operator replica (its pod name)."""
    digest = int.from_bytes(hashlib.sha256(replica_id.encode()).digest()[:8], "big")
    return -1 - digest % REPLICA_PRIORITY_SPAN


def image_problem(reference: str) -> str | None:
    """Why an image reference is not pinned, or None: a tag other than ``latest``, or a digest."""
    if not reference or any(c.isspace() for c in reference):
        return f"{reference!r} is not an image reference"
    if "@" in reference:
        return None
    name = reference.rsplit("/", 1)[-1]
    if ":" not in name:
        return f"{reference} has no tag; pin a version (name:tag or name@sha256:digest)"
    if name.rsplit(":", 1)[1] == "latest":
        return f"{reference} uses :latest, which moves under running pods; pin a version"
    return None


def dns_name_problem(value: str) -> str | None:
    if len(value) <= 253 and DNS_SUBDOMAIN.match(value):
        return None
    return f"{value!r} is not a DNS subdomain name (lowercase letters, digits, '-', '.')"


def dns_label_problem(value: str) -> str | None:
    if len(value) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", value):
        return None
    return f"{value!r} is not a DNS label (at most 63 lowercase letters, digits and '-')"


def label_problem(key: str, value: str) -> str | None:
    """Why ``key=value`` is not a Kubernetes label, or None."""
    prefix, _, name = key.rpartition("/")
    if prefix and dns_name_problem(prefix) is not None:
        return f"the prefix of {key!r} is not a DNS subdomain"
    if not (len(name) <= 63 and LABEL_NAME.match(name)):
        return f"{key!r} is not a label key (a name of at most 63 letters, digits, '-', '_', '.')"
    if value and not (len(value) <= 63 and LABEL_NAME.match(value)):
        return f"{value!r} is not a label value (at most 63 letters, digits, '-', '_', '.')"
    return None


def parse_label(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals:
        raise ValueError(f"{text!r}: expected KEY=VALUE")
    problem = label_problem(key, value)
    if problem is not None:
        raise ValueError(problem)
    return key, value


def parse_gpu_node_label(text: str) -> tuple[str, str, str]:
    """``GPUTYPE:KEY=VALUE`` -> (gpu type, key, value)."""
    gpu_type, colon, label = text.partition(":")
    if not colon:
        raise ValueError(
            f"{text!r}: expected GPUTYPE:KEY=VALUE, e.g. H100:cloud.google.com/gke-accelerator=nvidia-h100-80gb"
        )
    if gpu_type not in GPU_TABLE or GPU_TABLE[gpu_type].emulated:
        known = ", ".join(t for t, gpu in GPU_TABLE.items() if not gpu.emulated)
        raise ValueError(f"unknown GPU type {gpu_type!r}; known: {known}")
    return (gpu_type, *parse_label(label))


def repeatable(group: argparse._ActionsContainer, flag: str, dest: str, metavar: str, help: str) -> None:
    """A flag that may be given many times: its values are collected in order (none: an empty list)."""
    group.add_argument(flag, action="append", default=[], dest=dest, metavar=metavar, help=help)


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
    parser.add_argument("--peering", default=None, help=f"kopf peering object name (default: {PEERING})")
    parser.add_argument("--standalone", action="store_true", help="no peering (only one operator may run)")
    ranking = parser.add_mutually_exclusive_group()
    ranking.add_argument("--priority", type=int, default=None, help="peering priority (highest one acts)")
    ranking.add_argument(
        "--replica-id",
        metavar="ID",
        help="this replica's identity (the pod name): replicas get distinct priorities below 0 from it",
    )
    parser.add_argument(
        "--dev", action="store_true", help="kubeconfig login, verbose logs, peering priority 666"
    )
    defaults = Images()
    images = parser.add_argument_group("images (each pinned: name:tag or name@digest, never :latest)")
    images.add_argument(
        "--components-image", default=defaults.components, help="router, rollout, buffer and weight sync"
    )
    images.add_argument("--trainer-image", default=defaults.trainer_torch, help="trainer with backend torch")
    images.add_argument(
        "--megatron-trainer-image", default=defaults.trainer_megatron, help="trainer with backend megatron"
    )
    images.add_argument("--torch-engine-image", default=defaults.torch_engine, help="pools with engine torch")
    images.add_argument("--sglang-image", default=defaults.sglang, help="pools with engine sglang")
    repeatable(
        images,
        "--image-pull-secret",
        "image_pull_secrets",
        "NAME",
        "a Secret in each run's namespace that every pod pulls with (repeatable)",
    )
    pods = parser.add_argument_group("the cluster's conventions for every run")
    pods.add_argument(
        "--weights-storage-class",
        metavar="NAME",
        help="StorageClass (ReadWriteMany) of weights volumes whose run names none",
    )
    repeatable(
        pods,
        "--pod-monitor-label",
        "pod_monitor_labels",
        "KEY=VALUE",
        "a label on each run's PodMonitor, e.g. release=kube-prometheus-stack (repeatable)",
    )
    repeatable(
        pods,
        "--gpu-node-label",
        "gpu_node_labels",
        "GPUTYPE:KEY=VALUE",
        "a node label that identifies a GPU type's nodes without GPU Feature Discovery (repeatable)",
    )
    packing = parser.add_argument_group(
        "packing: GPU pods fill nodes before they open empty ones (docs/operator.md, Packing GPU pods)"
    )
    packing.add_argument(
        "--no-gpu-pod-packing",
        dest="pack_gpu_pods",
        action="store_false",
        help="GPU pods get no preferred pod affinity toward nodes running GPU pods of their run",
    )
    packing.add_argument(
        "--scheduler-name",
        metavar="NAME",
        help="the scheduler profile every GPU pod names (spec.schedulerName), e.g. mixrl-packing; "
        "it must be served, or the pods stay Pending (default: the cluster's default scheduler)",
    )
    kueue = parser.add_argument_group(
        "gang admission: Kueue admits each run whole (docs/operator.md, Gang admission with Kueue)"
    )
    kueue.add_argument(
        "--default-queue",
        metavar="NAME",
        help="the Kueue LocalQueue (in each run's namespace) of runs whose spec.scheduling.queue is unset "
        "(default: none; such runs start at once, without Kueue)",
    )
    kueue.add_argument(
        "--kueue-workload-priority",
        action="store_true",
        help="a queued run's Workload takes the priority of its pods' PriorityClass, by which Kueue orders "
        "its queue and preempts; reads PriorityClasses (RBAC: the chart's kueue.workloadPriority)",
    )
    network = parser.add_argument_group("network policies: only a run's own components reach each other")
    network.add_argument(
        "--no-network-policies",
        dest="network_policies",
        action="store_false",
        help="create none of the runs' ingress NetworkPolicies (the platform manages policies itself); "
        "a sandbox run's <run>-sandbox deny-all, the sandboxes' containment, stays",
    )
    repeatable(
        network,
        "--scraper-pod-label",
        "scraper_pod_labels",
        "KEY=VALUE",
        "the metrics scrapers are the pods with all these labels (repeatable; "
        "none: app.kubernetes.io/name=prometheus)",
    )
    network.add_argument(
        "--scraper-namespace", metavar="NAME", help="the metrics scrapers' namespace (default: any namespace)"
    )
    policy = parser.add_argument_group(
        "policy: what an RLRun may ask for (a run asking for more is marked PolicyViolation, nothing of it created)"
    )
    repeatable(
        policy,
        "--allowed-image-prefix",
        "allowed_image_prefixes",
        "PREFIX",
        "an RLRun's own images (trainer.image, a pool's image, rollout.sandbox.image) must start with one of these, "
        "e.g. registry.example.com/rl/ (repeatable; none: any image)",
    )
    policy.add_argument(
        "--no-engine-args",
        dest="allow_engine_args",
        action="store_false",
        help="no pool may pass extra engine arguments (engineArgs)",
    )
    repeatable(
        policy,
        "--allowed-engine-flag",
        "allowed_engine_flags",
        "FLAG",
        "the only flags engineArgs may hold, written with '=': --allowed-engine-flag=--tokenizer-path "
        "(repeatable; none: any flag)",
    )
    policy.add_argument(
        "--no-scheduling-overrides",
        dest="allow_scheduling",
        action="store_false",
        help="no nodeSelector, tolerations or gpuProducts in the trainer's or a pool's scheduling "
        "(and no priorityClassName unless --allowed-priority-class lists it)",
    )
    repeatable(
        policy,
        "--allowed-priority-class",
        "allowed_priority_classes",
        "NAME",
        "the priority classes a run may name (repeatable; none: any, unless --no-scheduling-overrides)",
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
    status = parser.add_argument_group("live status: RLRun and SamplerPool figures from Prometheus")
    status.add_argument(
        "--no-live-status",
        dest="live_status",
        action="store_false",
        help="write no figures, no phase end and no CollapseRisk (the reconcilers' conditions stay)",
    )
    status.add_argument(
        "--explain-placement",
        action="store_true",
        help="a run whose pod cannot be placed is told the free GPUs of the nodes it may use and which runs "
        "hold them; reads every node and every namespace's pods (RBAC: the chart's placement.explain)",
    )
    status.add_argument(
        "--status-seconds",
        type=float,
        default=None,
        help=f"read each run's figures this often (default {STATUS_SECONDS:g})",
    )
    status.add_argument(
        "--status-write-seconds",
        type=float,
        default=None,
        help="write one object's status at most this often, phase and CollapseRisk flips excepted "
        f"(default {STATUS_WRITE_SECONDS:g})",
    )
    parser.add_argument(
        "--drain-seconds", type=int, default=300, help="how long engines may drain on shutdown"
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=60.0,
        help="re-check every run against the cluster this often; 0 turns the periodic resync off (default 60)",
    )
    parser.add_argument(
        "--liveness", default=None, metavar="URL", help="health endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.drain_seconds < 0:
        parser.error("--drain-seconds: must be 0 or more")
    for flag, value in (
        ("--status-seconds", args.status_seconds),
        ("--status-write-seconds", args.status_write_seconds),
    ):
        if value is not None and (not value > 0 or value == float("inf")):
            parser.error(f"{flag}: must be a number of seconds above 0, got {value}")
        if value is not None and not args.live_status:
            parser.error(
                f"{flag}: sets the live status, which --no-live-status turns off; drop one of the two"
            )
    args.status_seconds = STATUS_SECONDS if args.status_seconds is None else args.status_seconds
    if args.status_write_seconds is None:
        args.status_write_seconds = STATUS_WRITE_SECONDS
    if args.explain_placement and not args.live_status:
        parser.error("--explain-placement: the explanation is part of the live status; drop --no-live-status")
    if not 0 <= args.resync_seconds < float("inf"):
        parser.error(f"--resync-seconds: must be a number of seconds, 0 or more, got {args.resync_seconds}")
    if args.standalone:
        for flag, given in (("--peering", args.peering), ("--priority", args.priority)):
            if given is not None:
                parser.error(f"{flag}: a standalone operator has no peering; drop one of the two")
    args.peering = PEERING if args.peering is None else args.peering
    if not args.network_policies:
        for flag, given in (
            ("--scraper-pod-label", args.scraper_pod_labels),
            ("--scraper-namespace", args.scraper_namespace),
        ):
            if given:
                parser.error(
                    f"{flag}: names who may scrape through the network policies, which --no-network-policies turns off"
                )
    if args.namespaces and any(not ns for ns in args.namespaces):
        parser.error("--namespace: must not be empty")
    if args.standalone and args.replica_id:
        parser.error("--replica-id: a standalone operator has no peers; run one replica")
    if args.replica_id is not None and not args.replica_id:
        parser.error("--replica-id: must not be empty")
    for flag in ("components", "trainer", "megatron_trainer", "torch_engine", "sglang"):
        problem = image_problem(getattr(args, f"{flag}_image"))
        if problem is not None:
            parser.error(f"--{flag.replace('_', '-')}-image: {problem}")
    for name in args.image_pull_secrets:
        if (problem := dns_name_problem(name)) is not None:
            parser.error(f"--image-pull-secret: {problem}")
    storage_class = args.weights_storage_class
    if storage_class is not None and (problem := dns_name_problem(storage_class)) is not None:
        parser.error(f"--weights-storage-class: {problem}")
    args.pod_monitor_labels = parsed(parser, "--pod-monitor-label", args.pod_monitor_labels, parse_label)
    for key, _ in args.pod_monitor_labels:
        if key in OWN_LABELS:
            parser.error(f"--pod-monitor-label: {key} is the operator's own label on each run's objects")
    args.scraper_pod_labels = parsed(parser, "--scraper-pod-label", args.scraper_pod_labels, parse_label)
    scraper_namespace = args.scraper_namespace
    if scraper_namespace is not None and (problem := dns_name_problem(scraper_namespace)) is not None:
        parser.error(f"--scraper-namespace: {problem}")
    args.gpu_node_labels = parsed(parser, "--gpu-node-label", args.gpu_node_labels, parse_gpu_node_label)
    if args.scheduler_name is not None and (problem := dns_name_problem(args.scheduler_name)) is not None:
        parser.error(f"--scheduler-name: {problem}")
    if args.default_queue is not None and (problem := dns_label_problem(args.default_queue)) is not None:
        parser.error(f"--default-queue: {problem}")
    for prefix in args.allowed_image_prefixes:
        if (problem := prefix_problem(prefix)) is not None:
            parser.error(f"--allowed-image-prefix: {problem}")
    for flag in args.allowed_engine_flags:
        if (problem := flag_problem(flag)) is not None:
            parser.error(f"--allowed-engine-flag: {problem}")
    if args.allowed_engine_flags and not args.allow_engine_args:
        parser.error("--allowed-engine-flag: allows nothing with --no-engine-args; give one of the two")
    for name in args.allowed_priority_classes:
        if (problem := dns_name_problem(name)) is not None:
            parser.error(f"--allowed-priority-class: {problem}")
    return args


def parsed(
    parser: argparse.ArgumentParser, flag: str, values: list[str], parse: Callable[[str], T]
) -> list[T]:
    """Each value parsed, or the parser's usage error naming the flag and the bad value."""
    out = []
    for value in values:
        try:
            out.append(parse(value))
        except ValueError as exc:
            parser.error(f"{flag}: {exc}")
    return out


def images_of(args: argparse.Namespace) -> Images:
    selectors: dict[str, dict[str, str]] = {}
    for gpu_type, key, value in args.gpu_node_labels:
        selectors.setdefault(gpu_type, {})[key] = value
    return Images(
        components=args.components_image,
        trainer_torch=args.trainer_image,
        trainer_megatron=args.megatron_trainer_image,
        torch_engine=args.torch_engine_image,
        sglang=args.sglang_image,
        pull_secrets=tuple(dict.fromkeys(args.image_pull_secrets)),
        weights_storage_class=args.weights_storage_class,
        pod_monitor_labels=dict(args.pod_monitor_labels),
        gpu_node_selectors=selectors,
        pack_gpu_pods=args.pack_gpu_pods,
        scheduler_name=args.scheduler_name or None,
        network_policies=scrapers_of(args),
    )


def scrapers_of(args: argparse.Namespace) -> Scrapers | None:
    if not args.network_policies:
        return None
    labels = dict(args.scraper_pod_labels) or dict(Scrapers().pod_labels)
    return Scrapers(pod_labels=labels, namespace=args.scraper_namespace)


def policy_of(args: argparse.Namespace) -> Policy:
    return Policy(
        allowed_images=unique(args.allowed_image_prefixes),
        allow_engine_args=args.allow_engine_args,
        allowed_engine_flags=unique(args.allowed_engine_flags),
        allow_scheduling=args.allow_scheduling,
        allowed_priority_classes=unique(args.allowed_priority_classes),
    )


def peering_priority(args: argparse.Namespace) -> int | None:
    """``--priority``, else 666 with ``--dev``, else one below zero per replica, else kopf's (0)."""
    if args.priority is not None:
        return int(args.priority)
    if args.dev:
        return DEV_PRIORITY
    if args.replica_id:
        return replica_priority(args.replica_id)
    return None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import kopf  # late: `mixrl operator --help` should not pay for kopf

    from mixrl.operator.autoscaling.loop import LoopSettings
    from mixrl.operator.controller.handlers import build_registry
    from mixrl.operator.controller.observer import ObserverSettings
    from mixrl.operator.controller.runtime import OperatorConfig

    kopf.configure(verbose=args.verbose or args.dev, debug=args.verbose)
    logging.getLogger("mixrl").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    config = OperatorConfig(
        images=images_of(args),
        monitoring=args.monitoring,
        drain_seconds=args.drain_seconds,
        resync_interval_s=args.resync_seconds or None,
        keda=args.keda,
        policy=policy_of(args),
        default_queue=args.default_queue or None,
        workload_priority=args.kueue_workload_priority,
        autoscaling=LoopSettings() if args.builtin_autoscaler else None,
        live_status=(
            ObserverSettings(
                interval_s=args.status_seconds,
                min_write_interval_s=args.status_write_seconds,
                explain_placement=args.explain_placement,
            )
            if args.live_status
            else None
        ),
        login=kopf.login_via_client if args.dev else None,
    )
    registry, _ = build_registry(config)
    priority = peering_priority(args)
    if not args.standalone:
        logging.getLogger("mixrl.operator").info("peering %r with priority %s", args.peering, priority or 0)
    if config.policy.restricts:
        logging.getLogger("mixrl.operator").info("policy: %s", config.policy)
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
