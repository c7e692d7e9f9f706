"""Kubernetes' NetworkPolicy ingress rules, evaluated on pods' labels and named ports: for the
operator's tests, which build objects but run no pods (the real node's tests, tests/cluster,
have the bed's enforcer, mixrl.devcluster.netpol, enforce them on real packets)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int]
    namespace_labels: dict[str, str]


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A LabelSelector with matchLabels only (what the builders write); {} selects everything."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def peer_matches(peer: Obj, source: Pod, policy_namespace: str) -> bool:
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], source.namespace_labels):
            return False
    elif source.namespace != policy_namespace:  # a podSelector alone: the policy's own namespace
        return False
    return selects(peer.get("podSelector", {}), source.labels)


def reachable(policies: list[Obj], source: Pod, target: Pod, port: str) -> bool:
    """Kubernetes' ingress semantics: a pod no policy selects takes every connection; one that some
    policy selects takes only what a rule of such a policy allows (from a matching peer, to a port
    of its list or any port when the rule lists none)."""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == target.namespace
        and "Ingress" in p["spec"]["policyTypes"]
        and selects(p["spec"]["podSelector"], target.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            port_ok = ports is None or any(
                p["port"] == port or p["port"] == target.ports.get(port) for p in ports
            )
            peers = rule.get("from")
            peer_ok = peers is None or any(peer_matches(peer, source, target.namespace) for peer in peers)
            if port_ok and peer_ok:
                return True
    return False


COMPONENT = "app.kubernetes.io/component"


def open_connections(policies: list[Obj], pods: list[Pod]) -> set[tuple[str, str, str]]:
    """(from component, to component, named port) of every connection the policies let through
    between the given pods."""
    return {
        (source.labels[COMPONENT], target.labels[COMPONENT], port)
        for source in pods
        for target in pods
        for port in target.ports
        if reachable(policies, source, target, port)
    }
