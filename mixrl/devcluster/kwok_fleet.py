"""The simulated fleet of the local test bed: KWOK nodes labelled as GPU Feature Discovery labels
real GPU nodes, built from the GPU table (pure functions, no I/O).

A fleet is a list of node groups, ``<gpuType>=<nodes>[x<gpus>]`` (``cpu=3`` for CPU-only nodes that
run the control components: router, buffer, rollout workers). The default is the paper's mix, with
enough H200 nodes for the example trainer (4 nodes x 8 GPUs) beside the H200 pools.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_RESOURCE, GPU_TABLE

# KWOK manages only nodes carrying this annotation (its --manage-nodes-with-annotation-selector).
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"
# The taint the NVIDIA device plugin's deployments put on GPU nodes; GPU pods tolerate it.
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
# Simulated nodes are labelled so a test (or a person) can tell them from real ones.
FLEET_LABEL = "mixrl.dev/simulated-node"

DEFAULT_FLEET = "H200=6,H100=2,B200=2,B300=2,A100=2,RTX-PRO-6000=2,cpu=3"
_GROUP = re.compile(r"^(?P<gpu>[A-Za-z0-9-]+)=(?P<nodes>\d+)(?:x(?P<gpus>\d+))?$")


@dataclass(frozen=True)
class NodeGroup:
    gpu_type: str
    """A key of the GPU table; ``cpu`` for CPU-only nodes."""
    nodes: int
    gpus_per_node: int = 8
    cpu: str = "64"
    memory: str = "512Gi"


def parse_fleet(text: str) -> list[NodeGroup]:
    """``H200=6,A100=2x4,cpu=3`` -> node groups; a bad group raises ValueError naming it."""
    groups: list[NodeGroup] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        match = _GROUP.match(part)
        if match is None:
            raise ValueError(f"--fleet: {part!r} is not <gpuType>=<nodes>[x<gpusPerNode>]")
        gpu_type = match["gpu"]
        if gpu_type not in GPU_TABLE:
            raise ValueError(f"--fleet: unknown GPU type {gpu_type!r}; known: {', '.join(GPU_TABLE)}")
        gpus = 0 if gpu_type == "cpu" else int(match["gpus"] or 8)
        if gpu_type != "cpu" and gpus <= 0:
            raise ValueError(f"--fleet: {part!r} needs at least one GPU per node")
        groups.append(NodeGroup(gpu_type, int(match["nodes"]), gpus))
    if not groups:
        raise ValueError("--fleet: no node groups given")
    return groups


def node_name(gpu_type: str, index: int) -> str:
    return f"kwok-{gpu_type.lower()}-{index}"


def gfd_labels(gpu_type: str, gpus: int) -> dict[str, str]:
    """The labels GPU Feature Discovery writes on a node with ``gpus`` GPUs of this type."""
    gpu = GPU_TABLE[gpu_type]
    return {
        "nvidia.com/gpu.present": "true",
        GPU_PRODUCT_LABEL: gpu.gfd_products[0],
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.memory": str(gpu.memory_gib * 1024),  # MiB, as GFD reports it
        "nvidia.com/gpu.family": gpu.architecture.split()[0].lower(),
    }


def node(group: NodeGroup, index: int) -> dict:
    """One KWOK Node object (status included: KWOK keeps it, there is no kubelet to report it)."""
    name = node_name(group.gpu_type, index)
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        FLEET_LABEL: "true",
    }
    capacity = {"cpu": group.cpu, "memory": group.memory, "pods": "110", "ephemeral-storage": "1Ti"}
    spec: dict = {}
    if group.gpu_type != "cpu":
        labels |= gfd_labels(group.gpu_type, group.gpus_per_node)
        capacity[GPU_RESOURCE] = str(group.gpus_per_node)
        spec["taints"] = [GPU_TAINT]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION: KWOK_ANNOTATION_VALUE, "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": spec,
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


def fleet_nodes(groups: list[NodeGroup]) -> list[dict]:
    return [node(group, index) for group in groups for index in range(group.nodes)]


def describe(groups: list[NodeGroup]) -> str:
    parts = [
        f"{g.nodes} {g.gpu_type}" + (f" x{g.gpus_per_node} GPUs" if g.gpu_type != "cpu" else " CPU")
        for g in groups
    ]
    return ", ".join(parts)
