"""The Helm chart: values schema, generated files in sync, ``helm lint``, and ``helm template`` of
every variant, each rendered object checked against Kubernetes and against the code: the RBAC
registry, the operator's own parser, and the builders fed the flags the chart passes."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mixrl.api.crd import rlrun_crd, samplerpool_crd
from mixrl.api.gpus import GPU_RESOURCE, GPU_TABLE
from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import resolve
from mixrl.api.scheduling import PACKING_SCHEDULER, packing_profile
from mixrl.operator.builders.monitoring import collapse_rule_groups, dashboard
from mixrl.operator.builders.objects import BuildOptions, Monitoring, Owner, Scrapers
from mixrl.operator.builders.pools import pool_children
from mixrl.operator.builders.resources import pod_monitor, run_objects
from mixrl.operator.install import chart as chart_module
from mixrl.operator.kube.rbac import (
    PLACEMENT_READS,
    PRIORITY_READS,
    operator_rules,
    permissions,
    policy_rules,
)
from mixrl.operator.main import DEV_PRIORITY, images_of, parse_args, peering_priority

from ..operator.support import small_run
from .helm import CHART, Helm, chart_with_values, clusterwide, default_values, everything_on, namespaced

Obj = dict[str, Any]
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
K8S_VERSION = kubernetes_validate.latest_version()
KOPF_CRDS = {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}


def by_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[Obj], kind: str) -> Obj:
    (found,) = by_kind(objects, kind)
    return found


def operator_pod(objects: list[Obj]) -> Obj:
    pod: Obj = one(objects, "Deployment")["spec"]["template"]["spec"]
    return pod


def operator_args(objects: list[Obj]) -> list[str]:
    args: list[str] = operator_pod(objects)["containers"][0]["args"]
    return args


def on(group: str, resource: str, *verbs: str) -> set[tuple[str, str, str]]:
    """(group, resource, verb) for ``verbs``, or for every verb the registry declares on it."""
    declared = permissions(clusterwide=True).get((group, resource), frozenset())
    return {(group, resource, verb) for verb in verbs or declared}


PODMONITOR_CLEANUP_ONLY = on("monitoring.coreos.com", "podmonitors", "delete")
"""What only annotations mode is granted: deleting the PodMonitor an earlier mode left."""


def grants(rules: list[Obj]) -> set[tuple[str, str, str]]:
    """(group, resource, verb) triples the rules grant (no wildcards are used)."""
    return {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


# ----------------------------------------------------------------------------- values


def test_default_values_satisfy_the_schema() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.validate(default_values(), SCHEMA)
    jsonschema.validate(everything_on(), SCHEMA)
    jsonschema.validate(namespaced("rl", "eval"), SCHEMA)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda v: v["monitoring"].update(mode="grafana"), "mode"),
        (lambda v: v["operator"].update(replicas=0), "replicas"),
        (lambda v: v["operator"].update(replica=2), "replica"),  # a typo is an error, not ignored
        (lambda v: v["watch"].update(allNamespaces="no"), "allNamespaces"),
        (lambda v: v["image"].update(digest="sha256:abc"), "digest"),  # 64 hex digits, or nothing
        (lambda v: v["engineImages"]["sglang"].update(digest="md5:" + "0" * 32), "digest"),
        (lambda v: v["policy"].update(allowedImages=["ghcr.io/ mixrl/"]), "allowedImages"),
        (lambda v: v["policy"].update(allowedEngineFlags=["tokenizer-path"]), "allowedEngineFlags"),
        (
            lambda v: v["policy"].update(allowedEngineFlags=["--tp=2"]),
            "allowedEngineFlags",
        ),  # flags, not values
        (lambda v: v["policy"].update(allowedPriorityClasses=["High"]), "allowedPriorityClasses"),
        (lambda v: v["policy"].update(allowScheduling="no"), "allowScheduling"),
        (lambda v: v["policy"].update(admision=False), "admision"),
        (lambda v: v["watch"].update(namespaces=["Not_A_Namespace"]), "Not_A_Namespace"),
        (lambda v: v["monitoring"]["podMonitor"].update(interval="often"), "often"),
        (lambda v: v["image"].update(repository=""), "repository"),
        (lambda v: v["image"].update(repository="ghcr.io/mixrl/op:1.0"), "repository"),  # tag goes in tag
        (lambda v: v["componentsImage"].update(tag="latest"), "tag"),
        (lambda v: v["trainerImages"]["megatron"].update(tag="latest"), "tag"),
        (lambda v: v["engineImages"]["sglang"].update(tag=""), "tag"),  # not mixrl's version: pinned
        (lambda v: v.update(imagePullSecrets=[{"name": "Reg_Cred"}]), "imagePullSecrets"),
        (lambda v: v["weights"].update(storageClassName="Fast NFS"), "storageClassName"),
        (lambda v: v.update(gpuNodeLabels={"H800": {"a": "b"}}), "H800"),
        (lambda v: v["monitoring"].update(podMonitorLabels={"release": "not a value"}), "podMonitorLabels"),
        # what the operator refuses at start (its pod would crash-loop): its own label keys, a key
        # name over 63 characters, a prefix over 253
        (
            lambda v: v["monitoring"].update(podMonitorLabels={"app.kubernetes.io/name": "x"}),
            "podMonitorLabels",
        ),
        (lambda v: v["monitoring"].update(podMonitorLabels={"a" * 70: "x"}), "podMonitorLabels"),
        (lambda v: v.update(gpuNodeLabels={"H100": {"a" * 254 + "/x": "y"}}), "gpuNodeLabels"),
        (lambda v: v.update(nameOverride="Mixrl"), "nameOverride"),
        (lambda v: v["watch"].update(createNamespaces="yes"), "createNamespaces"),
        (lambda v: v["packing"].update(schedulerName="Mixrl Packing"), "schedulerName"),
        (lambda v: v["packing"].update(gpuPods="yes"), "gpuPods"),
    ],
)
def test_bad_values_are_refused_naming_the_field(change: Any, field: str) -> None:
    values = default_values()
    change(values)
    with pytest.raises(jsonschema.ValidationError) as caught:
        jsonschema.validate(values, SCHEMA)
    assert field in str(caught.value.message) + "/".join(map(str, caught.value.absolute_path))


def test_the_gpu_node_label_keys_are_the_gpu_tables_types() -> None:
    allowed = SCHEMA["properties"]["gpuNodeLabels"]["propertyNames"]["enum"]
    assert allowed == [t for t, gpu in GPU_TABLE.items() if not gpu.emulated]


# ----------------------------------------------------------------------------- generated files


def test_generated_files_match_the_code() -> None:
    assert chart_module.stale_files(CHART) == [], "run `python -m mixrl.operator.install.chart`"
    assert chart_module.main(["--check"]) == 0


def test_the_check_names_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copied = chart_with_values(default_values(), tmp_path)
    rules = copied / "files" / "rbac" / "base.yaml"
    rules.write_text(rules.read_text().replace("- watch", "- watch\n  - deletecollection", 1))
    assert chart_module.main(["--check", "--chart", str(copied)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"{rules}: out of date; run `python -m mixrl.operator.install.chart`"
    )


def test_crd_templates_are_behind_the_install_flag_and_kept_on_uninstall() -> None:
    for name, crd in (("rlruns.mixrl.dev", rlrun_crd()), ("samplerpools.mixrl.dev", samplerpool_crd())):
        text = (CHART / "templates" / "crds" / f"{name}.yaml").read_text()
        assert text.startswith("{{- if .Values.crds.install }}\n") and text.endswith("{{- end }}\n")
        body = yaml.safe_load("\n".join(text.splitlines()[1:-1]))
        assert body["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        del body["metadata"]["annotations"]
        assert body == crd


@pytest.mark.parametrize("clusterwide", [True, False])
def test_the_rbac_files_split_the_registry_without_losing_a_permission(clusterwide: bool) -> None:
    files = chart_module.rbac_files()
    peering = "peering-clusterwide" if clusterwide else "peering-namespaced"
    names = ("base", "keda", "podmonitors", "podmonitors-cleanup", "autoscaler", peering)
    union = set().union(*(grants(files[name]) for name in names))
    assert union == grants(operator_rules(clusterwide=clusterwide))
    # The chart grants one of the two PodMonitor files (by monitoring.mode): within what it grants
    # together, each permission is in one file.
    for monitoring in ("podmonitors", "podmonitors-cleanup"):
        parts = [files[name] for name in names if name in ("base", "keda", monitoring, "autoscaler", peering)]
        for first in range(len(parts)):
            for second in range(first + 1, len(parts)):
                assert not grants(parts[first]) & grants(parts[second]), "each permission in one file"
    assert grants(files["podmonitors-cleanup"]) == {
        ("monitoring.coreos.com", "podmonitors", "get"),
        ("monitoring.coreos.com", "podmonitors", "delete"),
    }, "annotations mode: the leftover PodMonitor is read and deleted, never watched"


# ----------------------------------------------------------------------------- helm lint


@pytest.mark.parametrize("variant", ["default", "everything", "namespaced"])
def test_helm_lint_passes(helm: Helm, variant: str) -> None:
    values = {"default": default_values(), "everything": everything_on(), "namespaced": namespaced("rl")}[
        variant
    ]
    done = helm.lint(values)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


def test_helm_lint_catches_a_broken_template(helm: Helm, tmp_path: Path) -> None:
    """The lint test has teeth: a malformed template is reported."""
    broken = chart_with_values(default_values(), tmp_path)
    (broken / "templates" / "broken.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Values.x\n"
    )
    done = helm.lint(default_values(), broken)
    assert done.returncode != 0 and "templates/broken.yaml" in done.stdout


def test_the_default_namespaced_install_without_namespaces_is_refused_naming_the_setting(helm: Helm) -> None:
    """Namespaced by default: the defaults alone name no namespace, and the install stops saying
    which value to set (``helm lint`` passes: Helm's lint ignores ``fail``, made for required values)."""
    values = default_values()
    assert values["watch"] == {"allNamespaces": False, "namespaces": [], "createNamespaces": False}
    refused = helm.refusal(values)
    assert "watch.namespaces: the operator is namespaced by default" in refused
    assert "watch.allNamespaces=true for a cluster-wide operator" in refused


# ----------------------------------------------------------------------------- helm template


def validate_builtin_kinds(objects: list[Obj]) -> int:
    checked = 0
    for obj in objects:
        if obj["apiVersion"].split("/")[0] in (
            "v1",
            "apps",
            "rbac.authorization.k8s.io",
            "apiextensions.k8s.io",
        ):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            checked += 1
    return checked


def test_template_everything_cluster_wide(helm: Helm) -> None:
    objects = helm.template(everything_on())
    assert sorted({o["kind"] for o in objects}) == [
        "ClusterKopfPeering",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "CustomResourceDefinition",
        "Deployment",
        "PodMonitor",
        "PrometheusRule",
        "ServiceAccount",
    ]
    assert validate_builtin_kinds(objects) >= 8

    # CRDs: mixrl's exactly as generated from the models, kopf's peering CRDs from crds/.
    crds = {o["metadata"]["name"]: o for o in by_kind(objects, "CustomResourceDefinition")}
    assert set(crds) == {"rlruns.mixrl.dev", "samplerpools.mixrl.dev", *KOPF_CRDS}
    for crd in (rlrun_crd(), samplerpool_crd()):
        live = copy.deepcopy(crds[crd["metadata"]["name"]])
        live["metadata"].pop("annotations")
        assert live == crd

    # RBAC: with every feature on, exactly the registry's permissions but annotations mode's
    # PodMonitor clean-up, bound to the service account.
    role = one(objects, "ClusterRole")
    assert grants(role["rules"]) == grants(operator_rules(clusterwide=True)) - PODMONITOR_CLEANUP_ONLY
    binding, account = one(objects, "ClusterRoleBinding"), one(objects, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "mixrl-system"}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]

    # The operator: a command line the real CLI accepts, unprivileged, with requests and limits.
    pod = operator_pod(objects)
    (container,) = pod["containers"]
    assert container["command"] == ["mixrl", "operator"]
    args = parse_args(container["args"])
    assert args.all_namespaces and args.peering == "mixrl" and args.monitoring == "auto"
    assert args.keda == "auto" and args.builtin_autoscaler, "KEDA by discovery, the built-in loop on"
    assert container["image"] == "ghcr.io/mixrl/mixrl-operator:0.1.0"
    assert images_of(args).components == "ghcr.io/mixrl/mixrl-components:0.1.0"
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert (
        set(container["resources"]["requests"]) == set(container["resources"]["limits"]) == {"cpu", "memory"}
    )
    assert container["livenessProbe"]["httpGet"]["port"] == "health"
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]

    # Monitoring: the generated alerts and dashboard, byte for byte.
    assert one(objects, "PrometheusRule")["spec"]["groups"] == collapse_rule_groups()
    board = one(objects, "ConfigMap")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["mixrl-run.json"]) == dashboard()
    monitor = one(objects, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == {"metrics", "engine"}
    # It scrapes as the operator's per-run PodMonitors do (labels honoured, the same relabelings).
    run = parse_document(small_run())
    assert isinstance(run, RLRun)
    per_run = pod_monitor(resolve(run), Owner("v", "RLRun", "demo", "u"), BuildOptions())
    scraping = ("honorLabels", "relabelings")
    assert [{k: e[k] for k in ("port", *scraping)} for e in monitor["spec"]["podMetricsEndpoints"]] == [
        {k: e[k] for k in ("port", *scraping)} for e in per_run["spec"]["podMetricsEndpoints"]
    ]


def test_template_namespaced_gives_roles_and_peerings_only_in_watched_namespaces(helm: Helm) -> None:
    objects = helm.template(namespaced("rl", "eval"))
    kinds = {o["kind"] for o in objects}
    assert not {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering", "Namespace"} & kinds
    roles = {o["metadata"]["namespace"]: o for o in by_kind(objects, "Role")}
    assert set(roles) == {"rl", "eval"}
    for role in roles.values():
        assert grants(role["rules"]) == grants(operator_rules(clusterwide=False)) - PODMONITOR_CLEANUP_ONLY
    assert {o["metadata"]["namespace"] for o in by_kind(objects, "RoleBinding")} == {"rl", "eval"}
    assert {o["metadata"]["namespace"] for o in by_kind(objects, "KopfPeering")} == {"rl", "eval"}
    args = parse_args(operator_args(objects))
    assert args.namespaces == ["rl", "eval"] and not args.all_namespaces
    assert validate_builtin_kinds(objects) >= 6


def test_template_creates_the_watched_namespaces_when_asked_and_keeps_them(helm: Helm) -> None:
    values = namespaced("rl", "eval")
    values["watch"]["createNamespaces"] = True
    objects = helm.template(values)
    spaces = by_kind(objects, "Namespace")
    assert [n["metadata"]["name"] for n in spaces] == ["rl", "eval"]
    for space in spaces:
        assert space["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}, "they hold the runs"
        kubernetes_validate.validate(space, K8S_VERSION, strict=True)


def test_the_releases_own_namespace_is_left_to_helm(helm: Helm) -> None:
    """Helm's --create-namespace makes it before the chart's objects: a Namespace of the chart's
    for it failed the first install (AlreadyExists)."""
    values = namespaced("mixrl-system", "rl")
    values["watch"]["createNamespaces"] = True
    assert [n["metadata"]["name"] for n in by_kind(helm.template(values), "Namespace")] == ["rl"]


def test_an_existing_service_account_must_be_named(helm: Helm) -> None:
    """Not the namespace's `default` account, which every pod there runs as."""
    values = clusterwide()
    values["serviceAccount"] = {"create": False, "name": "", "annotations": {}}
    assert "serviceAccount.name: with serviceAccount.create false" in helm.refusal(values)


def test_large_numbers_from_a_values_file_stay_integers(helm: Helm) -> None:
    values = clusterwide()
    values["operator"]["drainSeconds"] = 1_000_000  # a values file's numbers are floats to Helm
    objects = helm.template(values)
    assert parse_args(operator_args(objects)).drain_seconds == 1_000_000


def test_template_minimal_without_crds_rbac_or_service_account(helm: Helm) -> None:
    values = clusterwide()
    values["crds"]["install"] = False
    values["rbac"]["create"] = False
    values["serviceAccount"] = {"create": False, "name": "platform-operator", "annotations": {}}
    values["autoscaling"] = {"builtin": False, "keda": "off"}
    objects = helm.template(values)
    crds = {o["metadata"]["name"] for o in by_kind(objects, "CustomResourceDefinition")}
    assert crds == KOPF_CRDS, "crds/ is always installed"
    assert not {"ClusterRole", "ServiceAccount"} & {o["kind"] for o in objects}
    assert operator_pod(objects)["serviceAccountName"] == "platform-operator"
    args = parse_args(operator_args(objects))
    assert args.keda == "off" and not args.builtin_autoscaler


@pytest.mark.parametrize(
    ("change", "withheld"),
    [
        (lambda v: v["autoscaling"].update(keda="off"), on("keda.sh", "scaledobjects")),
        # Annotations mode: no PodMonitor is created or watched, but the one an earlier mode left
        # is read and deleted; the other modes never delete one.
        (
            lambda v: v["monitoring"].update(mode="annotations"),
            on("monitoring.coreos.com", "podmonitors", "create", "patch", "list", "watch"),
        ),
        (lambda v: v["monitoring"].update(mode="podmonitor"), set()),
        (lambda v: v["autoscaling"].update(builtin=False), on("mixrl.dev", "samplerpools/scale")),
        (lambda v: v["peering"].update(create=False), on("kopf.dev", "clusterkopfpeerings")),
    ],
)
def test_rbac_grants_only_what_the_enabled_features_use(
    helm: Helm, change: Any, withheld: set[tuple[str, str, str]]
) -> None:
    values = clusterwide()
    change(values)
    objects = helm.template(values)
    granted = grants(one(objects, "ClusterRole")["rules"])
    full = grants(operator_rules(clusterwide=True))
    if values["monitoring"]["mode"] != "annotations":
        withheld = withheld | PODMONITOR_CLEANUP_ONLY
    assert granted == full - withheld
    # ... and the operator is told not to use it, by the flag its parser reads.
    args = parse_args(operator_args(objects))
    assert (args.keda, args.monitoring, args.builtin_autoscaler, args.standalone) == (
        values["autoscaling"]["keda"],
        values["monitoring"]["mode"],
        values["autoscaling"]["builtin"],
        not values["peering"]["create"],
    )


def test_replicas_get_distinct_peering_priorities_below_a_developer(helm: Helm) -> None:
    """kopf pauses every operator that sees a live peer of its own priority: two replicas at one
    priority would both stand still.  The chart passes the pod name; each replica derives its own."""
    values = clusterwide()
    values["operator"]["replicas"] = 2
    objects = helm.template(values)
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--replica-id=$(POD_NAME)" in container["args"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    # What the kubelet makes of $(POD_NAME) in two pods of the ReplicaSet:
    priorities = [
        peering_priority(parse_args([a.replace("$(POD_NAME)", pod) for a in container["args"]]))
        for pod in ("mixrl-7d9c6b5f4-2xkqz", "mixrl-7d9c6b5f4-9tlmw")
    ]
    assert priorities[0] != priorities[1]
    assert all(p is not None and p < 0 for p in priorities), "a hand-started operator (0) outranks them"
    dev = peering_priority(parse_args(["-A", "--dev"]))
    assert dev == DEV_PRIORITY and all(dev > p for p in priorities if p is not None)


def test_two_replicas_without_peering_are_refused(helm: Helm) -> None:
    values = clusterwide()
    values["operator"]["replicas"] = 2
    values["peering"]["create"] = False
    assert "operator.replicas: more than one replica needs peering" in helm.refusal(values)


def test_helm_refuses_values_the_schema_rejects_naming_the_field(helm: Helm) -> None:
    values = clusterwide()
    values["monitoring"]["mode"] = "grafana"
    assert "/monitoring/mode" in helm.refusal(values)
    values = clusterwide()
    values["componentsImage"]["tag"] = "latest"
    assert "/componentsImage/tag" in helm.refusal(values)
    # Go's \s is ASCII only: a pasted non-breaking space passed Helm's check, and the operator,
    # which refuses it, crash-looped
    values = clusterwide()
    values["policy"]["allowedImages"] = ["ghcr.io/\u00a0mixrl/"]
    assert "/policy/allowedImages" in helm.refusal(values)


def test_name_overrides_name_the_objects(helm: Helm) -> None:
    values = clusterwide()
    values["fullnameOverride"] = "rl-operator"
    objects = helm.template(values, "mixrl-system", "team-a")
    names = {
        o["metadata"]["name"] for o in objects if o["kind"] in ("Deployment", "ServiceAccount", "ClusterRole")
    }
    assert names == {"rl-operator"}
    values = clusterwide()
    values["nameOverride"] = "trainer-ops"
    objects = helm.template(values, "mixrl-system", "team-a")
    deployment = one(objects, "Deployment")
    assert deployment["metadata"]["name"] == "team-a-trainer-ops"
    assert deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "trainer-ops"
    default = one(helm.template(clusterwide(), "mixrl-system", "team-a"), "Deployment")
    assert default["metadata"]["name"] == "team-a-mixrl"
    assert default["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "mixrl-operator",  # unchanged: a selector is immutable
        "app.kubernetes.io/instance": "team-a",
    }


# ----------------------------------------------------------------------------- chart -> operator -> pods


def platform_values() -> Obj:
    values = clusterwide()
    values["imagePullSecrets"] = [{"name": "regcred"}, {"name": "mirror"}]
    values["weights"]["storageClassName"] = "nfs-rwx"
    values["monitoring"]["podMonitorLabels"] = {"release": "kube-prometheus-stack"}
    values["gpuNodeLabels"] = {"H100": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}}
    values["engineImages"]["sglang"] = {"repository": "registry.corp:5000/sglang", "tag": "v0.5.6-cu129"}
    return values


def test_the_platform_values_reach_every_pod_the_operator_builds(helm: Helm) -> None:
    """The chart's values become the operator's flags, its parser turns them into build options,
    and the builders put them on every pod: the whole path, with the real pieces."""
    objects = helm.template(platform_values())
    assert operator_pod(objects)["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    images = images_of(parse_args(operator_args(objects)))
    run = parse_document(small_run(pools=[{"name": "h100", "gpuType": "H100", "weightPrecision": "fp8"}]))
    assert isinstance(run, RLRun)
    resolved = resolve(run)
    owner = Owner("mixrl.dev/v1alpha1", "RLRun", "demo", "uid")
    options = BuildOptions(images=images, monitoring=Monitoring.POD_MONITOR)
    built = run_objects(resolved, owner, options)
    built += pool_children(resolved, resolved.pools[0], 1, owner, options)
    pods = [o["spec"]["template"]["spec"] for o in built if o["kind"] in ("Deployment", "StatefulSet")]
    assert len(pods) == 5  # trainer, buffer, router, rollout, the pool's engines
    for pod in pods:
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    engine = next(o for o in built if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-h100")
    engine_pod = engine["spec"]["template"]["spec"]
    assert engine_pod["containers"][0]["image"] == "registry.corp:5000/sglang:v0.5.6-cu129"
    terms = engine_pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][1] == {
        "matchExpressions": [
            {"key": "cloud.google.com/gke-accelerator", "operator": "In", "values": ["nvidia-h100-80gb"]}
        ]
    }
    assert one(built, "PersistentVolumeClaim")["spec"]["storageClassName"] == "nfs-rwx"
    assert one(built, "PodMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"


IMAGE_FLAGS = (
    "--components-image",
    "--trainer-image",
    "--megatron-trainer-image",
    "--torch-engine-image",
    "--sglang-image",
)
PINNED = re.compile(r"^[^\s:@]+(:[0-9]+/[^\s:@]+)?(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?(@sha256:[0-9a-f]{64})?$")


def assert_pinned(reference: str) -> None:
    assert PINNED.match(reference), reference
    name = reference.split("@")[0].rsplit("/", 1)[-1]
    assert ":" in name or "@" in reference, f"{reference}: untagged"
    assert not name.endswith(":latest"), f"{reference}: latest"


@pytest.mark.parametrize("variant", ["default", "everything", "platform"])
def test_no_image_the_chart_renders_or_passes_on_is_untagged_or_latest(helm: Helm, variant: str) -> None:
    values = {"default": clusterwide(), "everything": everything_on(), "platform": platform_values()}[variant]
    objects = helm.template(values)
    args = operator_args(objects)
    flags = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if a.split("=", 1)[0] in IMAGE_FLAGS}
    assert set(flags) == set(IMAGE_FLAGS), "every image the operator runs comes from the chart"
    rendered = [
        c["image"]
        for o in objects
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
    ]
    for reference in [*flags.values(), *rendered]:
        assert_pinned(reference)
    mixrl_images = [v for k, v in flags.items() if k != "--sglang-image"]
    assert all(v.endswith(":0.1.0") for v in mixrl_images), "mixrl's images at the chart's appVersion"
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == "0.1.0"


def test_chart_values_name_no_latest_image() -> None:
    text = (CHART / "values.yaml").read_text()
    assert ":latest" not in text and "tag: latest" not in text
    values = default_values()
    for key in ("image", "componentsImage"):
        assert values[key]["tag"] == ""  # the appVersion
    assert values["engineImages"]["sglang"]["tag"], "SGLang's own release, pinned"


def test_notes_point_at_what_the_chart_ships(helm: Helm, tmp_path: Path) -> None:
    notes = helm.notes(platform_values(), tmp_path)
    assert "examples/" not in notes, "the chart does not ship the repository's examples"
    assert "kubectl -n mixrl-system rollout status deploy/mixrl" in notes
    assert "kubectl explain rlrun.spec" in notes
    assert "regcred, mirror" in notes and "StorageClass nfs-rwx" in notes
    assert "registry.corp:5000/sglang:v0.5.6-cu129 (sglang)" in notes
    assert "release=kube-prometheus-stack" in notes
    # The minimal run it prints is valid, and fits its GPUs.
    manifest = yaml.safe_load(
        notes.split("<<'YAML'\n")[1]
        .split("  YAML\n")[0]
        .replace("<your checkpoint directory on the weights volume>", "/weights/base/m")
    )
    parse_document({**manifest, "metadata": {**manifest["metadata"], "namespace": "rl"}})
    watched = helm.notes(namespaced("rl", "eval"), tmp_path / "ns")
    assert "watches rl, eval" in watched and "kubectl apply -n rl" in watched


def test_deployment_args_are_single_tokens() -> None:
    """Every arg of the chart's operator container is one flag token (no shell)."""
    text = (CHART / "templates" / "deployment.yaml").read_text()
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("- --", '- {{ printf "--')):
            literal = stripped[2:].split("{{")[0] if stripped.startswith("- --") else "--x"
            assert len(shlex.split(literal)) == 1, stripped


def test_network_policy_values_reach_the_operator(helm: Helm) -> None:
    default = images_of(parse_args(operator_args(helm.template(clusterwide()))))
    assert default.network_policies == Scrapers()
    values = clusterwide()
    values["networkPolicies"].update(scraperPodLabels={"app": "vmagent"}, scraperNamespace="monitoring")
    chosen = images_of(parse_args(operator_args(helm.template(values))))
    assert chosen.network_policies == Scrapers(pod_labels={"app": "vmagent"}, namespace="monitoring")
    values["networkPolicies"]["enabled"] = False
    args = operator_args(helm.template(values))
    assert "--no-network-policies" in args and not [a for a in args if a.startswith("--scraper")]
    assert images_of(parse_args(args)).network_policies is None
    values = clusterwide()
    values["networkPolicies"]["scraperNamespace"] = "Not_A_Namespace"
    assert "/networkPolicies/scraperNamespace" in helm.refusal(values)


def test_packing_values_reach_the_operator(helm: Helm) -> None:
    default = images_of(parse_args(operator_args(helm.template(clusterwide()))))
    assert default.pack_gpu_pods and default.scheduler_name is None
    values = clusterwide()
    values["packing"] = {"gpuPods": False, "schedulerName": PACKING_SCHEDULER}
    args = operator_args(helm.template(values))
    assert "--no-gpu-pod-packing" in args and f"--scheduler-name={PACKING_SCHEDULER}" in args
    chosen = images_of(parse_args(args))
    assert not chosen.pack_gpu_pods and chosen.scheduler_name == PACKING_SCHEDULER


CLUSTER_READS = [
    # (values, the operator's flag, its parsed name, the reads, the ClusterRole's suffix)
    (
        {"placement": {"explain": True}},
        "--explain-placement",
        "explain_placement",
        PLACEMENT_READS,
        "-placement",
    ),
    (
        {"kueue": {"workloadPriority": True}},
        "--kueue-workload-priority",
        "kueue_workload_priority",
        PRIORITY_READS,
        "-workload-priority",
    ),
]


@pytest.mark.parametrize(
    ("feature", "flag", "dest", "reads", "suffix"), CLUSTER_READS, ids=["placement", "priority"]
)
@pytest.mark.parametrize("scope", [clusterwide, lambda: namespaced("rl")], ids=["clusterwide", "namespaced"])
def test_a_feature_that_reads_cluster_wide_grants_exactly_its_reads_and_passes_its_flag(
    helm: Helm, scope: Any, feature: dict[str, Any], flag: str, dest: str, reads: Any, suffix: str
) -> None:
    """Off (the default): neither the flag nor any of its reads.  On: the flag, and a ClusterRole of
    exactly its reads (rbac.PLACEMENT_READS, rbac.PRIORITY_READS) bound to the operator's account,
    whatever the operator's scope."""
    off = helm.template(scope())
    assert flag not in operator_args(off)
    own = {key for key in reads if key not in permissions(clusterwide=True)}  # what nothing else needs
    resources = {resource for _, resource in own}
    assert resources  # nodes; priorityclasses
    assert not any(
        r
        for o in off
        if o["kind"] in ("ClusterRole", "Role")
        for r in o["rules"]
        if resources & set(r["resources"])
    )
    on = helm.template({**scope(), **feature})
    assert flag in operator_args(on) and getattr(parse_args(operator_args(on)), dest)
    (role,) = [o for o in by_kind(on, "ClusterRole") if o["metadata"]["name"].endswith(suffix)]
    assert role["rules"] == policy_rules(reads)
    (binding,) = [o for o in by_kind(on, "ClusterRoleBinding") if o["metadata"]["name"].endswith(suffix)]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == operator_pod(on)["serviceAccountName"]


def test_the_shipped_scheduler_file_serves_the_stock_profile_and_the_packing_one() -> None:
    """What a cluster administrator copies (files/scheduler/): the default profile untouched, and
    ``mixrl-packing`` as the test bed's kube-scheduler runs it."""
    shipped = yaml.safe_load((CHART / "files" / "scheduler" / "kube-scheduler-config.yaml").read_text())
    assert shipped["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert shipped["kind"] == "KubeSchedulerConfiguration"
    default, packing = shipped["profiles"]
    assert default == {"schedulerName": "default-scheduler"}
    assert packing == packing_profile() and packing["schedulerName"] == PACKING_SCHEDULER
    fit = next(c for c in packing["pluginConfig"] if c["name"] == "NodeResourcesFit")["args"]
    strategy = fit["scoringStrategy"]
    assert strategy["type"] == "MostAllocated"
    weights = {r["name"]: r["weight"] for r in strategy["resources"]}
    assert weights[GPU_RESOURCE] > weights["cpu"] and weights[GPU_RESOURCE] > weights["memory"]
