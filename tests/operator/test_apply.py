"""The comparisons behind every write decision (pure): hand edits, immutable fields, deletion policy."""

from __future__ import annotations

import asyncio
import copy
from fractions import Fraction
from typing import Any

import pytest

from mixrl.api.models import RLRun
from mixrl.api.resolve import resolve
from mixrl.operator.builders.objects import BuildOptions, Images, Owner
from mixrl.operator.builders.resources import run_objects
from mixrl.operator.controller.apply import (
    ApplyReport,
    Child,
    Failure,
    OwnerGone,
    apply_objects,
    deletion_policy,
    first_difference,
    hand_edit,
    immutable_changes,
    immutable_in_message,
    label,
    live_hand_edit,
    quantity,
    taken_by,
)
from mixrl.operator.controller.handlers import watched_children
from mixrl.operator.controller.observed_status import Reason, pool_status, problems_value, run_status
from mixrl.operator.controller.runtime import OperatorConfig

from .support import small_run

Obj = dict[str, Any]


def built(manifest: Obj) -> dict[str, Obj]:
    resolved = resolve(RLRun.model_validate(manifest))
    owner = Owner("mixrl.dev/v1alpha1", "RLRun", resolved.name, "uid")
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in run_objects(resolved, owner, BuildOptions())}


def as_served(obj: Obj) -> Obj:
    """Roughly what a real API server returns for an applied object: server metadata, defaults,
    canonical quantities, a status, other writers' annotations and an injected volume."""
    live = copy.deepcopy(obj)
    meta = live["metadata"]
    meta.update(uid="u1", resourceVersion="42", generation=3, creationTimestamp="2026-01-01T00:00:00Z")
    meta["managedFields"] = [{"manager": "mixrl-operator", "operation": "Apply"}]
    meta.setdefault("annotations", {})["deployment.kubernetes.io/revision"] = "3"
    spec = live.get("spec", {})
    spec.setdefault("revisionHistoryLimit", 10)
    template = spec.get("template", {}).get("spec")
    if template:
        template.setdefault("dnsPolicy", "ClusterFirst")
        template.setdefault("volumes", []).append({"name": "injected", "emptyDir": {}})
        for container in template["containers"]:
            container.setdefault("terminationMessagePath", "/dev/termination-log")
            container.setdefault("imagePullPolicy", "IfNotPresent")
            for requests in container.get("resources", {}).values():
                for key, value in requests.items():
                    requests[key] = str(value)  # a GPU count 8 comes back as "8"
    live["status"] = {"replicas": 1}
    return live


def test_quantities_compare_by_value() -> None:
    assert quantity("100Gi") == 100 * 2**30
    assert quantity("0.5") == quantity("500m") == Fraction(1, 2)
    assert quantity("1e3") == quantity("1k") == 1000
    assert quantity(8) == quantity("8")
    assert quantity("fast") is None and quantity(True) is None and quantity("None") is None


def test_an_object_as_the_server_returns_it_is_not_a_hand_edit() -> None:
    for name, obj in built(small_run()).items():
        assert hand_edit(obj, as_served(obj)) is None, name


def test_hand_edits_name_the_field_that_changed() -> None:
    router = built(small_run())["Deployment/demo-router"]
    live = as_served(router)
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    container = router["spec"]["template"]["spec"]["containers"][0]["name"]
    assert hand_edit(router, live) == f'spec.template.spec.containers[name="{container}"].image'

    live = as_served(router)
    live["spec"]["replicas"] = 7
    assert hand_edit(router, live) == "spec.replicas"

    live = as_served(router)
    del live["metadata"]["labels"]["app.kubernetes.io/managed-by"]
    assert hand_edit(router, live) == 'metadata.labels["app.kubernetes.io/managed-by"]'

    live = as_served(router)
    live["spec"]["template"]["spec"]["containers"][0]["command"].append("--debug")
    assert hand_edit(router, live) is not None, "a list of scalars (a command) must be equal"


def test_a_served_objects_comparison_is_remembered_until_its_version_moves() -> None:
    router = built(small_run())["Deployment/demo-router"]
    live = as_served(router)
    live["metadata"].update(uid="router-uid", resourceVersion="41")
    assert live_hand_edit(router, live) is None
    # The same version is the same object on an API server: its answer is not worked out again.
    live["spec"]["replicas"] = 7
    assert live_hand_edit(router, live) is None
    live["metadata"]["resourceVersion"] = "42"
    assert live_hand_edit(router, live) == "spec.replicas"


def test_what_others_add_is_not_drift() -> None:
    # kubectl rollout restart, an annotation, an extra label, an injected sidecar: not ours.
    want = {
        "spec": {
            "template": {"metadata": {"annotations": {"a": "1"}}, "spec": {"containers": [{"name": "x"}]}}
        }
    }
    have = copy.deepcopy(want)
    have["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] = "now"
    have["spec"]["template"]["spec"]["containers"].append({"name": "istio-proxy"})
    assert first_difference(want, have) is None
    # Values Go's omitempty drops are the same as absent.
    assert first_difference({"a": {"readOnly": False, "items": [], "labels": {}}}, {"a": {}}) is None
    assert first_difference({"a": {"readOnly": True}}, {"a": {}}) == "a.readOnly"


def test_immutable_statefulset_fields_are_named() -> None:
    one_node = small_run()
    one_node["spec"]["trainer"]["nodes"] = 1  # its run directory is a claim of its own
    before = built(one_node)["StatefulSet/demo-trainer"]
    changed = copy.deepcopy(one_node)
    changed["spec"]["trainer"]["gpuType"] = "B200"  # relabels the claim template
    after = built(changed)["StatefulSet/demo-trainer"]
    live = as_served(before)
    assert immutable_changes(after, live) == ["spec.volumeClaimTemplates"]
    assert immutable_changes(before, live) == []
    # The pods change as well (GPU labels, node affinity): delete them first, then recreate.
    assert deletion_policy(after, live, ["spec.volumeClaimTemplates"]) == "Foreground"
    # Only the claim templates differ: the pods survive (Orphan) and the new StatefulSet adopts them.
    claims_only = copy.deepcopy(before)
    claims_only["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] = "1Ti"
    assert immutable_changes(claims_only, live) == ["spec.volumeClaimTemplates"]
    assert deletion_policy(claims_only, live, ["spec.volumeClaimTemplates"]) == "Orphan"
    moved = copy.deepcopy(before)
    moved["spec"]["selector"]["matchLabels"]["extra"] = "x"
    assert "spec.selector" in immutable_changes(moved, live)
    assert deletion_policy(moved, live, ["spec.selector"]) == "Foreground"


def test_immutable_fields_of_deployments_and_services() -> None:
    objects = built(small_run())
    router = objects["Deployment/demo-router"]
    live = as_served(router)
    assert immutable_changes(router, live) == []
    moved = copy.deepcopy(router)
    moved["spec"]["selector"]["matchLabels"]["extra"] = "x"
    assert immutable_changes(moved, live) == ["spec.selector"]
    assert deletion_policy(moved, live, ["spec.selector"]) == "Foreground"
    headless = objects["Service/demo-trainer"]
    served = as_served(headless)
    assert immutable_changes(headless, served) == []
    served["spec"]["clusterIP"] = "10.0.0.7"
    assert immutable_changes(headless, served) == ["spec.clusterIP"]
    assert deletion_policy(headless, served, ["spec.clusterIP"]) == "Background"


def test_the_api_servers_wording_names_what_comparing_cannot_find() -> None:
    # A field the operator stopped setting: the object as desired equals the live one where it
    # says anything, but the apply would reset the field, which the API server forbids.
    forbidden = (
        'StatefulSet.apps "x" is invalid: spec: Forbidden: updates to statefulset spec for fields other than'
    )
    assert immutable_in_message("StatefulSet", forbidden + " 'replicas' ... are forbidden") == ["spec"]
    selector = 'Deployment.apps "x" is invalid: spec.selector: Invalid value: {"a":"b"}: field is immutable'
    assert immutable_in_message("Deployment", selector) == ["spec.selector"]
    cluster_ip = (
        'Service "x" is invalid: spec.clusterIPs[0]: Invalid value: []string{"None"}: may not change once set'
    )
    assert immutable_in_message("Service", cluster_ip) == ["spec.clusterIPs"]
    # Any other 422 is a failure to report, never a reason to delete anything.
    invalid = 'Deployment.apps "x" is invalid: spec.template.spec.containers[0].image: Required value'
    assert immutable_in_message("Deployment", invalid) == []
    assert immutable_in_message("ConfigMap", "field is immutable") == []


@pytest.mark.parametrize(
    ("failures", "value"),
    [
        ([], None),
        ([Failure("StatefulSet/a", "500 boom")], ("True", Reason.APPLY_FAILED)),
        ([Failure("StatefulSet/a", "old one going", waiting=True)], ("True", Reason.RECREATING)),
        (
            [Failure("StatefulSet/a", "500 boom"), Failure("PersistentVolumeClaim/w", "shrink", retry=False)],
            ("False", Reason.IMMUTABLE_FIELD_CHANGED),
        ),
        (
            [
                Failure("StatefulSet/a", "500 boom"),
                Failure("Service/w", "taken", False, reason=Reason.NAME_TAKEN),
            ],
            ("False", Reason.NAME_TAKEN),
        ),
    ],
)
def test_progressing_reports_failures(failures: list[Failure], value: tuple[str, str] | None) -> None:
    found = problems_value(failures)
    assert (found[:2] if found else None) == value
    if len(failures) == 2 and failures[1].reason == Reason.IMMUTABLE_FIELD_CHANGED:
        assert found is not None and found[2].startswith("PersistentVolumeClaim/w: shrink; StatefulSet/a")


def test_a_name_another_owner_controls_is_not_ours() -> None:
    def controlled(kind: str, name: str, uid: str) -> Obj:
        return {
            "metadata": {"ownerReferences": [{"kind": kind, "name": name, "uid": uid, "controller": True}]}
        }

    desired = controlled("RLRun", "a-b", "u1")
    assert taken_by(desired, controlled("SamplerPool", "a-b-router", "u2")) == "SamplerPool a-b-router"
    assert taken_by(desired, controlled("RLRun", "a", "u3")) == "RLRun a"
    assert taken_by(desired, controlled("RLRun", "a-b", "u1")) is None
    assert (
        taken_by(
            desired,
            controlled("RLRun", "a-b", "old"),
        )
        is None
    ), "a deleted run's successor adopts"
    assert taken_by(desired, {"metadata": {}}) is None, "no controller: as before"
    referenced = {"metadata": {"ownerReferences": [{"kind": "RLRun", "name": "a", "uid": "u3"}]}}
    assert taken_by(desired, referenced) is None, "only a controller reference owns it"


def test_failures_reach_the_run_and_pool_status_and_leave_with_them() -> None:
    failing = [Failure("StatefulSet/demo-trainer", "422 Invalid: nope")]
    status = run_status({}, 1, {}, [], "T0", problems=failing)
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", Reason.APPLY_FAILED)
    assert "StatefulSet/demo-trainer" in progressing["message"]
    pool = pool_status({}, 1, None, "a=b", "T0", problems=failing)
    assert any(c["type"] == "Progressing" for c in pool["conditions"])
    healed = pool_status(pool, 1, None, "a=b", "T1")
    assert not any(c["type"] == "Progressing" for c in healed["conditions"])


def test_the_operator_watches_only_the_kinds_it_may_create() -> None:
    def watched(config: OperatorConfig) -> set[str]:
        return {r.plural for resources in watched_children(config).values() for r in resources}

    # LeaderWorkerSets (multi-node pools) and Kueue Workloads (queued runs) are always granted:
    # where the cluster serves neither, kopf warns once and watches nothing.
    core = {"configmaps", "services", "persistentvolumeclaims", "deployments", "statefulsets"}
    core |= {"leaderworkersets", "workloads"}
    assert watched(OperatorConfig()) == core | {"podmonitors", "scaledobjects", "networkpolicies"}
    # The chart grants PodMonitors and ScaledObjects only with these features on: a watch without
    # the permission would fail forever.  Without policies of its own the operator needs no watch.
    no_extras = OperatorConfig(monitoring="annotations", keda="off", images=Images(network_policies=None))
    assert watched(no_extras) == core
    # One selector per API group: kopf then discovers only those groups.
    groups = {"", "apps", "monitoring.coreos.com", "keda.sh", "networking.k8s.io"}
    groups |= {"leaderworkerset.x-k8s.io", "kueue.x-k8s.io"}
    assert set(watched_children(OperatorConfig())) == groups


class SlowClient:
    """An API server that answers a GET for object i after (n - i) ticks: later objects finish first."""

    def __init__(self, count: int):
        self.count = count
        self.in_flight = 0
        self.most_in_flight = 0
        self.started: list[str] = []

    async def get(self, resource: Any, namespace: str, name: str, cached: bool = False) -> None:
        self.started.append(name)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.001 * (self.count - int(name.rsplit("-", 1)[1])))
        self.in_flight -= 1

    async def apply(self, resource: Any, namespace: str, name: str, body: Obj) -> Obj:
        return body

    async def create(self, resource: Any, namespace: str, body: Obj) -> Obj:
        return body


def child(kind: str, index: int) -> Child:
    api = "mixrl.dev/v1alpha1" if kind == "SamplerPool" else "v1"
    return Child({"apiVersion": api, "kind": kind, "metadata": {"name": f"o-{index}", "namespace": "n"}})


def test_children_are_applied_concurrently_and_reported_in_their_order() -> None:
    children = [child("SamplerPool" if i % 5 == 4 else "ConfigMap", i) for i in range(20)]
    client = SlowClient(len(children))
    report = ApplyReport()
    applied = asyncio.run(
        apply_objects(client, children, report, first=lambda o: o["kind"] == "SamplerPool", concurrency=3)  # type: ignore[arg-type]
    )
    assert client.most_in_flight == 3
    assert client.started[:4] == ["o-4", "o-9", "o-14", "o-19"]  # the pools first
    assert report.created == [label(c.desired) for c in children]  # not the order they finished in
    assert list(applied) == report.created


def test_a_gone_owner_stops_the_writes_not_yet_started() -> None:
    children = [child("ConfigMap", i) for i in range(10)]
    client = SlowClient(len(children))
    checks = 0

    async def owner_gone() -> None:
        nonlocal checks
        checks += 1
        raise OwnerGone("RLRun n/r is gone")

    report = ApplyReport()
    with pytest.raises(OwnerGone):
        asyncio.run(apply_objects(client, children, report, owner_gone, concurrency=2))  # type: ignore[arg-type]
    assert checks == 2 and len(client.started) == 2 and report.created == []
