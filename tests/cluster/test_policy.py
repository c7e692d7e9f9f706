"""The chart's policy on the real control plane: `helm upgrade` with policy values installs a
ValidatingAdmissionPolicy, so the real kube-apiserver refuses a violating RLRun at admission with
the line the operator would report, and accepts a compliant one; a violating run that got in before
the policy is refused by the operator, started with the chart's own arguments and RBAC: a
PolicyViolation condition naming the field, and nothing of it created."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.operator.install.cluster_policy import Policy, violation

from .conftest import CHART, RELEASE, RELEASE_NS, ROOT, Bed, start_operator, stop_operator, wait_for

Obj = dict[str, Any]
POLICY = Policy(allowed_images=("ghcr.io/mixrl/", "lmsysorg/sglang:"), allow_scheduling=False)
POLICY_VALUES = [
    "--set-json", 'policy.allowedImages=["ghcr.io/mixrl/","lmsysorg/sglang:"]',
    "--set", "policy.allowScheduling=false",
]  # fmt: skip


def release_revision(cluster: Bed) -> int:
    revision: int = json.loads(cluster.helm("status", RELEASE, "-n", RELEASE_NS, "-o", "json").stdout)[
        "version"
    ]
    return revision


@pytest.fixture
def restore_release(cluster: Bed) -> Iterator[None]:
    revision = release_revision(cluster)
    yield
    cluster.helm("rollback", RELEASE, str(revision), "-n", RELEASE_NS, "--wait", "--timeout", "60s")


def run(name: str, namespace: str) -> Obj:
    """examples/rlrun-mixed.yaml with two pools, under ``name``."""
    doc: Obj = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
    doc["metadata"].update(name=name, namespace=namespace)
    doc["spec"]["samplerPools"] = doc["spec"]["samplerPools"][:2]
    return doc


def refusal(doc: Obj) -> str:
    parsed = parse_document(doc)
    assert isinstance(parsed, RLRun)
    line = violation(POLICY, parsed.spec)
    assert line is not None
    return line


def workloads(cluster: Bed, namespace: str, run_name: str) -> list[str]:
    items = cluster.get(
        "deployments,statefulsets", "-n", namespace, "-l", f"app.kubernetes.io/instance={run_name}"
    )
    return [i["metadata"]["name"] for i in items["items"]]


def test_the_policy_refuses_at_admission_and_in_the_operator(
    cluster: Bed, restore_release: None, namespace: str, tmp_path: Path
) -> None:
    # Before the policy: a run with an image of its own from anywhere is accepted.
    early = run("early", namespace)
    early["spec"]["samplerPools"][1]["image"] = "docker.io/evil/sglang:1"
    cluster.apply(early)
    early_line = refusal(early)
    assert early_line.startswith(
        "spec.samplerPools[1].image: docker.io/evil/sglang:1 is not an allowed image"
    )

    cluster.helm(
        "upgrade", RELEASE, str(CHART), "-n", RELEASE_NS, "--reuse-values", "--wait", "--timeout", "60s",
        *POLICY_VALUES,
    )  # fmt: skip
    assert cluster.kubectl("get", "validatingadmissionpolicy/mixrl-rlrun-policy", "-o", "name").stdout.strip()
    binding = cluster.get("validatingadmissionpolicybinding/mixrl-rlrun-policy")
    assert binding["spec"]["policyName"] == "mixrl-rlrun-policy"

    # At admission: kubectl apply of a violating run is refused, naming the field, with the
    # operator's line (the policy takes effect once the API server has read it: wait for that).
    scheduled = run("scheduled", namespace)
    scheduled["spec"]["trainer"]["scheduling"] = {
        "tolerations": [{"key": "node-role.kubernetes.io/control-plane"}]
    }
    line = refusal(scheduled)
    assert (
        line
        == "spec.trainer.scheduling.tolerations: scheduling overrides are not allowed by the cluster's policy"
    )

    def refused() -> str:
        done = cluster.apply(scheduled, check=False)
        if done.returncode == 0:
            # Admitted before the API server had read the policy: delete it and try again (an
            # update that leaves the spec alone is, by design, never refused).
            name = scheduled["metadata"]["name"]
            cluster.kubectl("delete", "rlr", name, "-n", namespace, "--wait=true", check=False)
            return ""
        return done.stderr

    stderr = wait_for(refused, 30, what="the admission policy to refuse the run")
    assert line in stderr and "ValidatingAdmissionPolicy 'mixrl-rlrun-policy'" in stderr, stderr
    assert "forbidden" in stderr.lower()
    image = run("imaged", namespace)
    image["spec"]["samplerPools"][0]["image"] = "ghcr.io/mixrl-evil/sglang:1"
    done = cluster.apply(image, check=False)
    assert done.returncode != 0 and refusal(image) in done.stderr, done.stderr
    # The sandbox pods' image is the run's own too, under the same prefixes.
    sandboxed = run("sandboxed", namespace)
    sandboxed["spec"]["rollout"].update(environment="coding", sandbox={"image": "docker.io/evil/sandbox:1"})
    sandbox_line = refusal(sandboxed)
    assert sandbox_line.startswith(
        "spec.rollout.sandbox.image: docker.io/evil/sandbox:1 is not an allowed image"
    )
    done = cluster.apply(sandboxed, check=False)
    assert done.returncode != 0 and sandbox_line in done.stderr, done.stderr
    for name in ("scheduled", "imaged", "sandboxed"):
        assert cluster.kubectl("get", f"rlrun/{name}", "-n", namespace, check=False).returncode != 0, name

    # A compliant run (the chart's images, or its own from an allowed registry) is accepted.
    compliant = run("compliant", namespace)
    compliant["spec"]["samplerPools"][0]["image"] = "lmsysorg/sglang:v0.5.6"
    cluster.apply(compliant)

    # The run that got in before the policy: changing its spec is checked (still violating:
    # refused), while writes that leave the spec alone, such as the operator's annotations, are not.
    edited = copy.deepcopy(early)
    edited["spec"]["samplerPools"][0]["minReplicas"] = 2
    edited["spec"]["samplerPools"][0]["maxReplicas"] = 2
    done = cluster.apply(edited, check=False)
    assert done.returncode != 0 and early_line.split(" (and")[0] in done.stderr, done.stderr
    cluster.kubectl("annotate", "rlrun/early", "-n", namespace, "example.com/owner=team-a")

    # The operator, with the chart's arguments (now carrying the policy) and its RBAC.
    operator = start_operator(cluster, tmp_path)
    try:

        def early_condition() -> Obj:
            status = cluster.get("rlrun/early", "-n", namespace).get("status") or {}
            found = {c["type"]: c for c in status.get("conditions") or []}
            return found.get("PolicyViolation") or {}

        condition = wait_for(lambda: early_condition().get("status") == "True" and early_condition(), 60,
                             what="PolicyViolation on the run admitted before the policy")  # fmt: skip
        assert condition["reason"] == "PolicyViolation" and condition["message"] == early_line
        assert cluster.get("rlrun/early", "-n", namespace)["status"]["phase"] == "Invalid"
        wait_for(
            lambda: len(workloads(cluster, namespace, "compliant")) >= 5,
            60,
            what="the compliant run's workloads",
        )
        assert workloads(cluster, namespace, "early") == [], "nothing of the refused run"
        assert not cluster.get("samplerpools", "-n", namespace, "-l", "app.kubernetes.io/instance=early")[
            "items"
        ]
        events = cluster.get("events", "-n", namespace, "--field-selector", "involvedObject.name=early")[
            "items"
        ]
        assert any(e["reason"] == "PolicyViolation" and e["type"] == "Warning" for e in events)
    finally:
        stop_operator(operator)
        print(f"--- operator log (last lines)\n{operator.log_tail()}")
    assert not operator.denied(cluster), "calls the chart's RBAC refused: " + ", ".join(
        operator.denied(cluster)
    )
