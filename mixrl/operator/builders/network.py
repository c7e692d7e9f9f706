"""The run's NetworkPolicies: only the run's own components reach each other (docs/auth.md#network-policies).

Pure (no I/O).  One policy per component selects its pods and lists who may open connections to
them, on which named container port; a pod that a policy selects refuses every other connection
(Kubernetes' ingress isolation).  What one run ``r`` talks over:

====================  ==========================================  ===================
to                    from                                        port
====================  ==========================================  ===================
trainer               the other trainer ranks (rendezvous, NCCL)  every port
buffer                rollout workers (groups), the trainer;      ``http``
                      the router with ``spec.health.routing``
                      (it reads the trainer's mismatch there)
router                rollout workers (``/generate``)             ``http``
sampler engines       the router (``/generate``, probes, reloads) ``engine``
                      with a replica across nodes, the run's      every port
                      engines (SGLang's rendezvous, NCCL)
every pod             the metrics scrapers                        ``metrics``, ``engine``
====================  ==========================================  ===================

Engines are scraped on their serving port because SGLang serves ``/metrics`` there.  Calls inside a
pod (the weight-sync sidecar and the drain hook talk to their engine over loopback) are not subject
to policies, nor, with most network plugins, are the kubelet's probes.  Egress is left open: DNS,
the weight store and an environment's own services are the cluster's business.  The policies
protect a run's APIs from other pods even without the run's token; the token protects them where
the cluster's network plugin enforces no policy at all.
"""

from __future__ import annotations

from mixrl.api.kube_types import Obj
from mixrl.api.resolve import ResolvedRun
from mixrl.operator.builders import labels as L
from mixrl.operator.builders.objects import Owner, Scrapers, metadata


def _run_pods(resolved: ResolvedRun, component: L.Component) -> Obj:
    """A peer (or the policy's own selector): the run's pods of one component, in its namespace."""
    return {"podSelector": {"matchLabels": L.selector_labels(resolved.name, component)}}


def _ports(*names: str) -> list[Obj]:
    return [{"port": name, "protocol": "TCP"} for name in names]


INGRESS: dict[L.Component, tuple[tuple[L.Component, ...], tuple[str, ...] | None]] = {
    "trainer": (("trainer",), None),
    "buffer": (("rollout", "trainer"), ("http",)),
    "router": (("rollout",), ("http",)),
    "sampler": (("router",), ("engine",)),
    "rollout": ((), ()),
}
"""Component -> (the run's components that may connect to it, on these ports; None: every port)."""

SCRAPED_PORTS: dict[L.Component, tuple[str, ...]] = {
    "trainer": ("metrics",),
    "buffer": ("metrics",),
    "router": ("metrics",),
    "sampler": ("engine",),
    "rollout": ("metrics",),
}


def policy_names(resolved: ResolvedRun) -> list[str]:
    """``<run>-<component>-ingress`` for every component: the names of the run's policies."""
    return [L.child_name(resolved.name, f"{component}-ingress") for component in INGRESS]


def callers_of(resolved: ResolvedRun, component: L.Component) -> tuple[L.Component, ...]:
    """The run's components that may connect to ``component``: :data:`INGRESS`, plus the router to
    the buffer when it routes by mismatch (it polls the buffer's ``GET /stats``)."""
    callers = INGRESS[component][0]
    if component == "buffer" and resolved.health.routing is not None:
        callers = (*callers, "router")
    return callers


def network_policy(resolved: ResolvedRun, component: L.Component, owner: Owner, scrapers: Scrapers) -> Obj:
    callers, ports = callers_of(resolved, component), INGRESS[component][1]
    rules: list[Obj] = []
    if callers:
        rule: Obj = {"from": [_run_pods(resolved, caller) for caller in callers]}
        if ports is not None:
            rule["ports"] = _ports(*ports)
        rules.append(rule)
    if component == "sampler" and any(pool.nodes_per_replica > 1 for pool in resolved.pools):
        # The nodes of one replica meet at the leader's rendezvous, then talk NCCL and gloo on
        # ports they pick: every port between the run's engine pods, as between trainer ranks.
        rules.append({"from": [_run_pods(resolved, "sampler")]})
    rules.append({"from": [scrapers.peer()], "ports": _ports(*SCRAPED_PORTS[component])})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(
            L.child_name(resolved.name, f"{component}-ingress"),
            resolved.namespace,
            L.component_labels(resolved, "run"),
            owner,
        ),
        "spec": {**_run_pods(resolved, component), "policyTypes": ["Ingress"], "ingress": rules},
    }


def network_policies(resolved: ResolvedRun, owner: Owner, scrapers: Scrapers) -> list[Obj]:
    """One ingress policy per component of the run (every sampler pool under one)."""
    return [network_policy(resolved, component, owner, scrapers) for component in INGRESS]
