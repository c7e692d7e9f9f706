"""The bed's NetworkPolicy enforcer as pure translation: which pods a policy isolates, which peers and
ports it allows, and that nftables accepts the table (``nft --check`` in a scratch network namespace,
so nothing on the host changes). The data path itself: tests/cluster/test_real_node.py."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest

from mixrl.devcluster import netpol


def pod(ns: str, name: str, ip: str, labels: dict[str, str], ports: dict[str, int] | None = None,
        node: str = "mixrl-node-0", **status: str) -> dict:  # fmt: skip
    container = {"name": "main", "ports": [{"name": n, "containerPort": p} for n, p in (ports or {}).items()]}
    return {
        "metadata": {"namespace": ns, "name": name, "labels": labels},
        "spec": {"nodeName": node, "containers": [container]},
        "status": {"podIP": ip, "phase": "Running", **status},
    }


def namespace(name: str, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name, **labels}}}


def policy(ns: str, name: str, selector: dict, **spec: object) -> dict:
    return {"metadata": {"namespace": ns, "name": name}, "spec": {"podSelector": selector, **spec}}


NAMESPACES = [namespace("rl"), namespace("other"), namespace("monitoring", team="obs")]
PODS = [
    pod("rl", "buffer", "10.245.0.10", {"app": "buffer"}, {"http": 8080, "metrics": 9400}),
    pod("rl", "rollout", "10.245.0.11", {"app": "rollout"}),
    pod("rl", "stray", "10.245.0.12", {"app": "stray"}),
    pod("other", "intruder", "10.245.0.13", {"app": "rollout"}),
    pod("monitoring", "prom", "10.245.0.14", {"app": "prom"}),
    pod("rl", "elsewhere", "10.245.1.10", {"app": "buffer"}, {"http": 8080}, node="mixrl-node-1"),
    pod("rl", "done", "10.245.0.15", {"app": "rollout"}, phase="Succeeded"),
]


def chain_of(text: str, comment: str) -> list[str]:
    """The lines of the chain whose comment names ``comment`` (``ingress of rl/buffer``)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f'comment "{comment} ('))
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "}")
    return [line.strip() for line in lines[start + 1 : end]]


def test_selectors_follow_kubernetes_semantics() -> None:
    labels = {"app": "buffer", "tier": "data"}
    assert netpol.selects({}, labels) and netpol.selects(None, labels)
    assert netpol.selects({"matchLabels": {"app": "buffer"}}, labels)
    assert not netpol.selects({"matchLabels": {"app": "router"}}, labels)
    expressions = [
        ({"key": "tier", "operator": "In", "values": ["data", "web"]}, True),
        ({"key": "tier", "operator": "NotIn", "values": ["data"]}, False),
        ({"key": "zone", "operator": "NotIn", "values": ["a"]}, True),
        ({"key": "zone", "operator": "Exists"}, False),
        ({"key": "zone", "operator": "DoesNotExist"}, True),
        ({"key": "app", "operator": "DoesNotExist"}, False),
    ]
    for expression, expected in expressions:
        assert netpol.selects({"matchExpressions": [expression]}, labels) is expected, expression


def test_an_ingress_policy_allows_its_peers_on_the_named_port_and_drops_the_rest() -> None:
    policies = [
        policy("rl", "buffer-in", {"matchLabels": {"app": "buffer"}}, policyTypes=["Ingress"], ingress=[
            {"from": [{"podSelector": {"matchLabels": {"app": "rollout"}}}], "ports": [{"port": "http"}]},
            {"from": [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}], "ports": [{"port": "metrics"}]},
        ]),
    ]  # fmt: skip
    text = netpol.ruleset(policies, PODS, NAMESPACES, "mixrl-node-0")
    # the rollout pod of rl only: not rl's other pods, not a pod labelled the same in another
    # namespace, not a finished pod; the named ports resolve on the buffer pod
    assert chain_of(text, "ingress of rl/buffer") == [
        "ip saddr { 10.245.0.11 } meta l4proto tcp th dport 8080 return",
        "ip saddr { 10.245.0.14 } meta l4proto tcp th dport 9400 return",
        "counter drop",
    ]
    assert "ip daddr vmap { 10.245.0.10 : jump ingress_0 }" in text
    # the pods no policy selects, and the same pod name on another node, are not isolated here
    assert "10.245.1.10" not in text and "ip saddr vmap" not in text
    assert f"ip saddr {netpol.HOST_IP} accept" in text and "ct state established,related accept" in text


def test_egress_isolation_and_ip_blocks() -> None:
    policies = [
        policy("rl", "deny-out", {"matchLabels": {"app": "stray"}}, policyTypes=["Egress"], egress=[]),
        policy("rl", "rollout-out", {"matchLabels": {"app": "rollout"}}, policyTypes=["Ingress", "Egress"],
               ingress=[], egress=[
                   {"to": [{"podSelector": {"matchLabels": {"app": "buffer"}}}], "ports": [{"port": "http"}]},
                   {"to": [{"ipBlock": {"cidr": "10.96.0.0/16", "except": ["10.96.0.1/32"]}}],
                    "ports": [{"port": 53, "protocol": "UDP"}, {"port": 8000, "endPort": 8100}]},
               ]),
    ]  # fmt: skip
    text = netpol.ruleset(policies, PODS, NAMESPACES, "mixrl-node-0")
    assert chain_of(text, "egress of rl/stray") == ["counter drop"]
    assert chain_of(text, "ingress of rl/rollout") == ["counter drop"]
    # egress resolves a named port on each destination pod: both buffers (one on another node)
    assert chain_of(text, "egress of rl/rollout") == [
        "ip daddr 10.245.0.10 meta l4proto tcp th dport 8080 return",
        "ip daddr 10.245.1.10 meta l4proto tcp th dport 8080 return",
        "ip daddr 10.96.0.0/16 ip daddr != { 10.96.0.1/32 } meta l4proto udp th dport 53 return",
        "ip daddr 10.96.0.0/16 ip daddr != { 10.96.0.1/32 } meta l4proto tcp th dport 8000-8100 return",
        "counter drop",
    ]


def test_several_policies_allow_their_union_and_an_empty_rule_allows_everyone() -> None:
    policies = [
        policy("rl", "a", {"matchLabels": {"app": "buffer"}}, ingress=[{"from": [{"podSelector": {}}]}]),
        policy("rl", "b", {}, ingress=[{"ports": [{"port": 9400}]}]),
    ]
    text = netpol.ruleset(policies, PODS, NAMESPACES, "mixrl-node-0")
    assert (
        chain_of(text, "ingress of rl/buffer")
        == [
            "ip saddr { 10.245.0.10, 10.245.0.11, 10.245.0.12, 10.245.1.10 } return",  # every live pod of rl, any node
            "meta l4proto tcp th dport 9400 return",
            "counter drop",
        ]
    )
    # policy b (policyTypes defaulted: Ingress) selects every pod of rl on this node
    assert chain_of(text, "ingress of rl/stray") == ["meta l4proto tcp th dport 9400 return", "counter drop"]


def test_a_named_port_the_pod_lacks_allows_nothing() -> None:
    policies = [
        policy("rl", "a", {"matchLabels": {"app": "rollout"}}, ingress=[{"ports": [{"port": "http"}]}])
    ]
    text = netpol.ruleset(policies, PODS, NAMESPACES, "mixrl-node-0")
    assert chain_of(text, "ingress of rl/rollout") == ["counter drop"]


@pytest.fixture
def scratch_netns() -> Iterator[str]:
    name = f"mixrl-netpol-check-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_nft_accepts_the_table_and_replaces_it_whole(scratch_netns: str) -> None:
    policies = [
        policy("rl", "buffer-in", {"matchLabels": {"app": "buffer"}}, ingress=[
            {"from": [{"podSelector": {"matchLabels": {"app": "rollout"}}}], "ports": [{"port": "http"}]}]),
        policy("rl", "deny-out", {"matchLabels": {"app": "stray"}}, policyTypes=["Egress"], egress=[]),
        policy("rl", "none", {"matchLabels": {"app": "absent"}}),
    ]  # fmt: skip
    inside = ["ip", "netns", "exec", scratch_netns, "nft"]
    for round_ in (policies, policies[:1], []):
        text = netpol.ruleset(round_, PODS, NAMESPACES, "mixrl-node-0")
        done = subprocess.run([*inside, "-f", "-"], input=text, capture_output=True, text=True)
        assert done.returncode == 0, f"{done.stderr}\n{text}"
        listed = subprocess.run(
            [*inside, "list", "table", "inet", netpol.TABLE], capture_output=True, text=True
        )
        assert listed.stdout.count("chain ") == text.count("  chain "), listed.stdout
        # the chains say whose they are (what the data-path test waits for)
        assert listed.stdout.count('comment "ingress of') == text.count('comment "ingress of'), listed.stdout
