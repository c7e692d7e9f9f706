"""The chart's policy values: the ValidatingAdmissionPolicy and binding it renders (checked against
Kubernetes' schemas, its CEL evaluated with cel-python on the same documents as the operator's
check, and required to give the same lines in the same order), the operator flags it renders
(parsed by the operator's own parser into the same policy), the namespaced default and pinned
images by digest.  tests/cluster/test_policy.py sends such documents to a real kube-apiserver."""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
from celpy import celtypes

from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.operator.install.cluster_policy import Policy, violations
from mixrl.operator.main import images_of, parse_args, policy_of

from ..operator.support import small_run
from .helm import Helm, clusterwide, default_values, namespaced

Obj = dict[str, Any]
K8S_VERSION = kubernetes_validate.latest_version()
STRICT_VALUES: Obj = {
    "allowedImages": ["ghcr.io/mixrl/", "lmsysorg/sglang:"],
    "allowEngineArgs": True,
    "allowedEngineFlags": ["--tokenizer-path", "--mem-fraction-static"],
    "allowScheduling": False,
    "allowedPriorityClasses": ["rl-batch"],
    "admission": True,
}
POLICIES: dict[str, Obj] = {
    "strict": STRICT_VALUES,
    "no-engine-args": {"allowEngineArgs": False},
    "images-only": {"allowedImages": ["registry.corp:5000/rl/"]},
    "no-scheduling": {"allowScheduling": False},
    "priority-list": {"allowedPriorityClasses": ["low", "batch"]},
}


def with_policy(policy: Obj, base: Obj | None = None) -> Obj:
    values = copy.deepcopy(base or clusterwide())
    values["policy"].update(policy)
    return values


def by_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def operator_args(objects: list[Obj]) -> list[str]:
    (deployment,) = by_kind(objects, "Deployment")
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


# ----------------------------------------------------------------------------- rendering


def test_no_admission_policy_without_a_restriction(helm: Helm) -> None:
    kinds = {o["kind"] for o in helm.template(clusterwide())}
    assert not {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} & kinds
    assert not [a for a in operator_args(helm.template(clusterwide())) if "allowed" in a or "no-" in a[:5]]
    off = helm.template(with_policy({"allowEngineArgs": False, "admission": False}))
    assert not by_kind(off, "ValidatingAdmissionPolicy"), "admission off: the operator's check only"
    assert "--no-engine-args" in operator_args(off)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_chart_passes_its_policy_to_the_operator_and_the_api_server(helm: Helm, name: str) -> None:
    values = with_policy(POLICIES[name])
    objects = helm.template(values)
    (vap,) = by_kind(objects, "ValidatingAdmissionPolicy")
    (binding,) = by_kind(objects, "ValidatingAdmissionPolicyBinding")
    for obj in (vap, binding):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert binding["spec"]["policyName"] == vap["metadata"]["name"] == "mixrl-rlrun-policy"
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"], "cluster-wide: every namespace"
    assert vap["spec"]["failurePolicy"] == "Fail"
    assert vap["spec"]["matchConstraints"]["resourceRules"] == [
        {
            "apiGroups": ["mixrl.dev"],
            "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["rlruns"],
        }
    ]
    # The operator gets the same policy through its flags, parsed by its own parser.
    policy = policy_of(parse_args(operator_args(objects)))
    assert policy == policy_from_values(values["policy"]) and policy.restricts


def policy_from_values(values: Obj) -> Policy:
    return Policy(
        allowed_images=tuple(values["allowedImages"]),
        allow_engine_args=values["allowEngineArgs"],
        allowed_engine_flags=tuple(values["allowedEngineFlags"]),
        allow_scheduling=values["allowScheduling"],
        allowed_priority_classes=tuple(values["allowedPriorityClasses"]),
    )


def test_a_namespaced_policy_binds_only_the_watched_namespaces(helm: Helm) -> None:
    objects = helm.template(with_policy(STRICT_VALUES, namespaced("rl", "eval")))
    (binding,) = by_kind(objects, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["matchResources"] == {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["rl", "eval"]}
            ]
        }
    }
    kubernetes_validate.validate(binding, K8S_VERSION, strict=True)


def test_contradictory_or_unservable_policies_are_refused(helm: Helm) -> None:
    refused = helm.refusal(with_policy({"allowEngineArgs": False, "allowedEngineFlags": ["--tp"]}))
    assert "policy.allowedEngineFlags: allows nothing with policy.allowEngineArgs=false" in refused
    done = helm.run(
        "template", "mixrl", str(helm_chart()), "--kube-version", "1.29.0",
        "-f", str(helm.values_file(with_policy({"allowScheduling": False}))), check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "policy.admission: Kubernetes v1.29.0 has no admissionregistration.k8s.io/v1" in done.stderr


def helm_chart() -> Path:
    from .helm import CHART

    return CHART


def test_the_notes_say_what_the_policy_allows(helm: Helm, tmp_path: Path) -> None:
    notes = helm.notes(with_policy(STRICT_VALUES), tmp_path)
    assert (
        "policy        what an RLRun may ask for: its own images only from ghcr.io/mixrl/, lmsysorg/sglang:;"
        " engine flags --tokenizer-path, --mem-fraction-static only; no nodeSelector, tolerations or"
        " gpuProducts; priority classes rl-batch only; checked by the operator (PolicyViolation) and at"
        " admission (ValidatingAdmissionPolicy mixrl-rlrun-policy)"
    ) in notes
    assert "policy " not in helm.notes(clusterwide(), tmp_path / "open")


# ----------------------------------------------------------------------------- namespaced by default


def test_namespaced_by_default_with_no_cluster_wide_write(helm: Helm) -> None:
    values = default_values()
    values["watch"]["namespaces"] = ["rl"]
    objects = helm.template(values)
    kinds = {o["kind"] for o in objects}
    assert not {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"} & kinds
    assert {o["metadata"]["namespace"] for o in by_kind(objects, "Role")} == {"rl"}
    args = parse_args(operator_args(objects))
    assert args.namespaces == ["rl"] and not args.all_namespaces


# ----------------------------------------------------------------------------- digests


def test_a_digest_pins_the_image_itself(helm: Helm) -> None:
    digest = "sha256:" + "ab" * 32
    values = clusterwide()
    values["image"]["digest"] = digest
    values["componentsImage"]["digest"] = digest
    values["engineImages"]["sglang"]["digest"] = digest
    objects = helm.template(values)
    (deployment,) = by_kind(objects, "Deployment")
    assert (
        deployment["spec"]["template"]["spec"]["containers"][0]["image"]
        == f"ghcr.io/mixrl/mixrl-operator@{digest}"
    )
    images = images_of(parse_args(operator_args(objects)))
    assert images.components == f"ghcr.io/mixrl/mixrl-components@{digest}"
    assert images.sglang == f"lmsysorg/sglang@{digest}"
    assert images.trainer_torch == "ghcr.io/mixrl/mixrl-trainer-torch:0.1.0", "no digest: the tag"


# ----------------------------------------------------------------------------- the CEL, evaluated

_ENV = celpy.Environment()


def _join(values: celtypes.ListType, separator: celtypes.StringType) -> celtypes.StringType:
    return celtypes.StringType(str(separator).join(str(v) for v in values))


def _index_of(values: celtypes.ListType, item: Any) -> celtypes.IntType:
    return celtypes.IntType(list(values).index(item))


def _split(text: celtypes.StringType, separator: celtypes.StringType) -> celtypes.ListType:
    return celtypes.ListType([celtypes.StringType(p) for p in str(text).split(str(separator))])


FUNCTIONS: dict[str, Callable[..., Any]] = {"join": _join, "indexOf": _index_of, "split": _split}
"""The Kubernetes CEL library functions the policy uses that cel-python lacks."""


@functools.cache
def _program(expression: str) -> celpy.Runner:
    """Compiled once: parsing is most of the cost, and each expression meets every document."""
    return _ENV.program(_ENV.compile(expression), functions=FUNCTIONS)


def _evaluate(expression: str, activation: dict[str, Any]) -> Any:
    result = _program(expression).evaluate(activation)
    if isinstance(result, celpy.CELEvalError):
        raise AssertionError(f"{expression!r} failed to evaluate: {result}")
    return result


def _without_nulls(value: Any) -> Any:
    """The object as the API server's CEL sees it: a null field is not there."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def admission_messages(vap: Obj, document: Obj) -> list[str]:
    """What the ValidatingAdmissionPolicy says about ``document`` on CREATE: each failing
    validation's message, in order (variables evaluated in order, as the API server's are)."""
    activation: dict[str, Any] = {
        "object": celpy.json_to_cel(_without_nulls(document)),
        "request": celpy.json_to_cel({"operation": "CREATE"}),
    }
    for condition in vap["spec"]["matchConditions"]:
        assert _evaluate(condition["expression"], activation)
    variables: dict[str, Any] = {}
    for variable in vap["spec"]["variables"]:
        activation["variables"] = celtypes.MapType({celtypes.StringType(k): v for k, v in variables.items()})
        variables[variable["name"]] = _evaluate(variable["expression"], activation)
    activation["variables"] = celtypes.MapType({celtypes.StringType(k): v for k, v in variables.items()})
    messages = []
    for validation in vap["spec"]["validations"]:
        if not _evaluate(validation["expression"], activation):
            messages.append(str(_evaluate(validation["messageExpression"], activation)))
    return messages


def documents() -> list[Obj]:
    """Runs that ask for each thing a policy may refuse, alone and together."""
    changes: list[Callable[[Obj], None]] = [
        lambda d: None,
        lambda d: d["spec"]["trainer"].update(image="docker.io/evil/trainer:1"),
        lambda d: d["spec"]["trainer"].update(image="ghcr.io/mixrl/mixrl-trainer-torch:0.1.0"),
        lambda d: d["spec"]["samplerPools"][1].update(image="ghcr.io/mixrl-evil/x:1"),
        lambda d: d["spec"]["samplerPools"][0].update(image="lmsysorg/sglang:v0.5.6"),
        lambda d: d["spec"].update(
            rollout={"environment": "coding", "sandbox": {"image": "docker.io/evil/sb:1"}}
        ),
        lambda d: d["spec"].update(
            rollout={"environment": "coding", "sandbox": {"image": "ghcr.io/mixrl/sb:1"}}
        ),
        lambda d: d["spec"]["samplerPools"][1].update(
            engineArgs=["--tokenizer-path", "/w", "--trust-remote-code"]
        ),
        lambda d: d["spec"]["samplerPools"][0].update(engineArgs=["--mem-fraction-static=0.8"]),
        lambda d: d["spec"]["samplerPools"][0].update(engineArgs=["--x\n--y"]),
        lambda d: d["spec"]["samplerPools"][1].update(engineArgs=[]),
        lambda d: d["spec"]["trainer"].update(scheduling={"nodeSelector": {"pool": "reserved"}}),
        lambda d: d["spec"]["trainer"].update(scheduling={"priorityClassName": "low"}),
        lambda d: d["spec"]["samplerPools"][1].update(scheduling={"tolerations": [{"operator": "Exists"}]}),
        lambda d: d["spec"]["samplerPools"][0].update(
            scheduling={"gpuProducts": ["NVIDIA-B200"], "nodeSelector": {}}
        ),
        lambda d: d["spec"]["samplerPools"][1].update(
            scheduling={"priorityClassName": "rl-batch", "gpuProducts": None}
        ),
        lambda d: d["spec"]["samplerPools"][0].update(scheduling={"priorityClassName": "preempt-all"}),
    ]
    out = [small_run()]
    for count in (1, 2, 3):
        for chosen in itertools.combinations(range(1, len(changes)), count):
            if count == 3 and sum(chosen) % 4:  # a sample of the triples
                continue
            document = small_run()
            for index in chosen:
                changes[index](document)
            out.append(document)
    return out


DOCUMENTS = documents()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_admission_refuses_what_the_operator_refuses_with_the_same_lines(helm: Helm, name: str) -> None:
    values = with_policy(POLICIES[name])
    (vap,) = by_kind(helm.template(values), "ValidatingAdmissionPolicy")
    policy = policy_from_values(values["policy"])
    refused = 0
    for document in DOCUMENTS:
        run = parse_document(document)
        assert isinstance(run, RLRun)
        expected = violations(policy, run.spec)
        assert admission_messages(vap, document) == expected, document["spec"]
        refused += bool(expected)
    assert 0 < refused < len(DOCUMENTS), "the documents exercise both outcomes"


def test_an_update_that_leaves_the_spec_alone_is_not_checked(helm: Helm) -> None:
    """A metadata edit (an annotation) of a run created before the policy goes through; the
    operator refuses that run itself (PolicyViolation)."""
    (vap,) = by_kind(helm.template(with_policy(STRICT_VALUES)), "ValidatingAdmissionPolicy")
    (condition,) = vap["spec"]["matchConditions"]
    document = small_run()
    changed = copy.deepcopy(document)
    changed["spec"]["trainer"]["image"] = "evil/x:1"

    def matches(old: Obj, new: Obj) -> bool:
        activation = {
            "object": celpy.json_to_cel(new),
            "oldObject": celpy.json_to_cel(old),
            "request": celpy.json_to_cel({"operation": "UPDATE"}),
        }
        return bool(_evaluate(condition["expression"], activation))

    annotated = copy.deepcopy(changed)
    annotated["metadata"]["annotations"] = {"team.example.com/owner": "rl-infra"}
    assert not matches(changed, annotated)
    assert matches(document, changed)
