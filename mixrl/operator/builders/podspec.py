"""Pod-level pieces shared by every workload: security, volumes, probes, GPU scheduling.

Pure functions returning plain dicts in the Kubernetes API's camelCase shape.  Every container runs
as a non-root user without privilege escalation and with all capabilities dropped; the root
filesystem is read-only wherever the process allows, with writable emptyDirs where it must write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_RESOURCE
from mixrl.api.kube_types import Obj
from mixrl.api.launch import Where
from mixrl.api.memory import SHARED_SUFFIX
from mixrl.api.models import Toleration, tiny_kind
from mixrl.api.pod_dirs import (
    AUTH_DIR,
    BUFFER_DATA_DIR,
    CACHE_DIR,
    CONFIG_DIR,
    ENGINE_WEIGHTS_DIR,
    TMP_DIR,
    TRAINER_RUN_DIR,
)
from mixrl.api.resolve import BUFFER_PORT, ENGINE_PORT, METRICS_PORT, ROUTER_PORT, ResolvedRun
from mixrl.operator.builders import labels as L

RUN_AS_USER = 1000
CONFIG_PATH = f"{CONFIG_DIR}/run.json"
DRAIN_SCRIPT_PATH = f"{CONFIG_DIR}/drain.py"
AUTH_TOKEN_KEY = "token"
AUTH_TOKEN_FILE = f"{AUTH_DIR}/{AUTH_TOKEN_KEY}"
RDZV_PORT = 29500
TRAINER_RUN_SUBPATH = "trainer-run"
"""With several trainer nodes: their shared run directory, on the run's weights volume."""
TINY_MODEL_CACHE = TRAINER_RUN_DIR
"""The cache a ``tiny:`` run's trainer pod builds its model into (``model-init``; the model goes to
its ``models/<kind>-<hash>``): on the trainer's volume, so a restarted pod finds it instead of
warm-starting again."""
TINY_MODEL_PATH = f"{TRAINER_RUN_DIR}/initial-model"
"""The link ``model-init`` points at the built model: the trainer's ``--model-path``."""


def service_url(resolved: ResolvedRun, component: L.Component, port_number: int) -> str:
    return f"http://{L.child_name(resolved.name, component)}.{resolved.namespace}.svc:{port_number}"


def pod_where(resolved: ResolvedRun) -> Where:
    """Where a run's components live in its pods (the launch table's input; mixrl.api.launch):
    every interface, fixed ports, the services' DNS names, the mounted config and token, pod 0 of
    the trainer's StatefulSet hosting the rendezvous, and each engine pod's weight-sync sidecar
    reloading its own engine (so the trainer reloads nothing through the router); for a ``tiny:``
    model, the trainer's model built by its pod's ``model-init`` container."""
    trainer = L.child_name(resolved.name, "trainer")
    tiny = tiny_kind(resolved.model.path) is not None
    return Where(
        program=("mixrl",),
        host="0.0.0.0",
        config=CONFIG_PATH,
        auth_token_file=AUTH_TOKEN_FILE,
        buffer_url=service_url(resolved, "buffer", BUFFER_PORT),
        router_url=service_url(resolved, "router", ROUTER_PORT),
        buffer_dir=BUFFER_DATA_DIR,
        trainer_run_dir=TRAINER_RUN_DIR,
        engine_model_path=f"{ENGINE_WEIGHTS_DIR}/current",
        metrics_port=METRICS_PORT,
        rendezvous=f"{trainer}-0.{trainer}.{resolved.namespace}.svc:{RDZV_PORT}",
        # The kubelet expands it from the pod-index label (the env var POD_INDEX of the pod).
        worker_index="$(POD_INDEX)",
        engine_weights_dir=ENGINE_WEIGHTS_DIR,
        engine_url=f"http://127.0.0.1:{ENGINE_PORT}",
        hold_when_done=True,
        trainer_model_path=TINY_MODEL_PATH if tiny else None,
        model_cache=TINY_MODEL_CACHE if tiny else None,
    )


# The GPU Operator and most managed clusters taint GPU nodes with this key.
GPU_TOLERATION: Obj = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def pod_security_context() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        # Change volume ownership only when the root of the volume is not ours yet: a recursive
        # chown of a weights volume with every version in it would hold each pod start for minutes.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(read_only_root: bool = True) -> Obj:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
    }


def config_volume(config_map: str) -> Obj:
    return {"name": "config", "configMap": {"name": config_map}}


def empty_dir(name: str, medium: str | None = None, size_limit: str | None = None) -> Obj:
    spec: Obj = {}
    if medium:
        spec["medium"] = medium
    if size_limit:
        spec["sizeLimit"] = size_limit
    return {"name": name, "emptyDir": spec}


def mount(name: str, path: str, read_only: bool = False, sub_path: str | None = None) -> Obj:
    out: Obj = {"name": name, "mountPath": path}
    if sub_path is not None:
        out["subPath"] = sub_path
    if read_only:
        out["readOnly"] = True
    return out


def auth_volume(secret: str) -> Obj:
    """The run's API token (docs/auth.md): readable by the pod's user only."""
    return {"name": "auth", "secret": {"secretName": secret, "defaultMode": 0o400}}


def base_volumes(resolved: ResolvedRun) -> list[Obj]:
    """The run's config and token (read-only), /tmp and a cache directory: what every mixrl process
    needs."""
    return [
        config_volume(L.child_name(resolved.name, "config")),
        auth_volume(L.child_name(resolved.name, "auth")),
        empty_dir("tmp"),
        empty_dir("cache"),
    ]


def base_mounts() -> list[Obj]:
    return [
        mount("config", CONFIG_DIR, read_only=True),
        mount("auth", AUTH_DIR, read_only=True),
        mount("tmp", TMP_DIR),
        mount("cache", CACHE_DIR),
    ]


def base_env(run: str) -> list[Obj]:
    """Where libraries may write (the root filesystem is read-only) and who the pod is."""
    return [
        {"name": "MIXRL_RUN", "value": run},
        {"name": "MIXRL_CONFIG", "value": CONFIG_PATH},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_DIR}/inductor"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def http_probe(path: str, port: str, period: int, failures: int, timeout: int = 5) -> Obj:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def server_probes(port: str, startup_minutes: int) -> Obj:
    """Readiness and liveness on /health; a startup probe long enough for loading a model."""
    return {
        "startupProbe": http_probe("/health", port, period=10, failures=max(1, startup_minutes * 6)),
        "readinessProbe": http_probe("/health", port, period=5, failures=3),
        "livenessProbe": http_probe("/health", port, period=30, failures=5, timeout=10),
    }


def with_shared(products: Sequence[str]) -> list[str]:
    """``products`` and their time-sliced names: GPU Feature Discovery appends ``-SHARED`` to the
    product label of a node whose GPUs are shared (time-slicing or MPS with renaming)."""
    out = list(products)
    out += [f"{p}{SHARED_SUFFIX}" for p in products if not p.endswith(SHARED_SUFFIX)]
    return out


def gpu_node_affinity(products: Sequence[str], fallback: Mapping[str, str] | None = None) -> Obj:
    """Required node affinity: the node's GPU Feature Discovery product label is one of ``products``
    (or their ``-SHARED`` names), OR the node carries every label of ``fallback`` (for nodes GFD
    does not label; node selector terms are OR-ed, the expressions inside one term AND-ed)."""
    terms: list[Obj] = [
        {"matchExpressions": [{"key": GPU_PRODUCT_LABEL, "operator": "In", "values": with_shared(products)}]}
    ]
    if fallback:
        terms.append(
            {
                "matchExpressions": [
                    {"key": key, "operator": "In", "values": [value]}
                    for key, value in sorted(fallback.items())
                ]
            }
        )
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}


PACK_WITH_OWN_RUN = 100
"""Preference weight of nodes already running GPU pods of the pod's own run…"""
PACK_WITH_ANY_RUN = 10
"""…and of nodes running GPU pods of any mixrl run, in any namespace."""
GPU_COMPONENTS = ("trainer", "sampler")
"""The components whose pods ask for GPUs."""
HOSTNAME = "kubernetes.io/hostname"


def packing_affinity(run: str) -> Obj:
    """Preferred pod affinity that packs GPU pods: toward nodes already running GPU pods of ``run``
    (its trainer and engines), and, far weaker, of any mixrl run. Without it the default scheduler
    spreads 1-GPU replicas over every node of their type and an 8-GPU trainer finds no whole node;
    with it small replicas join the nodes GPU pods already use and leave empty ones whole. Any
    scheduler honours it (a packing profile packs across all workloads, :mod:`mixrl.api.scheduling`)."""

    def term(weight: int, labels: Mapping[str, str], every_namespace: bool) -> Obj:
        selector = {
            "matchLabels": dict(labels),
            "matchExpressions": [{"key": L.COMPONENT, "operator": "In", "values": list(GPU_COMPONENTS)}],
        }
        pod_term: Obj = {"labelSelector": selector, "topologyKey": HOSTNAME}
        if every_namespace:
            pod_term["namespaceSelector"] = {}  # every namespace (none: the pod's own)
        return {"weight": weight, "podAffinityTerm": pod_term}

    return {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            term(PACK_WITH_OWN_RUN, {L.NAME: L.APP, L.INSTANCE: run}, every_namespace=False),
            term(PACK_WITH_ANY_RUN, {L.NAME: L.APP}, every_namespace=True),
        ]
    }


def toleration_dict(toleration: Toleration) -> Obj:
    return toleration.model_dump(by_alias=True, exclude_none=True, mode="json")


def gpu_scheduling(
    products: Sequence[str],
    node_selector: Mapping[str, str],
    tolerations: Sequence[Toleration] = (),
    priority_class_name: str | None = None,
    fallback: Mapping[str, str] | None = None,
    pack_with_run: str | None = None,
    scheduler_name: str | None = None,
) -> Obj:
    """Pod-spec fields that put a GPU workload on nodes with one of ``products`` (or, without GPU
    Feature Discovery, the ``fallback`` labels of its GPU type); ``node_selector`` is required on
    top of either. A GPU workload prefers the nodes GPU pods of its run ``pack_with_run`` already
    use (:func:`packing_affinity`; None: no preference) and names the scheduler (profile)
    ``scheduler_name`` (None: the cluster's default scheduler).

    An empty ``products`` (``gpuType: cpu``) schedules anywhere and tolerates no GPU taint.
    """
    spec: Obj = {}
    extra = [toleration_dict(t) for t in tolerations]
    if products:
        spec["affinity"] = gpu_node_affinity(products, fallback)
        if pack_with_run is not None:
            spec["affinity"]["podAffinity"] = packing_affinity(pack_with_run)
        if scheduler_name:
            spec["schedulerName"] = scheduler_name
        extra = [GPU_TOLERATION, *(t for t in extra if t != GPU_TOLERATION)]
    if extra:
        spec["tolerations"] = extra
    if node_selector:
        spec["nodeSelector"] = dict(sorted(node_selector.items()))
    if priority_class_name:
        spec["priorityClassName"] = priority_class_name
    return spec


# ----------------------------------------------------------------------------- CPU and memory


@dataclass(frozen=True)
class Footprint:
    """CPU and memory of one container.  Every container gets requests (no BestEffort pod: those
    are evicted first and refused by a quota on requests) and limits (a ResourceQuota on
    ``limits.cpu``/``limits.memory`` refuses any container without them)."""

    cpu: str
    memory: str
    cpu_limit: str
    memory_limit: str

    @classmethod
    def fixed(cls, cpu: str, memory: str) -> Footprint:
        """Limits equal to requests: what the user asked for is what the pod gets."""
        return cls(cpu, memory, cpu, memory)


def resources(footprint: Footprint, gpus: int = 0) -> Obj:
    """Requests and limits of CPU and memory, and GPUs (an extended resource: the limit alone, which
    Kubernetes copies into the request)."""
    limits: Obj = {"cpu": footprint.cpu_limit, "memory": footprint.memory_limit}
    if gpus > 0:
        limits[GPU_RESOURCE] = str(gpus)
    return {"requests": {"cpu": footprint.cpu, "memory": footprint.memory}, "limits": limits}


def container(
    name: str,
    image: str,
    command: list[str],
    env: list[Obj],
    mounts: list[Obj],
    ports: list[Obj] | None = None,
    read_only_root: bool = True,
    **extra: Any,
) -> Obj:
    out: Obj = {
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "env": env,
        "volumeMounts": mounts,
        "securityContext": container_security_context(read_only_root),
    }
    if ports:
        out["ports"] = ports
    out.update(extra)
    return out


def port(name: str, number: int) -> Obj:
    return {"name": name, "containerPort": number, "protocol": "TCP"}


def pod_spec(containers: list[Obj], volumes: list[Obj], pull_secrets: Sequence[str], **extra: Any) -> Obj:
    """A pod spec for a mixrl component: no service-account token (components never call the API);
    ``pull_secrets`` for private registries (Secrets in the pod's own namespace)."""
    spec: Obj = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "containers": containers,
        "volumes": volumes,
        **extra,
    }
    if pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in pull_secrets]
    return spec
