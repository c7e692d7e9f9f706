"""Sandbox pods as the operator builds them: the pod template, the deny-all policy, the rollout's RBAC."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.operator.builders import labels as L
from mixrl.operator.builders import sandbox as B
from mixrl.operator.builders.objects import BuildOptions, Images, Owner
from mixrl.operator.builders.resources import run_objects
from mixrl.operator.kube import rbac
from mixrl.rl.rollout import worker
from mixrl.rl.sandbox import kubernetes as K
from mixrl.rl.sandbox.lease import WORKER_LABEL, executor_port, named_pod
from tests.network_reach import Pod, reachable

Obj = dict[str, Any]
OWNER = Owner("mixrl.dev/v1alpha1", "RLRun", "demo", "11111111-2222-3333-4444-555555555555")


def manifest(sandbox: Obj | None) -> Obj:
    rollout: Obj = {"environment": "coding"}
    if sandbox is not None:
        rollout["sandbox"] = sandbox
    return {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "demo", "namespace": "rl"},
        "spec": {
            "model": {"path": "/weights/base/qwen3-8b"},
            "trainer": {"gpuType": "H200", "nodes": 1, "gpusPerNode": 8},
            "samplerPools": [{"name": "h100", "gpuType": "H100", "weightPrecision": "fp8", "minReplicas": 1}],
            "weights": {"store": "file:///weights", "volumeSize": "100Gi"},
            "rollout": rollout,
        },
    }


def resolved_of(sandbox: Obj | None) -> ResolvedRun:
    run = parse_document(manifest(sandbox))
    assert isinstance(run, RLRun)
    return resolve(run)


def by_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


SPEC = {"poolSize": 3, "runtimeClassName": "gvisor", "resources": {"cpu": "500m", "memory": "768Mi"}}


def test_the_pod_template_is_locked_down_and_owned_by_the_run() -> None:
    pod = B.sandbox_pod_template(resolved_of(SPEC), OWNER, Images())
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["runtimeClassName"] == "gvisor"
    assert spec["restartPolicy"] == "Never"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [main] = spec["containers"]
    context = main["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert main["resources"]["limits"] == {"cpu": "500m", "memory": "768Mi"} == main["resources"]["requests"]
    assert main["command"][:2] == ["mixrl", "sandbox-exec"]
    assert {m["mountPath"] for m in main["volumeMounts"]} == {B.WORK_DIR, "/tmp"}
    assert all("emptyDir" in v for v in spec["volumes"])  # no config, no token, no weights
    [owner] = pod["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("RLRun", OWNER.uid, True)
    assert owner["blockOwnerDeletion"] is False  # the rollout's Role holds no finalizers update
    assert pod["metadata"]["labels"][L.COMPONENT] == "sandbox"
    assert executor_port(pod) == B.EXECUTOR_PORT


def test_without_a_runtime_class_none_is_set_and_the_image_defaults_to_the_components() -> None:
    pod = B.sandbox_pod_template(resolved_of({}), OWNER, Images(components="registry/c:1"))
    assert "runtimeClassName" not in pod["spec"]
    assert pod["spec"]["containers"][0]["image"] == "registry/c:1"
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}


def test_a_named_pod_is_a_valid_pod_for_kubernetes() -> None:
    pod = named_pod(B.sandbox_pod_template(resolved_of(SPEC), OWNER, Images()), "w-0-sb-ab12-1", "w-0")
    assert pod["metadata"]["name"] == "w-0-sb-ab12-1"
    assert pod["metadata"]["labels"][WORKER_LABEL] == "w-0"
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)


def test_the_run_carries_the_template_and_the_rollout_gets_its_account() -> None:
    resolved = resolved_of(SPEC)
    objects = run_objects(resolved, OWNER, BuildOptions())
    config = by_kind(objects, "ConfigMap")[0]
    template = json.loads(config["data"][B.SANDBOX_TEMPLATE_KEY])
    assert template == B.sandbox_pod_template(resolved, OWNER, Images())
    [rollout] = [o for o in by_kind(objects, "StatefulSet") if o["metadata"]["name"] == "demo-rollout"]
    pod_spec = rollout["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == "demo-rollout"
    assert pod_spec["automountServiceAccountToken"] is True
    [account], [role], [binding] = (by_kind(objects, k) for k in ("ServiceAccount", "Role", "RoleBinding"))
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete", "get", "list"]}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "rl"}
    ]
    for obj in (account, role, binding, *by_kind(objects, "NetworkPolicy")):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        assert rbac.resource_of(obj)  # the operator's client can apply each


def test_without_sandbox_pods_nothing_changes() -> None:
    objects = run_objects(resolved_of(None), OWNER, BuildOptions())
    assert not by_kind(objects, "ServiceAccount") and not by_kind(objects, "Role")
    assert B.SANDBOX_TEMPLATE_KEY not in by_kind(objects, "ConfigMap")[0]["data"]
    [rollout] = [o for o in by_kind(objects, "StatefulSet") if o["metadata"]["name"] == "demo-rollout"]
    assert rollout["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    with pytest.raises(ValueError, match=r"spec\.rollout\.sandbox: not set"):
        B.sandbox_pod_template(resolved_of(None), OWNER, Images())


def test_the_operator_holds_every_verb_it_grants() -> None:
    """Kubernetes refuses a Role granting more than its creator holds (RBAC escalation prevention)."""
    rules = rbac.operator_rules(clusterwide=False)
    for (group, resource), verbs in B.ROLLOUT_SANDBOX_RULES.items():
        for verb in verbs:
            assert rbac.rules_allow(rules, group, resource, verb), (resource, verb)
    for resource in ("serviceaccounts", "roles", "rolebindings"):
        group = "" if resource == "serviceaccounts" else "rbac.authorization.k8s.io"
        assert rbac.rules_allow(rules, group, resource, "create")


def test_only_the_runs_rollout_pods_reach_a_sandbox_pod_and_it_reaches_nothing() -> None:
    resolved = resolved_of(SPEC)
    policies = by_kind(run_objects(resolved, OWNER, BuildOptions()), "NetworkPolicy")
    ns_labels = {"kubernetes.io/metadata.name": "rl"}

    def pod(name: str, labels: dict[str, str], ports: dict[str, int], namespace: str = "rl") -> Pod:
        return Pod(name, namespace, labels, ports, {"kubernetes.io/metadata.name": namespace})

    box = pod("box", {**B.selector("demo"), WORKER_LABEL: "w"}, {B.EXECUTOR_PORT_NAME: B.EXECUTOR_PORT})
    rollout = pod("r", L.selector_labels("demo", "rollout"), {"metrics": 9100})
    trainer = pod("t", L.selector_labels("demo", "trainer"), {"metrics": 9100})
    other_run = pod("o", L.selector_labels("other", "rollout"), {"metrics": 9100})
    elsewhere = pod("e", L.selector_labels("demo", "rollout"), {"metrics": 9100}, namespace="x")
    assert ns_labels == box.namespace_labels
    assert reachable(policies, rollout, box, B.EXECUTOR_PORT_NAME)
    for source in (trainer, other_run, elsewhere, box):
        assert not reachable(policies, source, box, B.EXECUTOR_PORT_NAME), source.name
    [own] = [p for p in policies if p["metadata"]["name"] == "demo-sandbox"]
    # Egress: listed as a policy type with no rule, so Kubernetes lets nothing out (DNS included).
    assert "Egress" in own["spec"]["policyTypes"] and own["spec"]["egress"] == []
    assert K.WORKER_LABEL == WORKER_LABEL


def test_bad_sandbox_fields_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="poolSize"):
        resolved_of({"poolSize": 0})
    with pytest.raises(ValueError, match="runtimeClassName"):
        resolved_of({"runtimeClassName": "Not A Name"})
    with pytest.raises(ValueError, match="sizeOfPool"):
        resolved_of({"sizeOfPool": 2})


def test_the_rollout_worker_takes_sandbox_pods_from_the_manifest_beside_its_config(tmp_path: Path) -> None:
    """The worker reads the operator's pod manifest beside the resolved run; without it, one line
    (tests/sandbox/test_backend.py: the other refusals, and the environment using the pods)."""
    config = tmp_path / "run.json"
    config.write_text(resolved_of(SPEC).model_dump_json())
    args = argparse.Namespace(config=str(config), worker_index=0, max_steps_ahead=None, tokenizer=None)
    with pytest.raises(ValueError, match=r"^spec\.rollout\.sandbox: cannot read the sandbox pod manifest"):
        worker.load_worker(args)
