"""A run's NetworkPolicies on the real control plane: the API server (its validation, the chart's
RBAC) accepts the five policies the operator makes, and evaluated on the run's live pods (their
labels and named ports as the controllers made them) they open exactly the connections the run
needs.  No network plugin enforces them here; ``tests/network_reach.py`` evaluates them as one would.
"""

from __future__ import annotations

import yaml

from mixrl.operator.builders.objects import NAMESPACE_NAME_LABEL

from ..network_reach import COMPONENT, Pod, open_connections, reachable
from .conftest import ROOT, Bed, OperatorProcess, wait_for


def live_pods(cluster: Bed, namespace: str, run: str) -> list[Pod]:
    items = cluster.get("pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={run}")["items"]
    labels = cluster.get("namespace", namespace)["metadata"]["labels"]
    return [
        Pod(
            p["metadata"]["name"],
            namespace,
            p["metadata"]["labels"],
            {
                port["name"]: port["containerPort"]
                for c in p["spec"]["containers"]
                for port in c.get("ports", [])
            },
            labels,
        )
        for p in items
        if p.get("status", {}).get("phase") == "Running"
    ]


def test_the_api_server_takes_the_runs_policies_and_they_open_only_what_it_needs(
    cluster: Bed, operator: OperatorProcess, namespace: str
) -> None:
    run = yaml.safe_load((ROOT / "examples" / "rlrun-minimal.yaml").read_text())
    run["metadata"]["namespace"] = namespace
    name = run["metadata"]["name"]
    cluster.apply(run)
    components = {"trainer", "buffer", "router", "rollout", "sampler"}
    pods = wait_for(
        lambda: (
            (found := live_pods(cluster, namespace, name))
            and {p.labels[COMPONENT] for p in found} == components
            and found
        ),
        150,
        what="a Running pod of every component",
    )
    policies = wait_for(
        lambda: [
            p
            for p in cluster.get("networkpolicies", "-n", namespace)["items"]
            if p["metadata"]["name"].startswith(name)
        ],
        60,
        what="the run's NetworkPolicies",
    )
    assert sorted(p["metadata"]["name"] for p in policies) == sorted(
        f"{name}-{c}-ingress" for c in components
    )
    assert all(p["metadata"]["ownerReferences"][0]["kind"] == "RLRun" for p in policies)
    opened = open_connections(policies, pods)
    assert {(s, t) for s, t, _ in opened} == {
        ("rollout", "router"),
        ("rollout", "buffer"),
        ("trainer", "buffer"),
        ("trainer", "trainer"),
        ("router", "sampler"),
    }
    scraper_labels = {"app.kubernetes.io/name": "prometheus"}
    prometheus = Pod("prometheus", "monitoring", scraper_labels, {}, {NAMESPACE_NAME_LABEL: "monitoring"})
    stranger = Pod("curl", namespace, {"app": "curl"}, {}, {NAMESPACE_NAME_LABEL: namespace})
    for target in pods:
        for port in target.ports:
            assert reachable(policies, prometheus, target, port) == (port in ("metrics", "engine"))
            assert not reachable(policies, stranger, target, port)
