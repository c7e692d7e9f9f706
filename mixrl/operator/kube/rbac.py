"""Every Kubernetes API call the operator makes, as (API group, resource, verb): the source of RBAC.

The client in :mod:`mixrl.operator.kube.client` refuses a call that is not declared here, so this registry
cannot fall behind the code; the Helm chart's rules are generated from :func:`operator_rules`
(``python -m mixrl.operator.install.chart``), and the tests check both that the generated files are in sync
and that every request the running operator sends to the emulator is covered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mixrl.api.models import GROUP, VERSION


@dataclass(frozen=True)
class ApiResource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        parts = [root]
        if self.namespaced and namespace is not None:
            parts += ["namespaces", namespace]
        parts.append(self.plural)
        if name is not None:
            parts.append(name)
            if subresource is not None:
                parts.append(subresource)
        return "/".join(parts)


CONFIGMAPS = ApiResource("", "v1", "configmaps", "ConfigMap")
SECRETS = ApiResource("", "v1", "secrets", "Secret")
SERVICES = ApiResource("", "v1", "services", "Service")
PVCS = ApiResource("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim")
EVENTS = ApiResource("", "v1", "events", "Event")
PODS = ApiResource("", "v1", "pods", "Pod")
NODES = ApiResource("", "v1", "nodes", "Node", namespaced=False)
DEPLOYMENTS = ApiResource("apps", "v1", "deployments", "Deployment")
STATEFULSETS = ApiResource("apps", "v1", "statefulsets", "StatefulSet")
RLRUNS = ApiResource(GROUP, VERSION, "rlruns", "RLRun")
SAMPLERPOOLS = ApiResource(GROUP, VERSION, "samplerpools", "SamplerPool")
PODMONITORS = ApiResource("monitoring.coreos.com", "v1", "podmonitors", "PodMonitor")
SCALEDOBJECTS = ApiResource("keda.sh", "v1alpha1", "scaledobjects", "ScaledObject")
NETWORKPOLICIES = ApiResource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
LEADERWORKERSETS = ApiResource("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet")
WORKLOADS = ApiResource("kueue.x-k8s.io", "v1beta2", "workloads", "Workload")
PRIORITY_CLASSES = ApiResource(
    "scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", namespaced=False
)
SERVICEACCOUNTS = ApiResource("", "v1", "serviceaccounts", "ServiceAccount")
ROLES = ApiResource("rbac.authorization.k8s.io", "v1", "roles", "Role")
ROLEBINDINGS = ApiResource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding")
KOPF_PEERINGS = ApiResource("kopf.dev", "v1", "kopfpeerings", "KopfPeering")
CLUSTER_KOPF_PEERINGS = ApiResource(
    "kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", namespaced=False
)

CHILD_RESOURCES = (
    CONFIGMAPS,
    SERVICES,
    PVCS,
    DEPLOYMENTS,
    STATEFULSETS,
    LEADERWORKERSETS,
    SAMPLERPOOLS,
    PODMONITORS,
    SCALEDOBJECTS,
    NETWORKPOLICIES,
    WORKLOADS,
)
# The run's token Secret is a child too, but not watched: a watch needs list on every Secret of the
# namespace, so a deleted token Secret is recreated by the periodic resync instead.
# So are the rollout workers' ServiceAccount, Role and RoleBinding of a run with sandbox pods
# (mixrl.operator.builders.sandbox): rarely changed, recreated by the resync like the Secret.
BY_KIND: dict[tuple[str, str], ApiResource] = {
    (r.api_version, r.kind): r
    for r in (RLRUNS, *CHILD_RESOURCES, SECRETS, SERVICEACCOUNTS, ROLES, ROLEBINDINGS)
}


def resource_of(obj: dict[str, Any]) -> ApiResource:
    return BY_KIND[(obj["apiVersion"], obj["kind"])]


Key = tuple[str, str]
"""(API group, resource or resource/subresource)."""

# PodMonitors, by monitoring mode (the chart grants each set only in its mode).  PodMonitor mode:
# the run's PodMonitor is applied like any child (and kopf watches them, see FRAMEWORK).
# Annotations mode on a cluster that serves PodMonitors: the one an earlier PodMonitor mode left is
# read (is it this run's?) and deleted, so Prometheus does not scrape the run twice; not watched.
POD_MONITOR_WRITES = frozenset({"get", "create", "patch"})
POD_MONITOR_CLEANUP = frozenset({"get", "delete"})

# Calls made by mixrl's own code (the reconcilers and the built-in autoscaler), through
# mixrl.operator.kube.client.
RECONCILER: dict[Key, frozenset[str]] = {
    # Children, written by server-side apply (create and patch) after a get that compares them.
    # Every kind the operator watches is also listed by the resync (one list per kind and
    # namespace refreshes what the watches showed: mixrl.operator.controller.runtime).
    ("", "configmaps"): frozenset({"get", "list", "create", "patch"}),
    # The run's API token: created once with a random token, never rewritten (get by name only).
    ("", "secrets"): frozenset({"get", "create", "patch"}),
    # Deleted only to be recreated when an immutable field must change (a Service's clusterIP, a
    # Deployment's selector, a StatefulSet's claim templates); see mixrl.operator.controller.apply.
    ("", "services"): frozenset({"get", "list", "create", "patch", "delete"}),
    # Created once; afterwards only patched to grow (volume expansion), never shrunk.
    ("", "persistentvolumeclaims"): frozenset({"get", "list", "create", "patch"}),
    ("apps", "deployments"): frozenset({"get", "list", "create", "patch", "delete"}),
    ("apps", "statefulsets"): frozenset({"get", "list", "create", "patch", "delete"}),
    # A pool whose replica spans nodes (mixrl.operator.builders.lws); deleted when the pool's
    # replicas come back to one node (a Deployment again).
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): frozenset({"get", "list", "create", "patch", "delete"}),
    # One PodMonitor per run; deleted in annotations mode when an earlier mode left one.
    ("monitoring.coreos.com", "podmonitors"): POD_MONITOR_WRITES | POD_MONITOR_CLEANUP | {"list"},
    # One NetworkPolicy per component of a run; deleted when the operator runs with
    # --no-network-policies and an earlier operator left them.
    ("networking.k8s.io", "networkpolicies"): frozenset({"get", "list", "create", "patch", "delete"}),
    # A run with a Kueue queue: its Workload (mixrl.operator.builders.kueue); created again when
    # what Kueue counts changes (an admitted Workload's pod sets are immutable), deleted when the
    # run ends or leaves its queue, so its quota frees.  Its pools' extra-replica Workloads (one
    # per replica above the start), listed by the pool's labels, deleted as the pool scales down.
    ("kueue.x-k8s.io", "workloads"): frozenset({"get", "list", "create", "patch", "delete"}),
    # KEDA mode: one ScaledObject per SamplerPool; deleted when the run leaves KEDA mode.
    ("keda.sh", "scaledobjects"): frozenset({"get", "list", "create", "patch", "delete"}),
    # A SamplerPool's controller reads its run; a run's controller lists its pools to remove old ones.
    (GROUP, "rlruns"): frozenset({"get", "list"}),
    (GROUP, "samplerpools"): frozenset({"get", "list", "create", "patch", "delete"}),
    (GROUP, "rlruns/status"): frozenset({"patch"}),
    (GROUP, "samplerpools/status"): frozenset({"patch"}),
    # The built-in autoscaler: replicas through the scale subresource, a Scaled event per change.
    (GROUP, "samplerpools/scale"): frozenset({"patch"}),
    # Its events; and it lists a pool's pods (below) and, for an unschedulable one, the events
    # saying whether a cluster autoscaler is bringing a node (a cold start, not a stuck replica).
    ("", "events"): frozenset({"create", "list"}),
    # The live status reads the trainer's pods: containers that keep failing fail the run; the
    # built-in autoscaler reads each pool's pods (stuck or a cold start).  With
    # spec.rollout.sandbox the operator grants the rollout workers pods create/get/list/delete in a
    # Role, and Kubernetes lets it grant only what it holds itself (RBAC escalation prevention):
    # it holds create and get for that alone and never creates a pod; it deletes the sandbox pods
    # a killed worker left once the run's spec no longer asks for sandbox pods.
    ("", "pods"): frozenset({"list", "create", "get", "delete"}),
    # The rollout workers' account, Role and RoleBinding of a run with sandbox pods; deleted when
    # the run's spec no longer asks for sandbox pods.
    ("", "serviceaccounts"): frozenset({"get", "create", "patch", "delete"}),
    ("rbac.authorization.k8s.io", "roles"): frozenset({"get", "create", "patch", "delete"}),
    ("rbac.authorization.k8s.io", "rolebindings"): frozenset({"get", "create", "patch", "delete"}),
    # Children carry blockOwnerDeletion; with the OwnerReferencesPermissionEnforcement admission
    # plugin (OpenShift and others) that needs update on the owner's finalizers subresource.
    (GROUP, "rlruns/finalizers"): frozenset({"update"}),
    (GROUP, "samplerpools/finalizers"): frozenset({"update"}),
}

# Calls made by kopf itself: watching the two kinds and every kind of child we create (label-selected
# on the server; events of a child, deletions included, reconcile its owner), events, peering; no
# bookkeeping annotations (the operator registers no create or update handlers).  Resource
# scanning is disabled: kopf lists neither CRDs nor namespaces.  PodMonitors and ScaledObjects are watched only where the cluster serves them and
# the operator's --monitoring / --keda settings may create them (not in annotations mode, whose
# clean-up of a leftover PodMonitor reads it directly).
FRAMEWORK: dict[Key, frozenset[str]] = {
    (GROUP, "rlruns"): frozenset({"list", "watch"}),
    (GROUP, "samplerpools"): frozenset({"list", "watch"}),
    ("", "configmaps"): frozenset({"list", "watch"}),
    ("", "services"): frozenset({"list", "watch"}),
    ("", "persistentvolumeclaims"): frozenset({"list", "watch"}),
    ("apps", "deployments"): frozenset({"list", "watch"}),
    ("apps", "statefulsets"): frozenset({"list", "watch"}),
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): frozenset({"list", "watch"}),
    ("monitoring.coreos.com", "podmonitors"): frozenset({"list", "watch"}),
    ("keda.sh", "scaledobjects"): frozenset({"list", "watch"}),
    ("networking.k8s.io", "networkpolicies"): frozenset({"list", "watch"}),
    ("kueue.x-k8s.io", "workloads"): frozenset({"list", "watch"}),
    ("", "events"): frozenset({"create"}),
}
PEERING_VERBS = frozenset({"get", "list", "watch", "patch"})
# The built-in autoscaler reads the peering object (is kopf paused?) through our client.  Either
# resource may be named here: the operator reads the one of its scope, which permissions() grants.
PEERING_READS: dict[Key, frozenset[str]] = {
    ("kopf.dev", CLUSTER_KOPF_PEERINGS.plural): frozenset({"get"}),
    ("kopf.dev", KOPF_PEERINGS.plural): frozenset({"get"}),
}


# --explain-placement (the chart's placement.explain): a run whose pod the scheduler cannot place
# is told the free GPUs of the nodes it may use and who holds them, which takes every node and every
# namespace's bound pods.  Cluster-wide reads (a ClusterRole whatever the operator's scope), so they
# are granted only with that flag, and are in neither permissions() nor operator_rules().
PLACEMENT_READS: dict[Key, frozenset[str]] = {
    ("", NODES.plural): frozenset({"list"}),
    ("", PODS.plural): frozenset({"list"}),
}


# --kueue-workload-priority (the chart's kueue.workloadPriority): a queued run's Workload takes the
# priority of its pods' PriorityClass, whose value only a read of that cluster-scoped object gives
# (Kueue needs the value beside the name).  A ClusterRole whatever the operator's scope, so granted
# only with that flag, and in neither permissions() nor operator_rules().
PRIORITY_READS: dict[Key, frozenset[str]] = {
    ("scheduling.k8s.io", PRIORITY_CLASSES.plural): frozenset({"get"}),
}


def peering_resource(clusterwide: bool) -> ApiResource:
    return CLUSTER_KOPF_PEERINGS if clusterwide else KOPF_PEERINGS


def permissions(clusterwide: bool) -> dict[Key, frozenset[str]]:
    """Everything the operator may do: its own calls, kopf's, and peering in the right scope."""
    merged: dict[Key, set[str]] = {}
    for table in (RECONCILER, FRAMEWORK):
        for key, verbs in table.items():
            merged.setdefault(key, set()).update(verbs)
    merged[("kopf.dev", peering_resource(clusterwide).plural)] = set(PEERING_VERBS)
    return {key: frozenset(verbs) for key, verbs in merged.items()}


def is_allowed(allowed: dict[Key, frozenset[str]], group: str, resource: str, verb: str) -> bool:
    return verb in allowed.get((group, resource), frozenset())


def operator_rules(clusterwide: bool, include_peering: bool = True) -> list[dict[str, Any]]:
    """RBAC PolicyRules: one per (group, verb set), resources and verbs sorted (stable output).

    ``include_peering=False`` gives the rules without the peering resource, for a namespaced operator
    whose KopfPeering lives in its own namespace while it watches others.
    """
    allowed = permissions(clusterwide)
    if not include_peering:
        allowed = {key: verbs for key, verbs in allowed.items() if key[0] != "kopf.dev"}
    return policy_rules(allowed)


def policy_rules(allowed: Mapping[Key, frozenset[str]]) -> list[dict[str, Any]]:
    """Permissions as RBAC PolicyRules: one per (group, verb set), resources and verbs sorted."""
    grouped: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for (group, resource), verbs in allowed.items():
        if verbs:
            grouped.setdefault((group, tuple(sorted(verbs))), []).append(resource)
    return [
        {"apiGroups": [group], "resources": sorted(resources), "verbs": list(verbs)}
        for (group, verbs), resources in sorted(grouped.items())
    ]


def rules_allow(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    """Whether RBAC PolicyRules grant one call (wildcards honoured, as the API server does)."""
    for rule in rules:
        if not ({group, "*"} & set(rule.get("apiGroups", []))):
            continue
        if not ({resource, "*"} & set(rule.get("resources", []))):
            continue
        if {verb, "*"} & set(rule.get("verbs", [])):
            return True
    return False
