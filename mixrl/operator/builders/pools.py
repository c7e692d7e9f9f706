"""Pure builders for one sampler pool's children, from its SamplerPool: its Deployment (a
LeaderWorkerSet where a replica spans nodes: mixrl.operator.builders.lws) and headless Service (the
SamplerPool itself is one of the run's objects, built in resources.py).

An engine pod: the engine container (SGLang's server with the pool's quantization, KV-cache dtype,
metrics and sampling-mask flags, or mixrl's torch engine), GPUs requested through
``nvidia.com/gpu``, nodes selected by ``nvidia.com/gpu.product``, readiness on ``/health``, a
preStop hook that drains in-flight requests, and a ``weight-sync`` sidecar that converts each new
weight version to the pool's precision and hands it to the engine (an init container converts the
current version before SGLang starts, because SGLang loads its first checkpoint at launch).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from mixrl.api.kube_types import Obj
from mixrl.api.launch import AUTH_TOKEN_ENV, LABELLED_FILE, Where, component_command
from mixrl.api.pod_dirs import ENGINE_WEIGHTS_DIR
from mixrl.api.resolve import DIST_INIT_PORT, ENGINE_PORT, ResolvedPool, ResolvedRun
from mixrl.operator.builders import labels as L
from mixrl.operator.builders import podspec
from mixrl.operator.builders.lws import (
    LEADER_ADDRESS_ENV,
    LEADER_LABELS,
    WORKER_INDEX_ENV,
    leader_worker_set,
)
from mixrl.operator.builders.objects import (
    CONFIG_HASH_ANNOTATION,
    BuildOptions,
    Owner,
    engine_footprint,
    gpu_pod_scheduling,
    pod_template,
    pool_config_hash,
    pool_gpus,
    scrape_annotations,
    service,
    weight_sync_footprint,
    weights_volume_and_mount,
    with_hash,
    with_token_hash,
    workload,
)

Member = Literal["only", "leader", "worker"]
"""Which pod of a replica: the only one (a Deployment's), or the leader or a worker of a replica
across nodes (:mod:`mixrl.operator.builders.lws`)."""


def replica_where(resolved: ResolvedRun, pool: ResolvedPool) -> Where:
    """Where the pool's processes live: :func:`podspec.pod_where`, and for a replica across nodes the
    variables LWS's pod webhook gives each of its pods (the kubelet expands them in the command)."""
    where = podspec.pod_where(resolved)
    if pool.nodes_per_replica == 1:
        return where
    return replace(
        where,
        engine_node_rank=f"$({WORKER_INDEX_ENV})",
        engine_dist_init_addr=f"$({LEADER_ADDRESS_ENV}):{DIST_INIT_PORT}",
    )


def engine_container(
    resolved: ResolvedRun,
    pool: ResolvedPool,
    options: BuildOptions,
    mounts: list[Obj],
    member: Member = "only",
) -> Obj:
    # SGLang reads its key from the command line; the pod spec holds only a reference to the Secret.
    secret = {"name": L.child_name(resolved.name, "auth"), "key": podspec.AUTH_TOKEN_KEY}
    token_env = (
        [{"name": AUTH_TOKEN_ENV, "valueFrom": {"secretKeyRef": secret}}] if pool.engine == "sglang" else []
    )
    # Drain: the pod has left the Service's endpoints; wait for in-flight requests, then stop.
    drain = [
        "python3",
        podspec.DRAIN_SCRIPT_PATH,
        "--port",
        str(ENGINE_PORT),
        "--timeout",
        str(options.drain_seconds),
    ]
    # A worker of a replica across nodes serves no HTTP (SGLang's nodes of rank 1 and above run
    # only schedulers): no port, no probes, nothing to drain; its process exiting restarts the group.
    serving: Obj = (
        {}
        if member == "worker"
        else {
            "ports": [podspec.port("engine", ENGINE_PORT)],
            "lifecycle": {"preStop": {"exec": {"command": drain}}},
            **podspec.server_probes("engine", options.startup_minutes),
        }
    )
    return podspec.container(
        "engine",
        pool.image or options.images.engine(pool.engine),
        component_command(resolved, "engine", replica_where(resolved, pool), pool),
        [*podspec.base_env(resolved.name), {"name": "MIXRL_POOL", "value": pool.name}, *token_env],
        mounts,
        # SGLang's JIT kernels (Triton, FlashInfer, DeepGEMM) write caches in paths we cannot
        # enumerate; the torch engine writes only to /tmp and the cache volume.
        read_only_root=pool.engine != "sglang",
        resources=podspec.resources(engine_footprint(resolved, pool), pool_gpus(pool)),
        **serving,
    )


def engine_pod(
    resolved: ResolvedRun, pool: ResolvedPool, options: BuildOptions, member: Member = "only"
) -> Obj:
    """The pod template of one engine pod of the pool (every member of a replica but a worker has
    the weight-sync sidecar, its readiness gate and the scrape annotations)."""
    labels = L.pool_labels(resolved, pool)
    # The sidecar writes conversions into the shared store; the engine only reads.
    weight_volumes, sync_weight_mounts = weights_volume_and_mount(resolved, read_only=False)
    engine_weight_mounts = [{**m, "readOnly": True} for m in sync_weight_mounts]
    volumes = [
        *podspec.base_volumes(resolved),
        *weight_volumes,
        podspec.empty_dir("engine-weights"),
    ]
    local = podspec.mount("engine-weights", ENGINE_WEIGHTS_DIR)
    sync_mounts = [*podspec.base_mounts(), *sync_weight_mounts, local]
    engine_mounts = [*podspec.base_mounts(), *engine_weight_mounts, local]
    # /dev/shm in memory: NCCL on GPUs; the torch engine's staging copy of the weights, which its
    # preparer process writes (mixrl/rl/engine/staging.py), also on CPUs.  The container default
    # (64 MiB) holds no model; the memory counts against the engine's limit, sized for it.
    if pool_gpus(pool) > 0 or pool.engine != "sglang":
        volumes.append(podspec.empty_dir("dshm", medium="Memory"))
        engine_mounts.append(podspec.mount("dshm", "/dev/shm"))
    sync_env = [*podspec.base_env(resolved.name), {"name": "MIXRL_POOL", "value": pool.name}]
    sync_resources = podspec.resources(weight_sync_footprint(resolved, pool))
    where = podspec.pod_where(resolved)

    def sync_container(name: Literal["weight-sync", "weights-init"]) -> Obj:
        command = component_command(resolved, name, where, pool)
        return podspec.container(
            name, options.images.components, command, sync_env, sync_mounts, resources=sync_resources
        )

    # The init container makes every engine start from the latest version (SGLang loads its first
    # checkpoint at launch, and the torch engine needs a model directory); the sidecar follows.
    sidecar, init = sync_container("weight-sync"), sync_container("weights-init")
    # The readiness gate: the pod is Ready (and so in the pool's Service, where the router finds
    # it) only while the sidecar has seen the engine up and labelling its tokens with a version,
    # never in the half second after a (re)start when it would label them `default`.
    sidecar["readinessProbe"] = {
        "exec": {"command": ["cat", f"{ENGINE_WEIGHTS_DIR}/{LABELLED_FILE}"]},
        "periodSeconds": 2,
        "failureThreshold": 1,
    }
    scheduling = gpu_pod_scheduling(resolved, pool.gpu_type, pool.gpu_products, pool, options)
    engine = engine_container(resolved, pool, options, engine_mounts, member)
    spec = podspec.pod_spec(
        [engine] if member == "worker" else [engine, sidecar],
        volumes,
        options.images.pull_secrets,
        terminationGracePeriodSeconds=options.drain_seconds + 30,
        initContainers=[init],
        **scheduling,
    )
    annotations = {CONFIG_HASH_ANNOTATION: pool_config_hash(resolved, pool)}
    if member != "worker":
        annotations |= scrape_annotations(ENGINE_PORT, options)
    return pod_template(labels, annotations, spec)


def pool_objects(
    resolved: ResolvedRun, pool: ResolvedPool, replicas: int, owner: Owner, options: BuildOptions
) -> list[Obj]:
    """The pool's headless Service and its workload (``owner`` is the SamplerPool): a Deployment, or
    for a replica across nodes a LeaderWorkerSet whose leaders alone the Service selects."""
    labels = L.pool_labels(resolved, pool)
    selector = L.selector_labels(resolved.name, "sampler", pool.name)
    if pool.nodes_per_replica > 1:
        leader, worker = (engine_pod(resolved, pool, options, member) for member in ("leader", "worker"))
        engines = leader_worker_set(resolved, pool, labels, replicas, leader, worker, owner)
        selector = {**selector, **LEADER_LABELS}
    else:
        # No surge: a GPU pool rarely has a spare GPU, so replace one replica at a time instead.
        strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        template = engine_pod(resolved, pool, options)
        engines = workload(
            "Deployment",
            pool.object_name,
            resolved,
            labels,
            selector,
            replicas,
            template,
            owner,
            {"strategy": strategy},
        )
    svc = service(
        pool.object_name, resolved, labels, selector, [("engine", ENGINE_PORT)], owner, headless=True
    )
    return [svc, engines]


def pool_children(
    resolved: ResolvedRun,
    pool: ResolvedPool,
    replicas: int,
    owner: Owner,
    options: BuildOptions,
    token_hash: str | None = None,
) -> list[Obj]:
    """:func:`pool_objects` with their desired-hash annotations; ``token_hash``: the run's token's
    (the SamplerPool's :data:`AUTH_TOKEN_HASH` label), on the engines' pod templates."""
    return [
        with_hash(with_token_hash(obj, token_hash))
        for obj in pool_objects(resolved, pool, replicas, owner, options)
    ]
