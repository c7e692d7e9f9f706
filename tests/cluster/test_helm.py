"""The chart with the real Helm CLI on the real API server: lint, install (the session's release),
upgrade, a namespaced install as a platform engineer would try it, uninstall; image pull secrets
from the chart's values reaching every pod the operator creates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import CHART, CRDS, RELEASE, RELEASE_NS, ROOT, Bed, start_operator, stop_operator, wait_for


def release(cluster: Bed, name: str, namespace: str) -> dict[str, Any]:
    return json.loads(cluster.helm("status", name, "-n", namespace, "-o", "json").stdout)


def manifest_objects(cluster: Bed, name: str, namespace: str) -> list[dict[str, Any]]:
    text = cluster.helm("get", "manifest", name, "-n", namespace).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def test_lint_is_clean(cluster: Bed) -> None:
    out = cluster.helm("lint", "--strict", str(CHART)).stdout
    assert "0 chart(s) failed" in out


def test_the_install_created_everything_it_rendered(cluster: Bed) -> None:
    assert release(cluster, RELEASE, RELEASE_NS)["info"]["status"] == "deployed"
    objects = manifest_objects(cluster, RELEASE, RELEASE_NS)
    kinds = {o["kind"] for o in objects}
    assert {
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
    } <= kinds
    for obj in objects:
        ns = obj["metadata"].get("namespace") or (RELEASE_NS if obj["kind"] not in CLUSTER_SCOPED else None)
        args = ["get", f"{obj['kind']}/{obj['metadata']['name']}", "-o", "name"] + (["-n", ns] if ns else [])
        assert cluster.kubectl(*args).stdout.strip(), obj["kind"]
    deployment = cluster.get(f"deployment/{RELEASE}", "-n", RELEASE_NS)
    assert deployment["status"].get("readyReplicas") == 1  # scheduled on a CPU node, Running (KWOK)


CLUSTER_SCOPED = {
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "ClusterKopfPeering",
    "Namespace",
}


@pytest.fixture
def restore_release(cluster: Bed) -> Iterator[None]:
    revision = release(cluster, RELEASE, RELEASE_NS)["version"]
    yield
    cluster.helm("rollback", RELEASE, str(revision), "-n", RELEASE_NS, "--wait", "--timeout", "60s")


def test_upgrade_changes_what_it_should(
    cluster: Bed, restore_release: None, namespace: str, tmp_path: Path
) -> None:
    before = release(cluster, RELEASE, RELEASE_NS)["version"]
    cluster.helm(
        "upgrade", RELEASE, str(CHART), "-n", RELEASE_NS, "--reuse-values", "--wait", "--timeout", "60s",
        "--set", "operator.replicas=2", "--set", "imagePullSecrets[0].name=regcred",
    )  # fmt: skip
    after = release(cluster, RELEASE, RELEASE_NS)
    assert after["version"] == before + 1 and after["info"]["status"] == "deployed"
    deployment = cluster.get(f"deployment/{RELEASE}", "-n", RELEASE_NS)
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    wait_for(
        lambda: cluster.get(f"deployment/{RELEASE}", "-n", RELEASE_NS)["status"].get("readyReplicas"),
        60,
        equals=2,
    )
    # The chart's operator (its arguments, its credentials) puts the secret on every pod it makes.
    operator = start_operator(cluster, tmp_path)
    try:
        run = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
        run["metadata"]["namespace"] = namespace
        run["spec"]["samplerPools"] = run["spec"]["samplerPools"][:2]
        cluster.apply(run)

        def templates() -> list[dict[str, Any]]:
            items = cluster.get("deployments,statefulsets", "-n", namespace)["items"]
            return items if len(items) >= 5 else []  # trainer, buffer, router, rollout, pools

        for workload in wait_for(templates, 60, what="the run's workloads"):
            spec = workload["spec"]["template"]["spec"]
            assert spec.get("imagePullSecrets") == [{"name": "regcred"}], workload["metadata"]["name"]
    finally:
        stop_operator(operator)
    for crd in CRDS:  # an upgrade never drops the CRDs (every RLRun would go with them)
        cluster.kubectl("get", f"crd/{crd}")


def test_a_namespaced_install_as_a_platform_engineer_tries_it(cluster: Bed) -> None:
    common = [
        str(CHART), "-n", "team-ops", "--create-namespace", "--wait", "--timeout", "60s",
        "--set", "crds.install=false", "--set", "watch.allNamespaces=false",
        "--set", "watch.namespaces={team-a}", "--set", "peering.name=team",
        "--set", "fullnameOverride=team-mixrl",
    ]  # fmt: skip
    refused = cluster.helm("install", "team", *common, check=False)
    assert refused.returncode != 0
    assert 'namespace "team-a" does not exist' in refused.stderr
    assert cluster.kubectl("get", "deployment/team-mixrl", "-n", "team-ops", check=False).returncode != 0
    cluster.helm("install", "team", *common, "--set", "watch.createNamespaces=true")
    roles = cluster.get("roles,rolebindings", "-n", "team-a")["items"]
    assert {r["kind"] for r in roles} == {"Role", "RoleBinding"}
    assert cluster.get("deployment/team-mixrl", "-n", "team-ops")["spec"]["template"]["spec"]["containers"][
        0
    ]["args"][0] == ("--namespace=team-a")
    cluster.helm("uninstall", "team", "-n", "team-ops", "--wait", "--timeout", "60s")
    gone = cluster.kubectl(
        "get", "deployment/team-mixrl", "serviceaccount/team-mixrl", "-n", "team-ops", check=False
    )
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    assert not cluster.get("roles", "-n", "team-a")["items"]
    cluster.kubectl("get", "namespace/team-a")  # created for the release, kept on uninstall (documented)
    for crd in CRDS:
        cluster.kubectl("get", f"crd/{crd}")
