"""The bed's NetworkPolicy enforcer: the cluster's policies, as nftables rules in each real node.

Why its own: ``sigs.k8s.io/kube-network-policies`` (what kind runs) decides each new connection in
user space through nftables' ``queue``, which this machine's kernel lacks. This one translates the
policies into rules instead, as kube-router or Calico do: one process per real node
(``python -m mixrl.devcluster.netpol``, inside the node's network namespace), which lists pods,
namespaces and NetworkPolicies from the API server every :data:`INTERVAL_S` and, when the rules it
derives change, replaces its table ``inet mixrl_netpol`` in one ``nft`` transaction.

What it enforces (``networking.k8s.io/v1``, IPv4): ingress and egress isolation of the node's own
pods; peers by ``podSelector``, ``namespaceSelector`` (both together: pods of those namespaces) and
``ipBlock`` with ``except``; ports by number, range (``endPort``) or name (the selected pod's
container port for ingress, each destination pod's for egress, so not an ``ipBlock``'s), TCP, UDP
or SCTP; several policies
selecting one pod allow the union. Connections already open when a policy changes keep going (the
rules decide new connections; replies pass by conntrack), as with most network plugins.

What it leaves open, as most plugins do: traffic from the node itself (the kubelet's probes and
``exec`` never cross the forward hook) and from the bed's host (:data:`HOST_IP`: the bed's
Prometheus scrapes pods from there, and the tests read pod APIs); a pod's egress to its own node.

The rules are a pure function of the listed objects (:func:`ruleset`); :func:`main` is the loop.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mixrl.api.kube_types import Obj
from mixrl.devcluster.monitoring import bed_lister
from mixrl.devcluster.network import HOST_IP

TABLE = "mixrl_netpol"
INTERVAL_S = 1.0
PROTOCOLS = {"TCP": "tcp", "UDP": "udp", "SCTP": "sctp"}


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (``matchLabels``, ``matchExpressions``) against ``labels``;
    ``{}`` selects everything."""
    selector = selector or {}
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    ip: str
    node: str
    labels: dict[str, str]
    ports: dict[tuple[str, str], int]
    """(container port name, protocol) -> number."""


def live_pods(items: Iterable[Obj]) -> list[Pod]:
    """The pods that hold an address: scheduled, not finished, not on the host's network."""
    pods = []
    for item in items:
        status, spec = item.get("status") or {}, item.get("spec") or {}
        if (
            not status.get("podIP")
            or status.get("phase") in ("Succeeded", "Failed")
            or spec.get("hostNetwork")
        ):
            continue
        ports = {
            (port["name"], port.get("protocol", "TCP")): port["containerPort"]
            for container in spec.get("containers") or []
            for port in container.get("ports") or []
            if port.get("name")
        }
        meta = item["metadata"]
        pods.append(Pod(meta["namespace"], meta["name"], status["podIP"], spec.get("nodeName", ""),
                        meta.get("labels") or {}, ports))  # fmt: skip
    return sorted(pods, key=lambda p: (p.namespace, p.name))


def peer_pods(peer: Obj, namespace: str, namespaces: dict[str, dict[str, str]], pods: list[Pod]) -> list[Pod]:
    """The pods a ``podSelector``/``namespaceSelector`` peer names (``namespace``: the policy's)."""
    if "namespaceSelector" in peer:
        chosen = {name for name, labels in namespaces.items() if selects(peer["namespaceSelector"], labels)}
    else:
        chosen = {namespace}
    return [p for p in pods if p.namespace in chosen and selects(peer.get("podSelector"), p.labels)]


def _ip_block(block: Obj, direction: str) -> str:
    match = f"ip {direction} {block['cidr']}"
    if block.get("except"):
        match += f" ip {direction} != {{ {', '.join(block['except'])} }}"
    return match


def _port_matches(ports: list[Obj] | None, owner: Pod | None) -> list[str] | None:
    """nft matches for a rule's ``ports`` (None: every port and protocol); a named port resolves
    against ``owner``'s container ports and matches nothing where it has none of that name."""
    if not ports:
        return None
    matches = []
    for entry in ports:
        protocol = entry.get("protocol", "TCP")
        l4 = f"meta l4proto {PROTOCOLS[protocol]}"
        port = entry.get("port")
        if port is None:
            matches.append(l4)
        elif isinstance(port, int):
            end = entry.get("endPort")
            matches.append(f"{l4} th dport {port}-{end}" if end else f"{l4} th dport {port}")
        elif owner is not None and (port, protocol) in owner.ports:
            matches.append(f"{l4} th dport {owner.ports[(port, protocol)]}")
    return matches


def _allow_lines(rule: Obj, ingress: bool, isolated: Pod, namespaces: dict[str, dict[str, str]],
                 pods: list[Pod]) -> list[str]:  # fmt: skip
    """The ``return`` lines of one ingress or egress rule of a policy that isolates ``isolated``."""
    peers, ports = rule.get("from" if ingress else "to"), rule.get("ports")
    # (address match, the pod whose named ports apply): ingress resolves names on the isolated pod,
    # egress on each destination pod (so an ipBlock destination matches numbered ports only)
    targets: list[tuple[str, Pod | None]] = []
    if not peers:  # absent or empty: every peer
        targets.append(("", isolated if ingress else None))
        if not ingress and any(isinstance(entry.get("port"), str) for entry in ports or []):
            targets += [(f"ip daddr {pod.ip}", pod) for pod in pods]
    for peer in peers or []:
        if "ipBlock" in peer:
            targets.append(
                (_ip_block(peer["ipBlock"], "saddr" if ingress else "daddr"), isolated if ingress else None)
            )
            continue
        members = peer_pods(peer, isolated.namespace, namespaces, pods)
        if ingress and members:
            targets.append((f"ip saddr {{ {', '.join(sorted(p.ip for p in members))} }}", isolated))
        elif not ingress:
            targets += [(f"ip daddr {member.ip}", member) for member in members]
    lines = []
    for address, owner in targets:
        matches = _port_matches(ports, owner)
        for port in [""] if matches is None else matches:
            lines.append(" ".join(part for part in (address, port, "return") if part))
    return lines


def policy_types(policy: Obj) -> list[str]:
    spec = policy.get("spec") or {}
    return spec.get("policyTypes") or (["Ingress", "Egress"] if spec.get("egress") else ["Ingress"])


def ruleset(policies: list[Obj], pod_items: list[Obj], namespace_items: list[Obj], node: str,
            exempt: str = HOST_IP) -> str:  # fmt: skip
    """The whole table for ``node`` (replaced in one transaction): its pods that a policy isolates
    get an ingress and/or egress chain of allowed peers ending in ``drop``."""
    namespaces = {n["metadata"]["name"]: n["metadata"].get("labels") or {} for n in namespace_items}
    pods = live_pods(pod_items)
    chains: list[str] = []
    jumps: dict[str, list[str]] = {"saddr": [], "daddr": []}
    for pod in (p for p in pods if p.node == node):
        # ingress chains are jumped to by the packet's destination, egress chains by its source
        for kind, key, verdict_on in (("Ingress", "ingress", "daddr"), ("Egress", "egress", "saddr")):
            isolating = [
                policy for policy in policies
                if policy["metadata"]["namespace"] == pod.namespace and kind in policy_types(policy)
                and selects((policy.get("spec") or {}).get("podSelector"), pod.labels)
            ]  # fmt: skip
            if not isolating:
                continue
            chain = f"{key}_{len(jumps[verdict_on])}"
            body = [
                line
                for policy in isolating
                for rule in (policy.get("spec") or {}).get(key) or []
                for line in _allow_lines(rule, kind == "Ingress", pod, namespaces, pods)
            ]
            policies_named = ", ".join(sorted(p["metadata"]["name"] for p in isolating))
            chains.append(
                f"  chain {chain} {{\n"
                f'    comment "{kind.lower()} of {pod.namespace}/{pod.name} ({policies_named})"\n'
                + "".join(f"    {line}\n" for line in body)
                + "    counter drop\n  }\n"
            )
            jumps[verdict_on].append(f"{pod.ip} : jump {chain}")
    forward = [
        "type filter hook forward priority filter; policy accept;",
        "ct state established,related accept",
        f"ip saddr {exempt} accept",
    ]
    if jumps["saddr"]:
        forward.append(f"ip saddr vmap {{ {', '.join(jumps['saddr'])} }}")
    if jumps["daddr"]:
        forward.append(f"ip daddr vmap {{ {', '.join(jumps['daddr'])} }}")
    return (
        f"table inet {TABLE}\ndelete table inet {TABLE}\n"
        f"table inet {TABLE} {{\n  chain forward {{\n"
        + "".join(f"    {line}\n" for line in forward)
        + "  }\n"
        + "".join(chains)
        + "}\n"
    )


def main(argv: list[str]) -> int:
    """``KUBECONFIG NODE``: keep NODE's table current (run inside the node's network namespace)."""
    items, node = bed_lister(Path(argv[0])), argv[1]
    applied = None
    while True:
        try:
            policies = items("/apis/networking.k8s.io/v1/networkpolicies")
            text = ruleset(policies, items("/api/v1/pods"), items("/api/v1/namespaces"), node)
        except (OSError, ValueError, KeyError) as exc:
            print(f"netpol: {exc}", file=sys.stderr, flush=True)
        else:
            if text != applied:
                done = subprocess.run(["nft", "-f", "-"], input=text, capture_output=True, text=True)
                if done.returncode == 0:
                    chains = text.count("  chain ") - 1
                    print(
                        f"netpol: {len(policies)} policies, {chains} isolation chains on {node}", flush=True
                    )
                    applied = text
                else:
                    print(
                        f"netpol: nft refused the rules: {done.stderr.strip()}", file=sys.stderr, flush=True
                    )
        time.sleep(INTERVAL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
