"""Pod-level pieces shared by every workload: security, volumes, probes, GPU scheduling.

Pure functions returning plain dicts in the Kubernetes API's camelCase shape.  Every container runs
as a non-root user without privilege escalation and with all capabilities dropped; the root
filesystem is read-only wherever the process allows, with writable emptyDirs where it must write.
"""

from __future__ import annotations

from typing import Any

from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_RESOURCE
from mixrl.api.models import Toleration

Obj = dict[str, Any]

RUN_AS_USER = 1000
CONFIG_DIR = "/etc/mixrl"
CONFIG_PATH = f"{CONFIG_DIR}/run.json"
DRAIN_SCRIPT_PATH = f"{CONFIG_DIR}/drain.py"
CACHE_DIR = "/var/cache/mixrl"

# The GPU Operator and most managed clusters taint GPU nodes with this key.
GPU_TOLERATION: Obj = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def pod_security_context() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
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


def mount(name: str, path: str, read_only: bool = False) -> Obj:
    out: Obj = {"name": name, "mountPath": path}
    if read_only:
        out["readOnly"] = True
    return out


def base_volumes(config_map: str) -> list[Obj]:
    """Config (read-only), /tmp and a cache directory: what every mixrl process needs."""
    return [config_volume(config_map), empty_dir("tmp"), empty_dir("cache")]


def base_mounts() -> list[Obj]:
    return [mount("config", CONFIG_DIR, read_only=True), mount("tmp", "/tmp"), mount("cache", CACHE_DIR)]


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


def gpu_node_affinity(products: tuple[str, ...]) -> Obj:
    """Required node affinity: the node's GPU Feature Discovery product label is one of ``products``."""
    expression = {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": list(products)}
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [expression]}]
            }
        }
    }


def toleration_dict(toleration: Toleration) -> Obj:
    return toleration.model_dump(by_alias=True, exclude_none=True, mode="json")


def gpu_scheduling(
    products: tuple[str, ...],
    node_selector: dict[str, str],
    tolerations: tuple[Toleration, ...] = (),
    priority_class_name: str | None = None,
) -> Obj:
    """Pod-spec fields that put a GPU workload on nodes with one of ``products``.

    An empty ``products`` (``gpuType: cpu``) schedules anywhere and tolerates no GPU taint.
    """
    spec: Obj = {}
    extra = [toleration_dict(t) for t in tolerations]
    if products:
        spec["affinity"] = gpu_node_affinity(products)
        extra = [GPU_TOLERATION, *(t for t in extra if t != GPU_TOLERATION)]
    if extra:
        spec["tolerations"] = extra
    if node_selector:
        spec["nodeSelector"] = dict(sorted(node_selector.items()))
    if priority_class_name:
        spec["priorityClassName"] = priority_class_name
    return spec


def resources(gpus: int, cpu: str | None = None, memory: str | None = None) -> Obj:
    """Requests and limits; GPUs are an extended resource, so request equals limit."""
    limits: Obj = {}
    requests: Obj = {}
    if gpus > 0:
        limits[GPU_RESOURCE] = str(gpus)
    if cpu:
        requests["cpu"] = limits["cpu"] = cpu
    if memory:
        requests["memory"] = limits["memory"] = memory
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


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


def pod_spec(containers: list[Obj], volumes: list[Obj], **extra: Any) -> Obj:
    """A pod spec for a mixrl component: no service-account token (components never call the API)."""
    return {
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "containers": containers,
        "volumes": volumes,
        **extra,
    }
