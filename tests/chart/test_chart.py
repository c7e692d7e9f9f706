"""The Helm chart: values schema, generated files in sync, `helm lint`, and `helm install` of every
variant into the API stand-in, with each installed object checked against the code and Kubernetes."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mixrl.api.crd import rlrun_crd, samplerpool_crd
from mixrl.operator import chart as chart_module
from mixrl.operator.main import parse_args
from mixrl.operator.monitoring import collapse_rule_groups, dashboard
from mixrl.operator.rbac import operator_rules

from ..operator.emulator import ApiServer
from .helm import CHART, chart_with_values, default_values, everything_on, install, lint, namespaced

Obj = dict[str, Any]
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
K8S_VERSION = kubernetes_validate.latest_version()


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
        (lambda v: v["watch"].update(allNamespaces=False), "namespaces"),  # namespaced needs namespaces
        (lambda v: v["watch"].update(namespaces=["Not_A_Namespace"]), "Not_A_Namespace"),
        (lambda v: v["monitoring"]["podMonitor"].update(interval="often"), "often"),
        (lambda v: v["image"].update(repository=""), "repository"),
    ],
)
def test_bad_values_are_refused_naming_the_field(change: Any, field: str) -> None:
    values = default_values()
    change(values)
    with pytest.raises(jsonschema.ValidationError) as caught:
        jsonschema.validate(values, SCHEMA)
    assert field in str(caught.value.message) + "/".join(map(str, caught.value.absolute_path))


# ----------------------------------------------------------------------------- generated files


def test_generated_files_match_the_code() -> None:
    assert chart_module.stale_files(CHART) == [], "run `python -m mixrl.operator.chart`"
    assert chart_module.main(["--check"]) == 0


def test_the_check_names_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copied = chart_with_values(default_values(), tmp_path)
    rules = copied / "files" / "rbac" / "clusterwide.yaml"
    rules.write_text(rules.read_text().replace("- watch", "- watch\n  - delete", 1))
    assert chart_module.main(["--check", "--chart", str(copied)]) == 1
    assert capsys.readouterr().err.strip() == (f"{rules}: out of date; run `python -m mixrl.operator.chart`")


def test_crd_templates_are_behind_the_install_flag_and_kept_on_uninstall() -> None:
    for name, crd in (("rlruns.mixrl.dev", rlrun_crd()), ("samplerpools.mixrl.dev", samplerpool_crd())):
        text = (CHART / "templates" / "crds" / f"{name}.yaml").read_text()
        assert text.startswith("{{- if .Values.crds.install }}\n") and text.endswith("{{- end }}\n")
        body = yaml.safe_load("\n".join(text.splitlines()[1:-1]))
        assert body["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        del body["metadata"]["annotations"]
        assert body == crd


# ----------------------------------------------------------------------------- helm lint


def lint_errors(result: Obj) -> list[str]:
    """Files with severity-3 findings (helm: 1 info, 2 warning, 3 error; the texts come back empty)."""
    assert result["ok"], result
    messages = result["result"]["Messages"] or []
    return [m["Path"] for m in messages if m["Severity"] >= 3]


@pytest.mark.parametrize("variant", ["default", "everything", "namespaced"])
async def test_helm_lint_passes(helm_available: None, tmp_path: Path, variant: str) -> None:
    values = {"default": default_values(), "everything": everything_on(), "namespaced": namespaced("rl")}[
        variant
    ]
    result = await lint(chart_with_values(values, tmp_path), tmp_path)
    assert result["result"]["TotalChartsLinted"] == 1
    assert lint_errors(result) == []


async def test_helm_lint_catches_a_broken_template(helm_available: None, tmp_path: Path) -> None:
    """The lint test has teeth: a malformed template is reported (REFERENCE.md §4)."""
    broken = chart_with_values(default_values(), tmp_path)
    (broken / "templates" / "broken.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Values.x\n"
    )
    assert lint_errors(await lint(broken, tmp_path)) == ["templates/"]


async def test_helm_lint_catches_a_namespaced_install_without_namespaces(
    helm_available: None, tmp_path: Path
) -> None:
    values = default_values()
    values["watch"]["allNamespaces"] = False
    assert lint_errors(await lint(chart_with_values(values, tmp_path), tmp_path)) != []


# ----------------------------------------------------------------------------- helm install


def installed(api: ApiServer) -> dict[tuple[str, str | None, str], Obj]:
    """(kind, namespace, name) -> object, for everything Helm created."""
    out = {}
    for (_, namespace, name), obj in api.objects.items():
        if not obj.deleted:
            raw = copy.deepcopy(obj.raw)
            out[(raw["kind"], namespace, name)] = raw
    return out


def strip_server_fields(obj: Obj) -> Obj:
    obj = copy.deepcopy(obj)
    for key in ("uid", "resourceVersion", "generation", "creationTimestamp", "namespace"):
        obj["metadata"].pop(key, None)
    obj.pop("status", None)
    return obj


async def helm_install(api: ApiServer, values: Obj, tmp_path: Path) -> dict[tuple[str, str | None, str], Obj]:
    result = await install(str(api.url), values, tmp_path)
    assert result["ok"], result["error"]
    return installed(api)


async def test_install_everything_cluster_wide(cluster: ApiServer, tmp_path: Path) -> None:
    objects = await helm_install(cluster, everything_on(), tmp_path)
    kinds = sorted({kind for kind, _, _ in objects})
    assert kinds == [
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
    for obj in objects.values():
        if obj["apiVersion"].split("/")[0] in (
            "v1",
            "apps",
            "rbac.authorization.k8s.io",
            "apiextensions.k8s.io",
        ):
            kubernetes_validate.validate(strip_server_fields(obj), K8S_VERSION, strict=True)

    # CRDs: mixrl's exactly as generated from the models, kopf's peering CRDs from crds/.
    crds = {name: obj for (kind, _, name), obj in objects.items() if kind == "CustomResourceDefinition"}
    assert set(crds) == {
        "rlruns.mixrl.dev",
        "samplerpools.mixrl.dev",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    }
    for crd in (rlrun_crd(), samplerpool_crd()):
        live = strip_server_fields(crds[crd["metadata"]["name"]])
        live["metadata"].pop("annotations")
        assert {**live, "metadata": {**live["metadata"], "labels": crd["metadata"]["labels"]}} == crd

    # RBAC: exactly the registry's rules, bound to the operator's service account.
    (role,) = [o for (kind, _, _), o in objects.items() if kind == "ClusterRole"]
    assert role["rules"] == operator_rules(clusterwide=True)
    (binding,) = [o for (kind, _, _), o in objects.items() if kind == "ClusterRoleBinding"]
    (account,) = [o for (kind, _, _), o in objects.items() if kind == "ServiceAccount"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "mixrl-system"}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]

    # The operator: the command line is one the real CLI accepts, and it runs unprivileged.
    (deployment,) = [o for (kind, _, _), o in objects.items() if kind == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["mixrl", "operator"]
    args = parse_args(container["args"])
    assert args.all_namespaces and args.peering == "mixrl" and args.monitoring == "auto"
    assert args.keda == "auto" and args.builtin_autoscaler, "KEDA by discovery, the built-in loop on"
    assert args.components_image == "ghcr.io/mixrl/mixrl-components:0.1.0"
    assert container["image"] == "ghcr.io/mixrl/mixrl-operator:0.1.0"
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["livenessProbe"]["httpGet"]["port"] == "health"
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]

    # Monitoring: the generated alerts and dashboard, byte for byte.
    (rule,) = [o for (kind, _, _), o in objects.items() if kind == "PrometheusRule"]
    assert rule["spec"]["groups"] == collapse_rule_groups()
    (board,) = [o for (kind, _, _), o in objects.items() if kind == "ConfigMap"]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["mixrl-run.json"]) == dashboard()
    (monitor,) = [o for (kind, _, _), o in objects.items() if kind == "PodMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == {"metrics", "engine"}


async def test_install_namespaced_gives_roles_only_in_watched_namespaces(
    cluster: ApiServer, tmp_path: Path
) -> None:
    objects = await helm_install(cluster, namespaced("rl", "eval"), tmp_path)
    kinds = {kind for kind, _, _ in objects}
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    roles = {ns: o for (kind, ns, _), o in objects.items() if kind == "Role"}
    assert set(roles) == {"rl", "eval"}
    for role in roles.values():
        assert role["rules"] == operator_rules(clusterwide=False)
    bindings = {ns for (kind, ns, _) in objects if kind == "RoleBinding"}
    assert bindings == {"rl", "eval"}
    peerings = {ns for (kind, ns, _) in objects if kind == "KopfPeering"}
    assert peerings == {"rl", "eval"}
    (deployment,) = [o for (kind, _, _), o in objects.items() if kind == "Deployment"]
    args = parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.namespaces == ["rl", "eval"] and not args.all_namespaces


async def test_install_minimal_without_crds_rbac_or_service_account(
    cluster: ApiServer, tmp_path: Path
) -> None:
    values = default_values()
    values["crds"]["install"] = False
    values["rbac"]["create"] = False
    values["serviceAccount"] = {"create": False, "name": "platform-operator", "annotations": {}}
    values["autoscaling"] = {"builtin": False, "keda": "off"}
    objects = await helm_install(cluster, values, tmp_path)
    crds = {name for (kind, _, name) in objects if kind == "CustomResourceDefinition"}
    assert crds == {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}, "crds/ is always installed"
    assert not {"ClusterRole", "ServiceAccount"} & {kind for kind, _, _ in objects}
    (deployment,) = [o for (kind, _, _), o in objects.items() if kind == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "platform-operator"
    args = parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.keda == "off" and not args.builtin_autoscaler


async def test_helm_refuses_values_the_schema_rejects(cluster: ApiServer, tmp_path: Path) -> None:
    values = default_values()
    values["monitoring"]["mode"] = "grafana"
    result = await install(str(cluster.url), values, tmp_path)
    assert not result["ok"] and "mode" in result["error"], result
    # Helm installs crds/ before it renders (and checks) the templates; nothing else was created.
    created = {(kind, name) for (kind, _, name) in installed(cluster)}
    assert created == {
        ("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev"),
        ("CustomResourceDefinition", "kopfpeerings.kopf.dev"),
    }


def test_deployment_args_are_quoted_safely() -> None:
    """Every arg of the chart's operator container is a single flag token (no shell)."""
    text = (CHART / "templates" / "deployment.yaml").read_text()
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("- --"):
            assert len(shlex.split(stripped[2:].split("{{")[0])) == 1, stripped
