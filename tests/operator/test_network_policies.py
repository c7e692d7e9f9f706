"""The run's NetworkPolicies: who may reach whom (the builders' policies, evaluated by Kubernetes'
ingress rules on the labels and named ports of the run's own pods), and switching them off through
the running operator (the earlier operator's policies are deleted, only the run's own).

Stand-in: the API server (kmock's emulator, see conftest.py); no network plugin enforces anything
here, so ``tests/network_reach.py`` evaluates the policies as the plugins do.  tests/cluster/ checks that the
real API server accepts them and the real node enforces them (test_real_run.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixrl.api.loader import load_rlrun, parse_document
from mixrl.api.models import RLRun, RoutingHealthSpec
from mixrl.api.resolve import resolve
from mixrl.operator.builders.network import network_policies, policy_names
from mixrl.operator.builders.objects import NAMESPACE_NAME_LABEL, BuildOptions, Images, Owner, Scrapers
from mixrl.operator.builders.pools import pool_children
from mixrl.operator.builders.resources import run_objects, seed_replicas
from mixrl.operator.kube import rbac

from ..network_reach import COMPONENT, Pod, open_connections, reachable
from .emulator import ApiServer
from .support import NAMESPACE, assert_covered, create, eventually, operator_calls, settled, small_run

Obj = dict[str, Any]
NETWORKPOLICIES = "networking.k8s.io/v1/networkpolicies"
ROOT = Path(__file__).resolve().parents[2]


def pods_of(objects: list[Obj]) -> list[Pod]:
    """One pod per workload, with its template's labels and named ports."""
    pods = []
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = obj["spec"]["template"]
        ports = {
            p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
        }
        namespace = obj["metadata"]["namespace"]
        pods.append(
            Pod(obj["metadata"]["name"], namespace, template["metadata"]["labels"], ports,
                {NAMESPACE_NAME_LABEL: namespace})
        )  # fmt: skip
    return pods


def run_pods_and_policies(
    name: str, namespace: str, scrapers: Scrapers, routing: bool = False
) -> tuple[list[Pod], list[Obj]]:
    run = load_rlrun(ROOT / "examples" / "rlrun-mixed.yaml")
    run.metadata.name, run.metadata.namespace = name, namespace
    if routing:
        run.spec.health.routing = RoutingHealthSpec(kl_threshold=0.01, extreme_share_threshold=0.01)
    resolved = resolve(run)
    options = BuildOptions(images=Images(network_policies=scrapers))
    objects = run_objects(resolved, Owner("mixrl.dev/v1alpha1", "RLRun", name, "uid"), options)
    for pool in resolved.pools:
        owner = Owner("mixrl.dev/v1alpha1", "SamplerPool", pool.object_name, "uid")
        objects += pool_children(resolved, pool, seed_replicas(pool), owner, options)
    return pods_of(objects), [o for o in objects if o["kind"] == "NetworkPolicy"]


WANTED = {
    ("rollout", "router", "http"),
    ("rollout", "buffer", "http"),
    ("trainer", "buffer", "http"),
    ("trainer", "trainer", "rdzv"),
    ("trainer", "trainer", "metrics"),  # every port between ranks: NCCL picks its own
    ("router", "sampler", "engine"),
}
"""(from component, to component, port): every connection between a run's pods it needs."""


def test_only_the_connections_a_run_needs_are_open_between_its_pods() -> None:
    pods, policies = run_pods_and_policies("demo", "rl", Scrapers())
    assert open_connections(policies, pods) == WANTED
    assert {t.labels[COMPONENT] for t in pods} == {"trainer", "buffer", "router", "rollout", "sampler"}


def test_mismatch_aware_routing_opens_the_buffer_to_the_router_and_nothing_else() -> None:
    pods, policies = run_pods_and_policies("demo", "rl", Scrapers(), routing=True)
    assert open_connections(policies, pods) == WANTED | {("router", "buffer", "http")}


def test_another_run_and_other_pods_reach_nothing_but_scrapers_read_metrics() -> None:
    pods, policies = run_pods_and_policies("demo", "rl", Scrapers(namespace="monitoring"))
    others, other_policies = run_pods_and_policies("other", "rl", Scrapers())
    stranger = Pod("curl", "rl", {"app": "curl"}, {}, {NAMESPACE_NAME_LABEL: "rl"})
    prometheus_labels = {"app.kubernetes.io/name": "prometheus"}
    scraper = Pod("prom", "monitoring", prometheus_labels, {}, {NAMESPACE_NAME_LABEL: "monitoring"})
    elsewhere = Pod("prom", "team-b", prometheus_labels, {}, {NAMESPACE_NAME_LABEL: "team-b"})
    every = policies + other_policies
    for target in pods:
        for port in target.ports:
            assert not reachable(every, stranger, target, port), (target.name, port)
            assert not any(reachable(every, o, target, port) for o in others), (target.name, port)
            metrics = port in ("metrics", "engine")
            assert reachable(every, scraper, target, port) == metrics, (target.name, port)
            assert not reachable(every, elsewhere, target, port), "scrapers only from their namespace"


def test_a_pod_no_policy_selects_is_reachable_so_the_evaluator_is_not_vacuous() -> None:
    pods, _ = run_pods_and_policies("demo", "rl", Scrapers())
    stranger = Pod("curl", "rl", {"app": "curl"}, {}, {NAMESPACE_NAME_LABEL: "rl"})
    assert all(reachable([], stranger, target, port) for target in pods for port in target.ports)


def test_every_component_has_one_policy_named_after_it() -> None:
    resolved = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    names = [
        p["metadata"]["name"] for p in network_policies(resolved, Owner("v", "RLRun", "q", "u"), Scrapers())
    ]
    assert names == [f"quickstart-{c}-ingress" for c in ("trainer", "buffer", "router", "sampler", "rollout")]
    assert policy_names(resolved) == names  # the names the switch-off deletes by


def test_without_network_policies_a_sandbox_run_keeps_its_sandboxes_containment() -> None:
    manifest = small_run()
    manifest["spec"]["rollout"] = {"environment": "coding", "sandbox": {}}
    run = parse_document(manifest)
    assert isinstance(run, RLRun)
    resolved = resolve(run)
    owner = Owner("v", "RLRun", resolved.name, "u")
    off = BuildOptions(images=Images(network_policies=None))
    policies = [
        o["metadata"]["name"] for o in run_objects(resolved, owner, off) if o["kind"] == "NetworkPolicy"
    ]
    assert policies == [f"{resolved.name}-sandbox"], "the sandbox's deny-all, none of the ingress ones"


async def test_without_network_policies_the_earlier_operators_are_deleted_and_no_more_made(
    api: ApiServer, operator: Any
) -> None:
    async with operator():
        await create(api, small_run("demo"))
        await eventually(lambda: api.live(NETWORKPOLICIES, NAMESPACE, "demo-buffer-ingress"), what="policies")
        await settled(api)
    assert len(api.names(NETWORKPOLICIES, NAMESPACE)) == 5
    before = len(list(api))
    async with operator(images=Images(network_policies=None)):
        await eventually(lambda: not api.names(NETWORKPOLICIES, NAMESPACE), what="the run's policies deleted")
        await create(api, small_run("other"))
        await settled(api)
    assert not api.names(NETWORKPOLICIES, NAMESPACE), "none made for the new run either"
    calls = {
        request.method.value
        for request in list(api)[before:]
        if request.resource is not None and request.resource.plural == "networkpolicies"
    }
    assert calls == {"GET", "DELETE"}, "read by name and deleted; never watched without policies"
    assert_covered(operator_calls(api), clusterwide=True)
    assert ("networking.k8s.io", "networkpolicies") in rbac.RECONCILER
