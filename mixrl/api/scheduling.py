"""The packing scheduler profile: kube-scheduler fills GPU nodes before it opens empty ones.

The default profile scores nodes ``LeastAllocated`` on CPU and memory only (GPUs do not count) and
spreads the replicas of one Deployment over nodes (``PodTopologySpread``'s system defaults), so
eight 1-GPU engine replicas land 1 + 1 + … over eight 8-GPU nodes and an 8-GPU trainer then finds
no whole node. The profile here scores ``MostAllocated`` with ``nvidia.com/gpu`` weighted far above
CPU and memory, gives that score more weight among the scoring plugins, and drops the implicit
spreading (a pod's own ``topologySpreadConstraints`` still hold).

Pure: the one place the profile is written. The test bed's kube-scheduler runs it beside the stock
default profile (``mixrl dev-cluster``), and the Helm chart ships it as a file for clusters that
configure their own scheduler (``charts/mixrl/files/scheduler/``; docs/operator.md, Packing GPU
pods).
"""

from __future__ import annotations

from mixrl.api.gpus import GPU_RESOURCE
from mixrl.api.kube_types import Obj

API_VERSION = "kubescheduler.config.k8s.io/v1"
KIND = "KubeSchedulerConfiguration"
DEFAULT_SCHEDULER = "default-scheduler"
PACKING_SCHEDULER = "mixrl-packing"
"""The profile's name: what a pod names in ``spec.schedulerName`` (the operator's ``--scheduler-name``)."""

PACKING_RESOURCE_WEIGHTS: dict[str, int] = {GPU_RESOURCE: 10, "cpu": 1, "memory": 1}
"""``MostAllocated`` weights: a GPU pod's score is mostly its node's GPU fill. Resources a node has
none of (GPUs on a CPU node) and extended resources a pod does not request are left out of the
score, so CPU-only pods are packed by CPU and memory alone."""
PACKING_SCORE_WEIGHT = 5
"""NodeResourcesFit's weight among the scoring plugins (1 by default): one more 1-GPU pod moves an
8-GPU node's fill by 12.5 points, which must outweigh the other plugins' preferences."""


def packing_profile(name: str = PACKING_SCHEDULER) -> Obj:
    """A profile of ``KubeSchedulerConfiguration.profiles`` that packs GPU pods onto the fewest nodes."""
    return {
        "schedulerName": name,
        "plugins": {"score": {"enabled": [{"name": "NodeResourcesFit", "weight": PACKING_SCORE_WEIGHT}]}},
        "pluginConfig": [
            {
                "name": "NodeResourcesFit",
                "args": {
                    "scoringStrategy": {
                        "type": "MostAllocated",
                        "resources": [
                            {"name": resource, "weight": weight}
                            for resource, weight in PACKING_RESOURCE_WEIGHTS.items()
                        ],
                    }
                },
            },
            # No system-default spreading of a workload's replicas over nodes and zones: packing
            # is the point. Constraints a pod spells out itself still apply.
            {"name": "PodTopologySpread", "args": {"defaultingType": "List"}},
        ],
    }


def scheduler_configuration(profiles: list[Obj], **settings: object) -> Obj:
    """A whole ``KubeSchedulerConfiguration`` (kube-scheduler's ``--config``): ``profiles`` and the
    top-level ``settings`` (``clientConnection``, ``leaderElection``…)."""
    return {"apiVersion": API_VERSION, "kind": KIND, **settings, "profiles": profiles}


def shipped_configuration() -> Obj:
    """What the chart ships: the stock default profile, untouched, and the packing profile beside it
    (one scheduler, so the two never race for the same GPUs)."""
    return scheduler_configuration([{"schedulerName": DEFAULT_SCHEDULER}, packing_profile()])
