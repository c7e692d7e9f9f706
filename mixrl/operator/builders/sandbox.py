"""Sandbox pods: where a run's model-generated commands run in a cluster (docs/sandbox.md#sandbox-pods-in-a-cluster).

Pure (no I/O).  With ``spec.rollout.sandbox`` set, the run gets:

- ``<run>-rollout`` ServiceAccount, Role and RoleBinding: the rollout workers may create, get,
  list and delete pods in the run's namespace (:data:`ROLLOUT_SANDBOX_RULES`), nothing else; their
  pods mount that account's token (every other component's pod mounts none);
- ``<run>-sandbox`` NetworkPolicy: sandbox pods accept connections only from the run's rollout
  pods, on the executor's port, and open none (no egress at all, not even DNS);
- ``sandbox-pod.json`` in the run's ConfigMap: the pod every rollout worker creates for its warm
  pool (:func:`sandbox_pod_template`), to which it adds only a name and its own label
  (:func:`mixrl.rl.sandbox.lease.named_pod`).  The rollout worker cannot import the operator; the template travels as
  data, so this module stays the one place a sandbox pod is shaped.

A sandbox pod runs ``mixrl sandbox-exec`` (:mod:`mixrl.rl.sandbox.executor`), which runs one
command per request with the local backend's rlimits, wall clock and output caps.  The pod itself
is the boundary: no service-account token, no service links, non-root, read-only root file
system, every capability dropped, seccomp ``RuntimeDefault``, CPU and memory limits (request =
limit), ``restartPolicy: Never``, and ``runtimeClassName`` (gVisor, Kata) when the spec names one.
Each pod serves one command and is then deleted (never reused); the RLRun owns every sandbox pod,
so deleting the run deletes them through the garbage collector.
"""

from __future__ import annotations

from mixrl.api.kube_types import Obj
from mixrl.api.launch import SANDBOX_TEMPLATE_FILE
from mixrl.api.models import SandboxPodsSpec
from mixrl.api.resolve import ResolvedRun
from mixrl.operator.builders import labels as L
from mixrl.operator.builders.objects import Images, Owner, metadata
from mixrl.operator.builders.podspec import (
    container,
    empty_dir,
    http_probe,
    mount,
    pod_spec,
    port,
)
from mixrl.rl.sandbox.lease import EXECUTOR_PORT_NAME

EXECUTOR_PORT = 8790
WORK_DIR = "/work"
WORK_SIZE = "512Mi"
"""The tmpfs ``/work`` of a sandbox pod (memory-backed, counted against the pod's memory limit)."""
TMP_SIZE = "64Mi"
SANDBOX_TEMPLATE_KEY = SANDBOX_TEMPLATE_FILE
"""The run ConfigMap's key holding :func:`sandbox_pod_template` (the file name the worker reads)."""
ROLLOUT_ACCOUNT_SUFFIX = "rollout"
ROLLOUT_SANDBOX_RULES: dict[tuple[str, str], frozenset[str]] = {
    ("", "pods"): frozenset({"create", "get", "list", "delete"}),
}
"""All a rollout worker may do with the API: its warm pool's pods (create, read, list, delete)."""


def enabled(resolved: ResolvedRun) -> SandboxPodsSpec | None:
    return resolved.rollout.sandbox


def selector(run: str) -> dict[str, str]:
    return L.selector_labels(run, "sandbox")


def account_name(resolved: ResolvedRun) -> str:
    return L.child_name(resolved.name, ROLLOUT_ACCOUNT_SUFFIX)


def _owner_reference(owner: Owner) -> Obj:
    """The RLRun as controller, without ``blockOwnerDeletion``: setting that needs update on the
    run's finalizers, which the rollout worker does not hold; the garbage collector deletes the
    pods with the run either way."""
    return {**owner.reference(), "blockOwnerDeletion": False}


def _resources(spec: SandboxPodsSpec) -> Obj:
    amounts = {"cpu": spec.resources.cpu or "1", "memory": spec.resources.memory or "1Gi"}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def sandbox_pod_template(resolved: ResolvedRun, owner: Owner, images: Images) -> Obj:
    """The sandbox pod every rollout worker of the run creates, without a name."""
    spec = enabled(resolved)
    if spec is None:
        raise ValueError("spec.rollout.sandbox: not set; the run has no sandbox pods")
    main = container(
        "sandbox",
        spec.image or images.components,
        ["mixrl", "sandbox-exec", "--host", "0.0.0.0", "--port", str(EXECUTOR_PORT), "--work-dir", WORK_DIR],
        [{"name": "HOME", "value": WORK_DIR}, {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
        [mount("work", WORK_DIR), mount("tmp", "/tmp")],
        ports=[port(EXECUTOR_PORT_NAME, EXECUTOR_PORT)],
        resources=_resources(spec),
        readinessProbe=http_probe("/health", EXECUTOR_PORT_NAME, period=2, failures=3, timeout=2),
    )
    volumes = [
        empty_dir("work", medium="Memory", size_limit=WORK_SIZE),
        empty_dir("tmp", medium="Memory", size_limit=TMP_SIZE),
    ]
    extra: Obj = {"restartPolicy": "Never", "enableServiceLinks": False, "terminationGracePeriodSeconds": 0}
    if spec.runtime_class_name:
        extra["runtimeClassName"] = spec.runtime_class_name
    meta = metadata("", resolved.namespace, {**selector(resolved.name), L.MANAGED_BY: "mixrl-rollout"}, owner)
    del meta["name"]
    meta["ownerReferences"] = [_owner_reference(owner)]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": pod_spec([main], volumes, images.pull_secrets, **extra),
    }


def rollout_rbac(resolved: ResolvedRun, owner: Owner) -> list[Obj]:
    """The rollout workers' ServiceAccount, their Role (:data:`ROLLOUT_SANDBOX_RULES`) and its binding."""
    name = account_name(resolved)
    labels = L.component_labels(resolved, "rollout")
    rules = [
        {"apiGroups": [group], "resources": [resource], "verbs": sorted(verbs)}
        for (group, resource), verbs in sorted(ROLLOUT_SANDBOX_RULES.items())
    ]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": metadata(name, resolved.namespace, labels, owner),
            "automountServiceAccountToken": False,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(name, resolved.namespace, labels, owner),
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(name, resolved.namespace, labels, owner),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": resolved.namespace}],
        },
    ]


def sandbox_network_policy(resolved: ResolvedRun, owner: Owner) -> Obj:
    """Deny-all for sandbox pods: in, only the run's rollout pods on the executor port; out, nothing."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(
            L.child_name(resolved.name, "sandbox"),
            resolved.namespace,
            L.component_labels(resolved, "run"),
            owner,
        ),
        "spec": {
            "podSelector": {"matchLabels": selector(resolved.name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": L.selector_labels(resolved.name, "rollout")}}],
                    "ports": [{"port": EXECUTOR_PORT_NAME, "protocol": "TCP"}],
                }
            ],
            "egress": [],
        },
    }


def sandbox_objects(resolved: ResolvedRun, owner: Owner) -> list[Obj]:
    """The run's sandbox objects (none without ``spec.rollout.sandbox``); the pods themselves are
    the rollout workers' to create."""
    if enabled(resolved) is None:
        return []
    return [*rollout_rbac(resolved, owner), sandbox_network_policy(resolved, owner)]
