"""Pure builders for one sampler pool: its SamplerPool (from the run) and, from the SamplerPool,
its Deployment and headless Service.

An engine pod: the engine container (SGLang's server with the pool's quantization, KV-cache dtype,
metrics and sampling-mask flags, or mixrl's torch engine), GPUs requested through
``nvidia.com/gpu``, nodes selected by ``nvidia.com/gpu.product``, readiness on ``/health``, a
preStop hook that drains in-flight requests, and a ``weight-sync`` sidecar that converts each new
weight version to the pool's precision and hands it to the engine (an init container converts the
current version before SGLang starts, because SGLang loads its first checkpoint at launch).
"""

from __future__ import annotations

from mixrl.api.models import API_VERSION
from mixrl.api.resolve import ENGINE_PORT, ResolvedPool, ResolvedRun
from mixrl.operator.build import labels as L
from mixrl.operator.build.objects import (
    CONFIG_HASH_ANNOTATION,
    POOL_CONFIG_HASH_LABEL,
    BuildOptions,
    Owner,
    deployment,
    engine_footprint,
    metadata,
    pod_template,
    pool_children_hash,
    pool_config_hash,
    scrape_annotations,
    service,
    weight_sync_footprint,
    weights_volume_and_mount,
    weights_volume_path,
    with_hash,
)
from mixrl.operator.build.podspec import (
    AUTH_ARGS,
    AUTH_TOKEN_KEY,
    CONFIG_PATH,
    DRAIN_SCRIPT_PATH,
    ENGINE_WEIGHTS_DIR,
    Obj,
    base_env,
    base_mounts,
    base_volumes,
    container,
    empty_dir,
    gpu_scheduling,
    mount,
    pod_spec,
    port,
    resources,
    server_probes,
)


def seed_replicas(pool: ResolvedPool) -> int:
    """Replicas a new SamplerPool starts with: minReplicas, at least 1, never above maxReplicas."""
    return min(pool.initial_replicas, pool.max_replicas)


def clamp_replicas(replicas: int, pool: ResolvedPool) -> int:
    return max(pool.min_replicas, min(replicas, pool.max_replicas))


def sampler_pool(resolved: ResolvedRun, pool: ResolvedPool, owner: Owner) -> Obj:
    """The pool's scaling adapter, *without* ``spec.replicas``: after creation that field belongs to
    the autoscaler, ``kubectl scale``, HPA or KEDA; the run's controller sets it only when it
    creates the pool (:func:`seed_replicas`) or when new bounds exclude it (:func:`clamp_replicas`)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "SamplerPool",
        "metadata": metadata(
            pool.object_name,
            resolved.namespace,
            {**L.pool_labels(resolved, pool), POOL_CONFIG_HASH_LABEL: pool_children_hash(resolved, pool)},
            owner,
        ),
        "spec": {
            "run": resolved.name,
            "pool": pool.name,
            "gpuType": pool.gpu_type,
            "weightPrecision": pool.weight_precision,
            "kvCacheDtype": pool.kv_cache_dtype,
            "engine": pool.engine,
            "minReplicas": pool.min_replicas,
            "maxReplicas": pool.max_replicas,
            "capacity": pool.capacity,
        },
    }


def engine_model_path(pool: ResolvedPool) -> str:
    return f"{ENGINE_WEIGHTS_DIR}/current"


AUTH_ENV = "MIXRL_AUTH_TOKEN"


def engine_container(
    resolved: ResolvedRun, pool: ResolvedPool, options: BuildOptions, mounts: list[Obj]
) -> Obj:
    if pool.engine == "sglang":
        command = [
            "python3",
            "-m",
            "sglang.launch_server",
            "--model-path",
            engine_model_path(pool),
            "--host",
            "0.0.0.0",
            "--port",
            str(ENGINE_PORT),
            # SGLang's own token check (every route but health and metrics), with the run's token.
            "--api-key",
            f"$({AUTH_ENV})",
            *pool.engine_args,
        ]
    else:
        store = weights_volume_path(resolved.weights.store)
        command = [
            "mixrl",
            "engine",
            "--model-path",
            engine_model_path(pool),
            # Weight updates load only from the run's weight store (the volume mounted there).
            *(["--weight-root", store] if store is not None else []),
            "--host",
            "0.0.0.0",
            "--port",
            str(ENGINE_PORT),
            *AUTH_ARGS,
            *pool.engine_args,
        ]
    # SGLang reads its key from the command line; the pod spec holds only a reference to the Secret.
    secret = {"name": L.child_name(resolved.name, "auth"), "key": AUTH_TOKEN_KEY}
    token_env = [{"name": AUTH_ENV, "valueFrom": {"secretKeyRef": secret}}] if pool.engine == "sglang" else []
    # Drain: the pod has left the Service's endpoints; wait for in-flight requests, then stop.
    drain = [
        "python3",
        DRAIN_SCRIPT_PATH,
        "--port",
        str(ENGINE_PORT),
        "--timeout",
        str(options.drain_seconds),
    ]
    return container(
        "engine",
        pool.image or options.images.engine(pool.engine),
        command,
        [*base_env(resolved.name), {"name": "MIXRL_POOL", "value": pool.name}, *token_env],
        mounts,
        ports=[port("engine", ENGINE_PORT)],
        # SGLang's JIT kernels (Triton, FlashInfer, DeepGEMM) write caches in paths we cannot
        # enumerate; the torch engine writes only to /tmp and the cache volume.
        read_only_root=pool.engine != "sglang",
        resources=resources(engine_footprint(pool), pool.gpus_per_replica),
        lifecycle={"preStop": {"exec": {"command": drain}}},
        **server_probes("engine", options.startup_minutes),
    )


def weight_sync_command(pool: ResolvedPool, once: bool) -> list[str]:
    command = [
        "mixrl",
        "engine-sync",
        "--config",
        CONFIG_PATH,
        "--pool",
        pool.name,
        "--output",
        ENGINE_WEIGHTS_DIR,
    ]
    # --once (the init container) never calls the engine, so it needs no token.
    if once:
        return [*command, "--once"]
    return [*command, "--engine-url", f"http://127.0.0.1:{ENGINE_PORT}", *AUTH_ARGS]


def pool_objects(
    resolved: ResolvedRun, pool: ResolvedPool, replicas: int, owner: Owner, options: BuildOptions
) -> list[Obj]:
    """The pool's headless Service and Deployment (``owner`` is the SamplerPool)."""
    labels = L.pool_labels(resolved, pool)
    selector = L.selector_labels(resolved.name, "sampler", pool.name)
    # The sidecar writes conversions into the shared store; the engine only reads.
    weight_volumes, sync_weight_mounts = weights_volume_and_mount(resolved, read_only=False)
    engine_weight_mounts = [{**m, "readOnly": True} for m in sync_weight_mounts]
    volumes = [
        *base_volumes(L.child_name(resolved.name, "config"), L.child_name(resolved.name, "auth")),
        *weight_volumes,
        empty_dir("engine-weights"),
    ]
    local = mount("engine-weights", ENGINE_WEIGHTS_DIR)
    sync_mounts = [*base_mounts(), *sync_weight_mounts, local]
    engine_mounts = [*base_mounts(), *engine_weight_mounts, local]
    if pool.gpus_per_replica > 0:
        volumes.append(empty_dir("dshm", medium="Memory"))
        engine_mounts.append(mount("dshm", "/dev/shm"))
    sync_env = [*base_env(resolved.name), {"name": "MIXRL_POOL", "value": pool.name}]
    sync_resources = resources(weight_sync_footprint(resolved, pool))
    components = options.images.components
    sidecar = container(
        "weight-sync",
        components,
        weight_sync_command(pool, once=False),
        sync_env,
        sync_mounts,
        resources=sync_resources,
    )
    # Every engine starts from the latest version: SGLang loads its first checkpoint at launch, and
    # the torch engine needs a model directory.
    init = container(
        "weights-init",
        components,
        weight_sync_command(pool, once=True),
        sync_env,
        sync_mounts,
        resources=sync_resources,
    )
    scheduling = gpu_scheduling(
        pool.gpu_products,
        pool.node_selector,
        pool.tolerations,
        pool.priority_class_name,
        options.images.gpu_node_selectors.get(pool.gpu_type),
    )
    spec = pod_spec(
        [engine_container(resolved, pool, options, engine_mounts), sidecar],
        volumes,
        options.images.pull_secrets,
        terminationGracePeriodSeconds=options.drain_seconds + 30,
        initContainers=[init],
        **scheduling,
    )
    annotations = {
        CONFIG_HASH_ANNOTATION: pool_config_hash(resolved, pool),
        **scrape_annotations(ENGINE_PORT, options),
    }
    template = pod_template(labels, annotations, spec)
    # No surge: a GPU pool rarely has a spare GPU, so replace one replica at a time instead.
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    workload = deployment(pool.object_name, resolved, labels, selector, replicas, template, owner, strategy)
    svc = service(
        pool.object_name, resolved, labels, selector, [("engine", ENGINE_PORT)], owner, headless=True
    )
    return [svc, workload]


def pool_children(
    resolved: ResolvedRun, pool: ResolvedPool, replicas: int, owner: Owner, options: BuildOptions
) -> list[Obj]:
    return [with_hash(obj) for obj in pool_objects(resolved, pool, replicas, owner, options)]
