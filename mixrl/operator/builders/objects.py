"""Building blocks of the desired objects: owners, options, hashes, metadata, Services, workloads.

Pure (no I/O); shared by :mod:`mixrl.operator.builders.resources` (the run's objects) and
:mod:`mixrl.operator.builders.pools` (each pool's objects).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mixrl import __version__
from mixrl.api.gpus import requested_gpus
from mixrl.api.kube_types import Obj
from mixrl.api.launch import weights_volume_path
from mixrl.api.memory import BYTES_PER_PARAMETER, GIB
from mixrl.api.models import Toleration, tiny_kind
from mixrl.api.resolve import MIXRL_IMAGE_PREFIX, SGLANG_IMAGE, ResolvedPool, ResolvedRun
from mixrl.api.trajectory import JSON_NUMBER_BYTES
from mixrl.operator.builders import labels as L
from mixrl.operator.builders.podspec import Footprint, gpu_scheduling, mount

HASH_ANNOTATION = "mixrl.dev/desired-hash"
"""On every object we write: hash of the desired object; equal hash => no write."""
CONFIG_HASH_ANNOTATION = "mixrl.dev/config-hash"
"""On pod templates: hash of the configuration the pods read, so a change rolls them."""
POOL_CONFIG_HASH_LABEL = "mixrl.dev/pool-config-hash"
"""On SamplerPools: changes when the run changes anything the pool's children are built from (the
Deployment's configuration; the autoscaling engine, and in KEDA mode the ScaledObject's settings),
which wakes the pool's own controller (it alone writes them).  A label, not an annotation: kopf's
change detection sees labels and the spec, not annotations."""

AUTH_TOKEN_HASH = "mixrl.dev/auth-token-hash"
"""The hash of the run's token (its ``<run>-auth`` Secret): an annotation on the pod template of every
workload of the run, and a label on each SamplerPool, whose controller stamps its engines' templates
from it (a label: kopf's change detection sees labels, not annotations).  Every process reads the
token once, at start (SGLang from its environment), so a token drawn anew (the Secret deleted, by
hand or to rotate it) must restart every pod of the run: otherwise the pods that happen to restart
take a token the others refuse."""

WEIGHTS_MOUNT = "weights"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
"""Set by the StatefulSet controller on each pod (Kubernetes ≥ 1.28)."""


class Monitoring(enum.Enum):
    POD_MONITOR = "podmonitor"
    """The Prometheus Operator's PodMonitor (when monitoring.coreos.com/v1 is served)."""
    ANNOTATIONS = "annotations"
    """``prometheus.io/scrape`` annotations on pod templates (plain Prometheus)."""


@dataclass(frozen=True)
class Owner:
    """The object a child belongs to; its uid makes the garbage collector delete the child with it."""

    api_version: str
    kind: str
    name: str
    uid: str

    def reference(self) -> Obj:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Set by the API server on every namespace (Kubernetes ≥ 1.22): selects a namespace by name."""


@dataclass(frozen=True)
class Scrapers:
    """Who may read the components' ``/metrics`` through the run's NetworkPolicies: pods with all of
    ``pod_labels``, in the namespace ``namespace`` (None: any namespace).  The default matches the
    Prometheus pods of kube-prometheus-stack and of the Prometheus Operator."""

    pod_labels: Mapping[str, str] = field(default_factory=lambda: {L.NAME: "prometheus"})
    namespace: str | None = None

    def peer(self) -> dict[str, Any]:
        namespaces = {} if self.namespace is None else {"matchLabels": {NAMESPACE_NAME_LABEL: self.namespace}}
        return {"namespaceSelector": namespaces, "podSelector": {"matchLabels": dict(self.pod_labels)}}


@dataclass(frozen=True)
class Images:
    """What every run's pods take from the platform rather than from the spec, set once per operator
    (flags of ``mixrl operator``, chart values): the images where a spec names none, how to pull
    them, and the cluster's storage, monitoring and GPU-node conventions.

    The chart passes each image pinned to the chart's version; these defaults are this package's
    version, so no pod ever runs a moving ``:latest``."""

    components: str = f"{MIXRL_IMAGE_PREFIX}-components:{__version__}"
    """Router, rollout, buffer and the engines' weight-sync sidecar."""
    trainer_torch: str = f"{MIXRL_IMAGE_PREFIX}-trainer-torch:{__version__}"
    """The trainer with ``backend: torch``."""
    trainer_megatron: str = f"{MIXRL_IMAGE_PREFIX}-trainer-megatron:{__version__}"
    """The trainer with ``backend: megatron``."""
    torch_engine: str = f"{MIXRL_IMAGE_PREFIX}-engine:{__version__}"
    """Pools with ``engine: torch``."""
    sglang: str = SGLANG_IMAGE
    """Pools with ``engine: sglang``: the official release (mixrl reaches it as the sidecar)."""
    pull_secrets: tuple[str, ...] = ()
    """Secrets (in each run's namespace) every pod the operator creates pulls its images with."""
    weights_storage_class: str | None = None
    """StorageClass of weights volumes whose run names none (``weights.storageClassName``)."""
    pod_monitor_labels: Mapping[str, str] = field(default_factory=dict)
    """Extra labels on each run's PodMonitor, for a Prometheus that selects monitors by label
    (kube-prometheus-stack: ``release: <its release name>``)."""
    gpu_node_selectors: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """GPU type -> node labels that identify its nodes where GPU Feature Discovery does not label
    ``nvidia.com/gpu.product``; an alternative (OR-ed) to the product affinity, not an addition."""
    pack_gpu_pods: bool = True
    """GPU pods prefer nodes already running GPU pods of their run, then of any run (a preferred
    pod affinity, :func:`mixrl.operator.builders.podspec.packing_affinity`); False: no preference."""
    scheduler_name: str | None = None
    """The scheduler (profile) every GPU pod names, e.g. ``mixrl-packing`` where the cluster's
    kube-scheduler serves :mod:`mixrl.api.scheduling`'s profile; None: the default scheduler."""
    network_policies: Scrapers | None = field(default_factory=Scrapers)
    """Each run gets NetworkPolicies (:mod:`mixrl.operator.builders.network`) letting these scrapers
    read its metrics; None: the operator creates none of the runs' ingress policies (the platform
    manages policies itself; a sandbox run's ``<run>-sandbox`` deny-all stays, builders/sandbox.py)."""

    def trainer(self, backend: str) -> str:
        return self.trainer_megatron if backend == "megatron" else self.trainer_torch

    def engine(self, engine: str) -> str:
        return self.sglang if engine == "sglang" else self.torch_engine


@dataclass(frozen=True)
class BuildOptions:
    images: Images = field(default_factory=Images)
    monitoring: Monitoring = Monitoring.ANNOTATIONS
    drain_seconds: int = 300
    """How long an engine may finish in-flight requests after it is asked to stop."""
    startup_minutes: int = 30
    """How long an engine may take to load its model before it counts as failed."""
    buffer_volume_size: str | None = None
    """The buffer's volume; None: derived from the run (:func:`buffer_volume_size`)."""
    keda: bool = False
    """The cluster serves KEDA's ScaledObjects (keda.sh/v1alpha1), found through API discovery."""
    keda_off: bool = False
    """The operator runs with ``--keda off``: no ScaledObjects, whatever the cluster serves."""
    builtin_autoscaler: bool = True
    """The operator runs its built-in autoscaler (not with ``--no-builtin-autoscaler``)."""


# ----------------------------------------------------------------------------- CPU and memory


def gib(value: float) -> str:
    return f"{max(1, math.ceil(value))}Gi"


def mib(value: float) -> str:
    """A memory quantity of at least ``value`` MiB (``534Mi``, ``2Gi``)."""
    whole = max(1, math.ceil(value))
    return f"{whole // 1024}Gi" if whole % 1024 == 0 else f"{whole}Mi"


def millicores(value: float) -> str:
    """A CPU quantity of at least ``value`` millicores (``500m``, ``1``)."""
    whole = max(1, math.ceil(value))
    return str(whole // 1000) if whole % 1000 == 0 else f"{whole}m"


def per_gpu(gpus: int, cpu: int, memory_gib: int, cpu_limit: int, memory_limit_gib: int) -> Footprint:
    return Footprint(
        str(cpu * gpus), gib(memory_gib * gpus), str(cpu_limit * gpus), gib(memory_limit_gib * gpus)
    )


def pool_gpus(pool: ResolvedPool) -> int:
    """The GPUs each of the pool's pods requests (none on an emulated type): its replica's, shared
    out over the nodes a replica spans (one pod each; validation keeps the division whole)."""
    return requested_gpus(pool.gpu_type, pool.gpus_per_replica // pool.nodes_per_replica)


def trainer_gpus(resolved: ResolvedRun) -> int:
    """The GPUs each trainer pod requests (none on ``gpuType: cpu``, where ``gpusPerNode`` counts
    processes)."""
    spec = resolved.trainer.spec
    return requested_gpus(spec.gpu_type, spec.gpus_per_node)


def uses_gpus(resolved: ResolvedRun) -> bool:
    return trainer_gpus(resolved) > 0 or any(pool_gpus(pool) > 0 for pool in resolved.pools)


COMPONENT_FOOTPRINTS: dict[str, Footprint] = {
    "router": Footprint("500m", "1Gi", "2", "2Gi"),
    "buffer": Footprint("1", "2Gi", "2", "8Gi"),  # whole groups wait in memory until trained on
    "rollout": Footprint("1", "2Gi", "4", "8Gi"),  # `concurrency` agent sessions and their tools
}
"""The CPU services of a run with GPUs, which feed engines of thousands of tokens per second."""
CPU_RUN_FOOTPRINTS: dict[str, Footprint] = {
    "router": Footprint("100m", "256Mi", "1", "1Gi"),
    "buffer": Footprint("100m", "256Mi", "1", "2Gi"),
    "rollout": Footprint("200m", "256Mi", "1", "2Gi"),
}
"""The same services in a run without GPUs: there the engines, on CPUs too, are the bottleneck and
the services idle between their few requests per second, and the whole run must fit a small node
(examples/quickstart.yaml requests under 2 CPUs in all; tests/operator/test_sizing.py)."""


def service_footprint(resolved: ResolvedRun, component: str) -> Footprint:
    """A CPU service's CPU and memory (no spec field sizes them): by the run's scale."""
    return (COMPONENT_FOOTPRINTS if uses_gpus(resolved) else CPU_RUN_FOOTPRINTS)[component]


TINY_MODEL_PARAMETERS = 1e6
"""At most this many parameters in a ``tiny:`` model (those of the built-in environments'
vocabularies have 0.1-0.2M; tests/operator/test_sizing.py checks the bound)."""
PROCESS_MIB = 512
"""The memory request's floor per process: what one that imports torch holds at rest."""
PROCESS_LIMIT_MIB = 2048
"""The memory limit's floor per process: importing torch's CUDA build peaks near 700 MiB, and a
warm start or a step's activations come on top."""
CPU_TRAINING_BYTES_PER_PARAMETER = 4 + 4 + 8 + 2
"""A trainer on CPUs: FP32 weights and gradients, AdamW's two FP32 moments, the BF16 copy it publishes."""
CPU_SERVING_BYTES_PER_PARAMETER = 4 + 4 + 2 + 2
"""The torch engine on CPUs: the served FP32 weights, the staging copy where its preparer process
readies the next version while they serve (docs/engine.md), that version's BF16 tensors while they
are loaded, and the last version kept to rebuild the next from its delta (mixrl/rl/weights.py)."""
HEADROOM = 1.25


def model_parameters(resolved: ResolvedRun) -> float | None:
    """The model's parameter count: ``model.parametersBillions``, the bound of a ``tiny:`` model, or
    None when the spec does not say."""
    model = resolved.model
    if model.parameters_billions is not None:
        return model.parameters_billions * 1e9
    if tiny_kind(model.path) is not None:
        return TINY_MODEL_PARAMETERS
    return None


def cpu_process_memory(processes: int, parameters: float, bytes_per_parameter: float) -> tuple[str, str]:
    """(request, limit) of ``processes`` processes on CPUs that together hold ``parameters`` at
    ``bytes_per_parameter``."""
    request = processes * PROCESS_MIB + parameters * bytes_per_parameter * HEADROOM / 2**20
    return mib(request), mib(max(processes * PROCESS_LIMIT_MIB, 2 * request))


def trainer_footprint(resolved: ResolvedRun) -> Footprint:
    """``trainer.resources`` (request = limit), else by GPU: NCCL, data loading, and the host copy of
    the checkpoint each rank loads; on CPUs (``gpuType: cpu``) half a core per process and the
    model's training state (its size from the spec): requests that leave a small node to the
    engines beside it, limits that let a step use what is idle."""
    spec = resolved.trainer.spec
    gpus = trainer_gpus(resolved)
    parameters = model_parameters(resolved)
    if gpus > 0:
        default = per_gpu(gpus, 4, 32, 8, 32)
    elif parameters is None:  # a model of unknown size on CPUs
        default = Footprint("2", "8Gi", "4", "8Gi")
    else:
        processes = spec.processes_per_node
        memory, memory_limit = cpu_process_memory(processes, parameters, CPU_TRAINING_BYTES_PER_PARAMETER)
        default = Footprint(millicores(500 * processes), memory, str(2 * processes), memory_limit)
    asked = spec.resources
    cpu = asked.cpu if asked and asked.cpu else None
    asked_memory = asked.memory if asked and asked.memory else None
    return Footprint(
        cpu or default.cpu,
        asked_memory or default.memory,
        cpu or default.cpu_limit,
        asked_memory or default.memory_limit,
    )


def engine_footprint(resolved: ResolvedRun, pool: ResolvedPool) -> Footprint:
    """SGLang and the torch engine on GPUs stream the checkpoint to the GPUs; on CPUs the torch
    engine holds the model twice (served and staging, FP32) and a version being loaded, and requests a fifth of a core, so the
    quickstart's four pools share two cores with the trainer (the limit lets it use an idle core)."""
    gpus = pool_gpus(pool)
    if gpus > 0:
        return per_gpu(gpus, 4, 16, 8, 32)
    parameters = model_parameters(resolved)
    if parameters is None:  # a model of unknown size on CPUs
        return Footprint("1", "2Gi", "2", "4Gi")
    memory, memory_limit = cpu_process_memory(1, parameters, CPU_SERVING_BYTES_PER_PARAMETER)
    return Footprint("200m", memory, "1", memory_limit)


CONVERSION_UNKNOWN_SIZE = Footprint("500m", "4Gi", "2", "32Gi")
"""The weight-sync containers of an SGLang pool whose run does not give ``model.parametersBillions``:
enough to convert a model of about 8B parameters."""


def weight_sync_footprint(resolved: ResolvedRun, pool: ResolvedPool) -> Footprint:
    """The init container and sidecar of an engine pod.  For SGLang they convert each version to the
    pool's precision, holding the BF16 checkpoint and its conversion in memory at once, so with the
    model's size known the memory is sized to it; the torch engine's only link a version (on a CPU
    pool, beside an engine of a small node, with the least a Python process needs)."""
    if pool.engine != "sglang":
        if pool_gpus(pool) == 0:
            return Footprint("25m", "256Mi", "500m", "1Gi")
        return Footprint("100m", "1Gi", "1", "2Gi")
    size = resolved.model.parameters_billions
    if size is None:
        return CONVERSION_UNKNOWN_SIZE
    held = size * 1e9 * (BYTES_PER_PARAMETER["bf16"] + BYTES_PER_PARAMETER[pool.weight_precision]) / GIB
    memory = gib(held * 1.1 + 1)  # tensors' headroom and the interpreter
    return Footprint("500m", memory, "2", memory)


# ----------------------------------------------------------------------------- volumes

UNKNOWN_MODEL_VOLUME = "200Gi"
"""The weights volume and the trainer's for a model of unknown size (no ``model.parametersBillions``)."""
LARGEST_DERIVED_BUFFER_GIB = 50
"""The buffer's volume for a run without ``trainer.totalSteps`` (its logs grow for as long as it
trains), and the most a bound derived from the run gives: for a large run (examples/rlrun-mixed.yaml)
the bound, every trajectory at a full context, is hundreds of TiB and says nothing."""
CHECKPOINT_BYTES_PER_PARAMETER = 4 + 8
"""A trainer checkpoint: FP32 master weights and AdamW's two moments (BF16 masters are not saved)."""
CHECKPOINTS_HELD = 2
"""The last checkpoint and the one being written (a save removes the older ones once committed)."""
TRAJECTORY_FIXED_BYTES = 1024
"""A trajectory line's fields other than its per-token columns (names, ids, reward, split)."""


def _volume(total_bytes: float) -> str:
    return gib(total_bytes * HEADROOM / GIB)


def checkpoint_bytes(parameters: float) -> float:
    return CHECKPOINTS_HELD * parameters * CHECKPOINT_BYTES_PER_PARAMETER


def weights_volume_size(resolved: ResolvedRun) -> str:
    """``weights.volumeSize``, else what the store holds at most: ``keepVersions`` BF16 versions, one
    being written and one the prune has not reached, each with every SGLang pool's conversion to its
    precision, the base model when ``model.path`` lies on the volume, and the checkpoints of a
    trainer of several nodes (their shared run directory is there); with a quarter of headroom."""
    weights = resolved.weights
    if weights.volume_size is not None:
        return weights.volume_size
    parameters = model_parameters(resolved)
    if parameters is None:
        return UNKNOWN_MODEL_VOLUME
    precisions = {pool.weight_precision for pool in resolved.pools if pool.engine == "sglang"} - {"bf16"}
    per_version = BYTES_PER_PARAMETER["bf16"] + sum(BYTES_PER_PARAMETER[p] for p in precisions)
    total = (weights.keep_versions + 2) * per_version * parameters
    root = weights_volume_path(weights.store)
    if root is not None and resolved.model.path.startswith(root.rstrip("/") + "/"):
        total += BYTES_PER_PARAMETER["bf16"] * parameters
    if resolved.trainer.spec.nodes > 1:
        total += checkpoint_bytes(parameters)
    return _volume(total)


def trainer_volume_size(resolved: ResolvedRun) -> str:
    """The claim of a one-node trainer's run directory: an explicit ``weights.volumeSize`` (the size
    the run gave its volumes), else its checkpoints (a tiny model's preparation and metrics.jsonl
    are small beside them)."""
    if resolved.weights.volume_size is not None:
        return resolved.weights.volume_size
    parameters = model_parameters(resolved)
    return UNKNOWN_MODEL_VOLUME if parameters is None else _volume(checkpoint_bytes(parameters))


def buffer_volume_size(resolved: ResolvedRun, options: BuildOptions) -> str:
    """The buffer's logs (:mod:`mixrl.rl.buffer.store`) keep every trajectory: for a run of
    ``totalSteps``, those of every step and of the ``maxStepsAhead`` produced beyond the last, each
    at most a full context (``maxContextTokens``) whose generated tokens (``maxTurns`` ×
    ``maxNewTokens`` at most) carry ``topCandidates`` candidates, every number at its longest JSON;
    at most :data:`LARGEST_DERIVED_BUFFER_GIB`."""
    if options.buffer_volume_size is not None:
        return options.buffer_volume_size
    largest = f"{LARGEST_DERIVED_BUFFER_GIB}Gi"
    steps = resolved.trainer.spec.total_steps
    if steps is None:
        return largest
    context = resolved.model.max_context_tokens
    generated = min(context, resolved.rollout.max_turns * resolved.sampling.max_new_tokens)
    candidates = resolved.sampling.top_logprobs_num
    # every context token: its id, loss mask, log q, support size and version; generated ones also
    # their candidates' ids and log q's
    numbers = 5 * context + 2 * candidates * generated
    trajectory = numbers * JSON_NUMBER_BYTES + TRAJECTORY_FIXED_BYTES
    trainer = resolved.trainer
    groups = (steps + resolved.rollout.max_steps_ahead) * trainer.prompts_per_update
    needed = groups * trainer.samples_per_prompt * trajectory * HEADROOM / GIB
    return largest if needed > LARGEST_DERIVED_BUFFER_GIB else gib(needed)


# ----------------------------------------------------------------------------- hashing


def stable_hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def desired_hash(obj: Obj) -> str:
    """Hash of a desired object, ignoring the hash annotation itself."""
    annotations = obj.get("metadata", {}).get("annotations")
    if annotations is None or (annotations and HASH_ANNOTATION not in annotations):
        return stable_hash(obj)  # already what the copy below would make of it (a builder's object)
    stripped = json.loads(json.dumps(obj))
    meta = stripped.get("metadata", {})
    annotations = meta.get("annotations", {})
    annotations.pop(HASH_ANNOTATION, None)
    if not annotations:
        meta.pop("annotations", None)
    return stable_hash(stripped)


def with_hash(obj: Obj) -> Obj:
    obj.setdefault("metadata", {}).setdefault("annotations", {})[HASH_ANNOTATION] = desired_hash(obj)
    return obj


def token_hash(token_data: str) -> str:
    """:data:`AUTH_TOKEN_HASH` of a token Secret whose ``data`` holds ``token_data`` (base64)."""
    return hashlib.sha256(token_data.encode()).hexdigest()[:16]


def pod_templates(obj: Obj) -> list[Obj]:
    """A workload's pod templates (a LeaderWorkerSet's leader and worker templates); none for others."""
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return [obj["spec"]["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        group = obj["spec"]["leaderWorkerTemplate"]
        return [template for template in (group.get("leaderTemplate"), group["workerTemplate"]) if template]
    return []


def with_token_hash(obj: Obj, hashed: str | None) -> Obj:
    """``obj`` carrying :data:`AUTH_TOKEN_HASH` ``hashed``: a SamplerPool labelled, a workload's pod
    templates annotated (None: ``obj`` as it is)."""
    if hashed is None:
        return obj
    if obj["kind"] == "SamplerPool":
        obj["metadata"].setdefault("labels", {})[AUTH_TOKEN_HASH] = hashed
    for template in pod_templates(obj):
        template.setdefault("metadata", {}).setdefault("annotations", {})[AUTH_TOKEN_HASH] = hashed
    return obj


# What of the resolved run each component reads (dotted paths into its JSON dump): a change
# elsewhere does not restart it, and a change of one it reads must (each process reads run.json
# once, at start).  The trainer's per-pool telemetry reads the pools' names, left out on purpose:
# adding a pool must not restart training.
CONFIG_SECTIONS: dict[str, tuple[str, ...]] = {
    "trainer": ("model", "trainer", "weights", "sampling", "evaluation"),
    # the largest trajectory it takes, the tokenizer it reads, the group size and batch
    "buffer": ("model.path", "model.max_context_tokens", "trainer", "rollout", "sampling"),
    # its request limit and traffic policy
    "router": ("model.max_context_tokens", "pools", "sampling", "health.routing"),
    # the group size, batch, staleness bound and end of the run; the evaluator's store
    "rollout": (
        "model",
        "trainer.samples_per_prompt",
        "trainer.prompts_per_update",
        "trainer.max_staleness",
        "trainer.spec.total_steps",
        "rollout",
        "sampling",
        "weights.store",
        "evaluation",
    ),
}


def config_hash(resolved: ResolvedRun, component: str) -> str:
    dumped = resolved.model_dump(mode="json")
    read: dict[str, Any] = {}
    for path in CONFIG_SECTIONS[component]:
        value: Any = dumped
        for key in path.split("."):
            value = value[key]
        read[path] = value
    return stable_hash(read)


def pool_config_hash(resolved: ResolvedRun, pool: ResolvedPool) -> str:
    dumped = resolved.model_dump(mode="json", include={"model", "sampling", "weights"})
    return stable_hash({**dumped, "pool": pool.model_dump(mode="json")})


def pool_children_hash(resolved: ResolvedRun, pool: ResolvedPool) -> str:
    """The SamplerPool's :data:`POOL_CONFIG_HASH_LABEL`: the pods' configuration plus what decides
    the pool's ScaledObject.  Only the engine when it is not KEDA: tuning the built-in loop's
    thresholds concerns neither the pool's Deployment nor its controller."""
    autoscaling = resolved.autoscaling
    scaling = autoscaling.model_dump(mode="json") if autoscaling.engine == "keda" else autoscaling.engine
    return stable_hash({"pods": pool_config_hash(resolved, pool), "autoscaling": scaling})


# ----------------------------------------------------------------------------- metadata


def metadata(
    name: str,
    namespace: str,
    labels: dict[str, str],
    owner: Owner,
    annotations: dict[str, str] | None = None,
) -> Obj:
    meta: Obj = {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels),
        "ownerReferences": [owner.reference()],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def scrape_annotations(port_number: int, options: BuildOptions) -> dict[str, str]:
    if options.monitoring is not Monitoring.ANNOTATIONS:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port_number),
        "prometheus.io/path": "/metrics",
    }


class Placement(Protocol):
    """A spec's placement fields: a pool's (flattened into :class:`ResolvedPool`) or the trainer's
    ``scheduling``."""

    @property
    def node_selector(self) -> Mapping[str, str]: ...
    @property
    def tolerations(self) -> Sequence[Toleration]: ...
    @property
    def priority_class_name(self) -> str | None: ...


def gpu_pod_scheduling(
    resolved: ResolvedRun, gpu_type: str, products: Sequence[str], placement: Placement, options: BuildOptions
) -> Obj:
    """Pod-spec fields placing one of the run's pods of ``gpu_type`` (:func:`gpu_scheduling`):
    the spec's ``products`` and ``placement``, and the operator's own settings — the type's node
    labels where GPU Feature Discovery is absent, packing beside the run's GPU pods, the scheduler."""
    images = options.images
    return gpu_scheduling(
        products,
        placement.node_selector,
        placement.tolerations,
        placement.priority_class_name,
        images.gpu_node_selectors.get(gpu_type),
        pack_with_run=resolved.name if images.pack_gpu_pods else None,
        scheduler_name=images.scheduler_name,
    )


def pod_template(labels: dict[str, str], annotations: dict[str, str], spec: Obj) -> Obj:
    return {"metadata": {"labels": dict(labels), "annotations": dict(annotations)}, "spec": spec}


def weights_volume_and_mount(resolved: ResolvedRun, read_only: bool) -> tuple[list[Obj], list[Obj]]:
    path = weights_volume_path(resolved.weights.store)
    if path is None:
        return [], []
    claim: Obj = {"claimName": L.child_name(resolved.name, "weights")}
    if read_only:
        claim["readOnly"] = True
    return [{"name": WEIGHTS_MOUNT, "persistentVolumeClaim": claim}], [mount(WEIGHTS_MOUNT, path, read_only)]


def service(
    name: str,
    resolved: ResolvedRun,
    labels: dict[str, str],
    selector: dict[str, str],
    ports: list[tuple[str, int]],
    owner: Owner,
    headless: bool,
    publish_not_ready: bool = False,
) -> Obj:
    spec: Obj = {
        "selector": dict(selector),
        "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports],
    }
    if headless:
        spec["clusterIP"] = "None"
    if publish_not_ready:
        spec["publishNotReadyAddresses"] = True
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(name, resolved.namespace, labels, owner),
        "spec": spec,
    }


def workload(
    kind: str,
    name: str,
    resolved: ResolvedRun,
    labels: dict[str, str],
    selector: dict[str, str],
    replicas: int,
    template: Obj,
    owner: Owner,
    spec: Obj,
) -> Obj:
    """A Deployment or StatefulSet of ``replicas`` pods of ``template``, with the kind's own ``spec``
    fields (a strategy; a service name, claims)."""
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": metadata(name, resolved.namespace, labels, owner),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(selector)},
            "template": template,
            **spec,
        },
    }
