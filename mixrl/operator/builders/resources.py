"""Pure builders: a resolved RLRun (and each SamplerPool) -> the desired Kubernetes objects.

No I/O and no API client here (an import-linter contract checks it): the handlers decide *whether*
to write, these functions decide *what*.  Everything is built from :class:`ResolvedRun`, the same
object the components read from the run's ConfigMap.

What one RLRun ``r`` in namespace ``ns`` becomes:

- ConfigMap ``r-config``: ``run.json`` (the resolved run) and ``drain.py`` (the engines' preStop hook);
- Secret ``r-auth``: the run's bearer token (made once, never rewritten);
- PersistentVolumeClaim ``r-weights`` when the weight store is a path (ReadWriteMany: the trainer
  writes, every engine pod reads, on any node), of ``weights.storageClassName`` or the operator's
  default class;
- trainer: StatefulSet ``r-trainer`` (``nodes`` pods, torchrun's c10d rendezvous on pod 0) and its
  headless Service;
- buffer: StatefulSet ``r-buffer`` with a volume claim, and its headless Service;
- router: Deployment and Service ``r-router``; rollout workers: StatefulSet ``r-rollout``;
- one SamplerPool ``r-<pool>`` per pool, from which :mod:`mixrl.operator.builders.pools` builds the pool's
  Deployment and headless Service (owned by the SamplerPool, written only by its controller);
- monitoring: a PodMonitor when the cluster serves ``monitoring.coreos.com``, scrape annotations
  on the pod templates otherwise;
- NetworkPolicies ``r-<component>-ingress``: only the run's own components reach each other
  (:mod:`mixrl.operator.builders.network`), unless the operator runs with ``--no-network-policies``.
"""

from __future__ import annotations

import json
from functools import cache
from importlib.resources import files as package_files
from typing import Literal

from mixrl.api.gpus import GPU_TABLE
from mixrl.api.kube_types import Obj
from mixrl.api.launch import component_command, ranks_stop_seconds, weights_volume_path
from mixrl.api.models import API_VERSION
from mixrl.api.pod_dirs import BUFFER_DATA_DIR, TRAINER_RUN_DIR
from mixrl.api.resolve import BUFFER_PORT, METRICS_PORT, ROUTER_PORT, ResolvedPool, ResolvedRun
from mixrl.operator.builders import labels as L
from mixrl.operator.builders import sandbox
from mixrl.operator.builders.network import network_policies
from mixrl.operator.builders.objects import (
    CONFIG_HASH_ANNOTATION,
    POD_INDEX_LABEL,
    POOL_CONFIG_HASH_LABEL,
    WEIGHTS_MOUNT,
    BuildOptions,
    Monitoring,
    Owner,
    buffer_volume_size,
    config_hash,
    gpu_pod_scheduling,
    metadata,
    pod_template,
    pool_children_hash,
    scrape_annotations,
    service,
    service_footprint,
    trainer_footprint,
    trainer_gpus,
    trainer_volume_size,
    weights_volume_and_mount,
    weights_volume_size,
    with_hash,
    with_token_hash,
    workload,
)
from mixrl.operator.builders.podspec import (
    RDZV_PORT,
    TRAINER_RUN_SUBPATH,
    base_env,
    base_mounts,
    base_volumes,
    container,
    empty_dir,
    mount,
    pod_spec,
    pod_where,
    port,
    resources,
    server_probes,
)

# ----------------------------------------------------------------------------- shared objects


@cache
def drain_script() -> str:
    # The pre-stop hook runs inside the engine's container, so its source lives beside the engine.
    return package_files("mixrl.rl.engine").joinpath("drain.py").read_text(encoding="utf-8")


def run_metadata(resolved: ResolvedRun, suffix: str, owner: Owner) -> Obj:
    """Metadata of an object the whole run shares (``<run>-<suffix>``)."""
    return metadata(
        L.child_name(resolved.name, suffix), resolved.namespace, L.component_labels(resolved, "run"), owner
    )


def config_map(resolved: ResolvedRun, owner: Owner) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": run_metadata(resolved, "config", owner),
        "data": {"run.json": resolved.model_dump_json(indent=2), "drain.py": drain_script()},
    }


def auth_secret(resolved: ResolvedRun, owner: Owner) -> Obj:
    """The run's API token Secret, without its token: the reconciler adds a random one when it
    creates the Secret (a pure builder cannot make one, and a token must not change on every
    reconcile), and never rewrites it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": run_metadata(resolved, "auth", owner),
        "type": "Opaque",
    }


def weights_pvc(resolved: ResolvedRun, owner: Owner, options: BuildOptions) -> Obj | None:
    if weights_volume_path(resolved.weights.store) is None:
        return None
    spec: Obj = {
        # The trainer writes each version and every engine pod, on any node, reads it.
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": weights_volume_size(resolved)}},
    }
    storage_class = resolved.weights.storage_class_name or options.images.weights_storage_class
    if storage_class:  # else the cluster's default StorageClass
        spec["storageClassName"] = storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": run_metadata(resolved, "weights", owner),
        "spec": spec,
    }


def claim_template(name: str, labels: dict[str, str], size: str) -> Obj:
    return {
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}},
    }


def component_template(
    resolved: ResolvedRun,
    component: L.Component,
    main: Obj,
    volumes: list[Obj],
    options: BuildOptions,
    **pod: object,
) -> Obj:
    """The pod template of a run component: its one container, the run's config and token volumes
    (plus ``volumes``), the config hash that rolls it and the scrape annotations."""
    annotations = {
        CONFIG_HASH_ANNOTATION: config_hash(resolved, component),
        **scrape_annotations(METRICS_PORT, options),
    }
    spec = pod_spec([main], [*base_volumes(resolved), *volumes], options.images.pull_secrets, **pod)
    return pod_template(L.component_labels(resolved, component), annotations, spec)


# ----------------------------------------------------------------------------- trainer


def trainer_objects(resolved: ResolvedRun, owner: Owner, options: BuildOptions) -> list[Obj]:
    """``nodes`` pods, torchrun's c10d rendezvous on pod 0.  No ``--router`` on the command line: in
    a cluster the trainer only publishes each version to the weight store, and every engine pod's
    ``weight-sync`` sidecar converts it to the pool's precision and reloads its own engine (SGLang
    pools need the converted checkpoint, which a reload through the router would not give them)."""
    spec = resolved.trainer.spec
    name = L.child_name(resolved.name, "trainer")
    labels = L.component_labels(resolved, "trainer")
    gpus = trainer_gpus(resolved)
    weight_volumes, weight_mounts = weights_volume_and_mount(resolved, read_only=False)
    volumes = list(weight_volumes)
    # Every rank writes its shards of a checkpoint into the one run directory (mixrl.rl.trainer.
    # checkpoint): one pod keeps it on a volume of its own, several share a directory on the run's
    # ReadWriteMany weights volume (a claim per pod would give each rank a directory of its own).
    shared = spec.nodes > 1 and weight_volumes
    run_mount = (
        mount(WEIGHTS_MOUNT, TRAINER_RUN_DIR, sub_path=TRAINER_RUN_SUBPATH)
        if shared
        else mount("run", TRAINER_RUN_DIR)
    )
    mounts = [*base_mounts(), *weight_mounts, run_mount]
    if gpus > 0:  # NCCL and data loaders need a large /dev/shm
        volumes.append(empty_dir("dshm", medium="Memory"))
        mounts.append(mount("dshm", "/dev/shm"))
    image = resolved.trainer.image or options.images.trainer(spec.backend)
    where = pod_where(resolved)
    trainer = container(
        "trainer",
        image,
        component_command(resolved, "trainer", where),
        [
            *base_env(resolved.name),
            {
                "name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                "value": str(ranks_stop_seconds(spec.stop_grace_seconds)),
            },
        ],
        mounts,
        ports=[port("rdzv", RDZV_PORT), port("metrics", METRICS_PORT)],
        resources=resources(trainer_footprint(resolved), gpus),
    )
    init: Obj = {}
    if where.model_cache is not None:
        # A tiny: model is built, as mixrl run builds it, onto the run volume before the trainer
        # loads it (nothing can be downloaded); the trainer then publishes it as version 0.  Its
        # warm start is a small training job: the trainer's CPU and memory, none of its GPUs.
        model_init = container(
            "model-init",
            image,
            component_command(resolved, "model-init", where),
            base_env(resolved.name),
            [*base_mounts(), run_mount],
            resources=resources(trainer_footprint(resolved)),
        )
        init = {"initContainers": [model_init]}
    # Like a pool: the GPU table's products (or the spec's), the GPU taint tolerated, the spec's
    # node selector, tolerations and priority class (a trainer preempted mid-run loses a step).
    placement = spec.scheduling
    products = (placement.gpu_products or GPU_TABLE[spec.gpu_type].gfd_products) if gpus > 0 else ()
    scheduling = gpu_pod_scheduling(resolved, spec.gpu_type, products, placement, options)
    template = component_template(
        resolved,
        "trainer",
        trainer,
        volumes,
        options,
        terminationGracePeriodSeconds=spec.stop_grace_seconds,
        **init,
        **scheduling,
    )
    # Parallel pod management (the helper's default): every node must be up for the rendezvous.
    # The run volume holds checkpoints and metrics.jsonl; optimizer state is sized like the weights.
    claims = [] if shared else [claim_template("run", labels, trainer_volume_size(resolved))]
    trainers = statefulset(resolved, "trainer", spec.nodes, template, owner, claims)
    # Pod DNS records must exist before readiness, or the rendezvous on pod 0 cannot be found.
    headless = service(
        name,
        resolved,
        labels,
        L.selector_labels(resolved.name, "trainer"),
        [("rdzv", RDZV_PORT), ("metrics", METRICS_PORT)],
        owner,
        headless=True,
        publish_not_ready=True,
    )
    return [headless, trainers]


# ----------------------------------------------------------------------------- buffer, router, rollout


RunService = Literal["buffer", "router", "rollout"]
"""The run's CPU services: one container each, from the components image."""


def component_container(
    resolved: ResolvedRun,
    component: RunService,
    options: BuildOptions,
    ports: list[Obj],
    extra_mounts: list[Obj],
) -> Obj:
    extra: Obj = {}
    if any(p["name"] == "http" for p in ports):
        extra = server_probes("http", startup_minutes=5)
    return container(
        component,
        options.images.components,
        component_command(resolved, component, pod_where(resolved)),
        base_env(resolved.name),
        [*base_mounts(), *extra_mounts],
        ports=ports,
        resources=resources(service_footprint(resolved, component)),
        **extra,
    )


def statefulset(
    resolved: ResolvedRun,
    component: L.Component,
    replicas: int,
    template: Obj,
    owner: Owner,
    claims: list[Obj] | None = None,
) -> Obj:
    name = L.child_name(resolved.name, component)
    labels, selector = L.component_labels(resolved, component), L.selector_labels(resolved.name, component)
    spec: Obj = {"serviceName": name, "podManagementPolicy": "Parallel"}
    if claims:
        spec["volumeClaimTemplates"] = claims
        # Deliberate: deleting the run (or scaling the trainer down) keeps the trainer's checkpoints
        # and the buffer's logs; an RLRun of the same name resumes from them (docs/operator.md#delete).
        spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Retain", "whenScaled": "Retain"}
    return workload("StatefulSet", name, resolved, labels, selector, replicas, template, owner, spec)


def buffer_objects(resolved: ResolvedRun, owner: Owner, options: BuildOptions) -> list[Obj]:
    """One buffer with its append-only logs on a volume: a restart loses no trajectory."""
    labels = L.component_labels(resolved, "buffer")
    ports = [port("http", BUFFER_PORT), port("metrics", METRICS_PORT)]
    main = component_container(resolved, "buffer", options, ports, [mount("data", BUFFER_DATA_DIR)])
    template = component_template(resolved, "buffer", main, [], options, terminationGracePeriodSeconds=60)
    claims = [claim_template("data", labels, buffer_volume_size(resolved, options))]
    buffers = statefulset(resolved, "buffer", 1, template, owner, claims)
    selector = L.selector_labels(resolved.name, "buffer")
    name = L.child_name(resolved.name, "buffer")
    headless = service(name, resolved, labels, selector, [("http", BUFFER_PORT)], owner, headless=True)
    return [headless, buffers]


def router_objects(resolved: ResolvedRun, owner: Owner, options: BuildOptions) -> list[Obj]:
    """One router (session-to-pool stickiness is its in-memory state); it finds each pool's replicas
    through the pool's headless Service."""
    name = L.child_name(resolved.name, "router")
    labels = L.component_labels(resolved, "router")
    selector = L.selector_labels(resolved.name, "router")
    ports = [port("http", ROUTER_PORT), port("metrics", METRICS_PORT)]
    main = component_container(resolved, "router", options, ports, [])
    template = component_template(resolved, "router", main, [], options)
    recreate = {"strategy": {"type": "Recreate"}}
    router = workload("Deployment", name, resolved, labels, selector, 1, template, owner, recreate)
    svc = service(name, resolved, labels, selector, [("http", ROUTER_PORT)], owner, headless=False)
    return [svc, router]


def rollout_objects(resolved: ResolvedRun, owner: Owner, options: BuildOptions) -> list[Obj]:
    """``rollout.workers`` agent-loop workers; a StatefulSet so each knows its index (its share of
    the tasks) from the pod-index label, passed on the command line through ``$(POD_INDEX)``.  The
    weights volume is mounted read-only: the worker reads the model's tokenizer and chat template
    from ``model.tokenizer`` or ``model.path``, which live there beside the base weights."""
    weight_volumes, weight_mounts = weights_volume_and_mount(resolved, read_only=True)
    main = component_container(resolved, "rollout", options, [port("metrics", METRICS_PORT)], weight_mounts)
    main["env"].append(
        {
            "name": "POD_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}},
        }
    )
    template = component_template(resolved, "rollout", main, weight_volumes, options)
    if sandbox.enabled(resolved) is not None:
        # The one component that calls the API: it creates and deletes its sandbox pods.
        template["spec"]["serviceAccountName"] = sandbox.account_name(resolved)
        template["spec"]["automountServiceAccountToken"] = True
    else:
        # Named all the same: when the sandbox goes, the API server would keep the old account
        # through the field's deprecated twin ``serviceAccount``, and that account is deleted.
        template["spec"]["serviceAccountName"] = "default"
    return [statefulset(resolved, "rollout", resolved.rollout.workers, template, owner)]


# ----------------------------------------------------------------------------- monitoring


POOL_RELABELINGS = (
    ("__meta_kubernetes_pod_label_app_kubernetes_io_instance", "run"),
    ("__meta_kubernetes_pod_label_mixrl_dev_pool", "pool"),
    ("__meta_kubernetes_pod_label_mixrl_dev_gpu_type", "gpu_type"),
    ("__meta_kubernetes_pod_label_mixrl_dev_precision", "precision"),
)


def pod_monitor(resolved: ResolvedRun, owner: Owner, options: BuildOptions) -> Obj:
    """Scrape every pod of the run: components on ``metrics``, engines (SGLang's names) on ``engine``;
    the pod labels become the ``run``, ``pool``, ``gpu_type`` and ``precision`` series labels where a
    series has none of its own (``honorLabels``: the trainer's per-pool series carry each pool's GPU
    type and precision, which the trainer pod's labels would otherwise overwrite, renaming them
    ``exported_*``; the test bed's Prometheus honours labels too).
    ``options.images.pod_monitor_labels`` let a Prometheus that selects monitors by label find it; the
    operator's own labels win over them (they identify the run's objects)."""
    relabelings = [
        {"sourceLabels": [source], "targetLabel": target, "action": "replace"}
        for source, target in POOL_RELABELINGS
    ]
    labels = {**options.images.pod_monitor_labels, **L.component_labels(resolved, "run")}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": metadata(resolved.name, resolved.namespace, labels, owner),
        "spec": {
            "selector": {"matchLabels": {L.NAME: L.APP, L.INSTANCE: resolved.name}},
            "podMetricsEndpoints": [
                {"port": "metrics", "path": "/metrics", "honorLabels": True, "relabelings": relabelings},
                {"port": "engine", "path": "/metrics", "honorLabels": True, "relabelings": relabelings},
            ],
        },
    }


# ----------------------------------------------------------------------------- the whole run


# ----------------------------------------------------------------------------- the pools' adapters


def seed_replicas(pool: ResolvedPool) -> int:
    """Replicas a new SamplerPool starts with: the pool's ``initial_replicas``
    (:func:`mixrl.api.resolve.initial_replicas`: minReplicas, at least 1, never above maxReplicas),
    the same number of engines ``mixrl run`` starts."""
    return pool.initial_replicas


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


RELEASED_AT_THE_END = ("trainer", "rollout", "router")
"""The workloads a finished run scales to zero, beside its sampler pools (the buffer keeps its logs
served)."""


def released(objects: list[Obj], resolved: ResolvedRun) -> list[Obj]:
    """A finished run's objects: the trainer, rollout, router and every SamplerPool at zero
    replicas, so the run's GPUs and CPUs are free; claims, weights and the buffer's logs stay
    (docs/health.md#the-end-of-a-run).  A SamplerPool's replicas otherwise belong to whoever scales
    it (no ``spec.replicas`` in what is desired); at the end the operator takes them back."""
    names = {L.child_name(resolved.name, component) for component in RELEASED_AT_THE_END}
    for obj in objects:
        if obj["kind"] == "SamplerPool" or (
            obj["kind"] in ("Deployment", "StatefulSet") and obj["metadata"]["name"] in names
        ):
            obj["spec"]["replicas"] = 0
    return objects


def run_objects(
    resolved: ResolvedRun,
    owner: Owner,
    options: BuildOptions,
    finished: bool = False,
    token_hash: str | None = None,
) -> list[Obj]:
    """Everything the RLRun owns directly, each with its desired-hash annotation, in apply order
    (configuration and volumes before the workloads that mount them); ``finished``: the run is
    Succeeded or Failed, so its workloads are :func:`released`; ``token_hash``: the hash of its
    Secret's token (:data:`AUTH_TOKEN_HASH`), which its workloads and pools carry."""
    objects: list[Obj] = [config_map(resolved, owner), auth_secret(resolved, owner)]
    if sandbox.enabled(resolved) is not None:
        template = sandbox.sandbox_pod_template(resolved, owner, options.images)
        objects[0]["data"][sandbox.SANDBOX_TEMPLATE_KEY] = json.dumps(template, indent=2, sort_keys=True)
        objects += sandbox.sandbox_objects(resolved, owner)
    pvc = weights_pvc(resolved, owner, options)
    if pvc is not None:
        objects.append(pvc)
    objects += trainer_objects(resolved, owner, options)
    objects += buffer_objects(resolved, owner, options)
    objects += router_objects(resolved, owner, options)
    objects += rollout_objects(resolved, owner, options)
    objects += [sampler_pool(resolved, pool, owner) for pool in resolved.pools]
    if options.monitoring is Monitoring.POD_MONITOR:
        objects.append(pod_monitor(resolved, owner, options))
    if options.images.network_policies is not None:
        objects += network_policies(resolved, owner, options.images.network_policies)
    if finished:
        objects = released(objects, resolved)
    return [with_hash(with_token_hash(obj, token_hash)) for obj in objects]
