"""The cluster's policy on RLRuns (mixrl/operator/install/cluster_policy.py): the pure check, one line per kind of
problem naming the field; and the operator enforcing it against the API stand-in (a refused run is
marked PolicyViolation, nothing of it is created, and the condition goes once the spec is allowed).
The same checks as CEL at admission: tests/chart/test_admission_policy.py and
tests/cluster/test_policy.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun, RLRunSpec
from mixrl.operator.controller.observed_status import refused_run_status, run_status
from mixrl.operator.install.cluster_policy import OPEN, Policy, flag_shown, violation, violations

from .emulator import ApiServer
from .support import (
    NAMESPACE,
    RLRUNS,
    conditions,
    create,
    events,
    eventually,
    patch,
    run_path,
    small_run,
    writes,
    writes_settled,
)

Obj = dict[str, Any]
EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
STRICT = Policy(
    allowed_images=("ghcr.io/mixrl/", "lmsysorg/sglang:"),
    allowed_engine_flags=("--tokenizer-path", "--mem-fraction-static"),
    allow_scheduling=False,
    allowed_priority_classes=("rl-batch",),
)


def spec_of(manifest: Obj) -> RLRunSpec:
    run = parse_document(manifest)
    assert isinstance(run, RLRun)
    return run.spec


def pools(*changes: Obj) -> Obj:
    """small_run with its two pools updated by ``changes`` (one mapping per pool)."""
    manifest = small_run()
    for pool, change in zip(manifest["spec"]["samplerPools"], changes, strict=False):
        pool.update(change)
    return manifest


def with_trainer(**fields: Any) -> Obj:
    manifest = small_run()
    manifest["spec"]["trainer"].update(fields)
    return manifest


def with_sandbox(**fields: Any) -> Obj:
    """small_run with sandbox pods (``spec.rollout.sandbox``) of ``fields``."""
    manifest = small_run()
    manifest["spec"]["rollout"] = {"environment": "coding", "sandbox": fields}
    return manifest


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_default_policy_allows_every_example(example: Path) -> None:
    for doc in yaml.safe_load_all(example.read_text()):
        doc.setdefault("metadata", {}).setdefault("namespace", "rl")
        assert violations(OPEN, spec_of(doc)) == []


def test_a_run_naming_nothing_of_its_own_passes_the_strictest_policy() -> None:
    strictest = Policy(allowed_images=("x/",), allow_engine_args=False, allow_scheduling=False)
    assert strictest.restricts and not OPEN.restricts
    assert violations(strictest, spec_of(small_run())) == []
    assert violations(strictest, spec_of(with_sandbox(poolSize=2))) == [], "sandbox pods of the chart's image"


@pytest.mark.parametrize(
    ("manifest", "line"),
    [
        (
            with_trainer(image="docker.io/evil/trainer:1"),
            "spec.trainer.image: docker.io/evil/trainer:1 is not an allowed image (the cluster's policy "
            "allows images starting with ghcr.io/mixrl/, lmsysorg/sglang:)",
        ),
        (
            # A prefix is a prefix: "ghcr.io/mixrl" would let this through, "ghcr.io/mixrl/" does not.
            pools({}, {"image": "ghcr.io/mixrl-evil/sglang:1"}),
            "spec.samplerPools[1].image: ghcr.io/mixrl-evil/sglang:1 is not an allowed image (the "
            "cluster's policy allows images starting with ghcr.io/mixrl/, lmsysorg/sglang:)",
        ),
        (
            # The sandbox pods run the run's own image too: the same prefixes hold.
            with_sandbox(image="docker.io/evil/sandbox:1"),
            "spec.rollout.sandbox.image: docker.io/evil/sandbox:1 is not an allowed image (the cluster's "
            "policy allows images starting with ghcr.io/mixrl/, lmsysorg/sglang:)",
        ),
        (
            with_sandbox(image="ghcr.io/mixrl-evil/components:1"),
            "spec.rollout.sandbox.image: ghcr.io/mixrl-evil/components:1 is not an allowed image (the "
            "cluster's policy allows images starting with ghcr.io/mixrl/, lmsysorg/sglang:)",
        ),
        (
            pools({}, {"engineArgs": ["--tokenizer-path", "/w/tok", "--trust-remote-code"]}),
            "spec.samplerPools[1].engineArgs[2]: --trust-remote-code is not an allowed engine flag (the "
            "cluster's policy allows --tokenizer-path, --mem-fraction-static)",
        ),
        (
            pools({"engineArgs": ["--model-path=/etc"]}),
            "spec.samplerPools[0].engineArgs[0]: --model-path is not an allowed engine flag (the cluster's "
            "policy allows --tokenizer-path, --mem-fraction-static)",
        ),
        (
            # An abbreviation argparse would expand is not the flag the policy names.
            pools({"engineArgs": ["--tokenizer-pat", "/x"]}),
            "spec.samplerPools[0].engineArgs[0]: --tokenizer-pat is not an allowed engine flag (the "
            "cluster's policy allows --tokenizer-path, --mem-fraction-static)",
        ),
        (
            with_trainer(scheduling={"nodeSelector": {"pool": "reserved"}}),
            "spec.trainer.scheduling.nodeSelector: scheduling overrides are not allowed by the cluster's policy",
        ),
        (
            pools({}, {"scheduling": {"tolerations": [{"key": "node-role.kubernetes.io/control-plane"}]}}),
            "spec.samplerPools[1].scheduling.tolerations: scheduling overrides are not allowed by the "
            "cluster's policy",
        ),
        (
            pools({"scheduling": {"gpuProducts": ["NVIDIA-H100-80GB-HBM3"]}}),
            "spec.samplerPools[0].scheduling.gpuProducts: scheduling overrides are not allowed by the "
            "cluster's policy",
        ),
        (
            with_trainer(scheduling={"priorityClassName": "system-cluster-critical"}),
            "spec.trainer.scheduling.priorityClassName: system-cluster-critical is not an allowed priority "
            "class (the cluster's policy allows rl-batch)",
        ),
        (
            pools({}, {"scheduling": {"priorityClassName": "preempt-everyone"}}),
            "spec.samplerPools[1].scheduling.priorityClassName: preempt-everyone is not an allowed priority "
            "class (the cluster's policy allows rl-batch)",
        ),
    ],
)
def test_each_refusal_is_one_line_naming_the_field(manifest: Obj, line: str) -> None:
    assert violations(STRICT, spec_of(manifest)) == [line]
    assert violation(STRICT, spec_of(manifest)) == line


def test_what_the_policy_allows_passes() -> None:
    manifest = pools(
        {
            "image": "lmsysorg/sglang:v0.5.6-cu129",
            # --flag value, --flag=value; a value starting without "-" belongs to the flag before it
            "engineArgs": ["--tokenizer-path", "/weights/base", "--mem-fraction-static=0.8"],
            "scheduling": {"priorityClassName": "rl-batch", "nodeSelector": {}, "tolerations": []},
        }
    )
    manifest["spec"]["trainer"]["image"] = "ghcr.io/mixrl/mixrl-trainer-torch@sha256:" + "a" * 64
    manifest["spec"]["rollout"] = {"environment": "coding", "sandbox": {"image": "ghcr.io/mixrl/sandbox:1"}}
    assert violations(STRICT, spec_of(manifest)) == []


def test_engine_arguments_refused_altogether() -> None:
    policy = Policy(allow_engine_args=False)
    assert violations(policy, spec_of(pools({}, {"engineArgs": ["--tp", "2"]}))) == [
        "spec.samplerPools[1].engineArgs: extra engine arguments are not allowed by the cluster's policy"
    ]
    assert violations(policy, spec_of(pools({"engineArgs": []}))) == []


@pytest.mark.parametrize(
    ("policy", "allowed"),
    [
        (Policy(), True),
        (Policy(allow_scheduling=False), False),  # no list: priority classes follow allowScheduling
        (Policy(allowed_priority_classes=("rl-batch",)), False),
        (Policy(allowed_priority_classes=("high",)), True),
        (Policy(allow_scheduling=False, allowed_priority_classes=("high",)), True),  # the list decides
    ],
)
def test_priority_classes_follow_the_list_else_allow_scheduling(policy: Policy, allowed: bool) -> None:
    found = violations(policy, spec_of(with_trainer(scheduling={"priorityClassName": "high"})))
    assert (found == []) is allowed
    if not allowed and not policy.allowed_priority_classes:
        assert found == [
            "spec.trainer.scheduling.priorityClassName: priority classes are not allowed by the cluster's policy"
        ]


def test_several_problems_are_reported_in_the_admission_policys_order() -> None:
    manifest = pools(
        {"scheduling": {"nodeSelector": {"a": "b"}}},
        {"image": "evil/x:1", "engineArgs": ["--evil"]},
    )
    manifest["spec"]["trainer"]["scheduling"] = {"tolerations": [{"operator": "Exists"}]}
    manifest["spec"]["rollout"] = {"environment": "coding", "sandbox": {"image": "evil/sandbox:1"}}
    found = violations(STRICT, spec_of(manifest))
    assert [line.split(":")[0] for line in found] == [
        "spec.samplerPools[1].image",
        "spec.rollout.sandbox.image",
        "spec.samplerPools[1].engineArgs[0]",
        "spec.trainer.scheduling.tolerations",
        "spec.samplerPools[0].scheduling.nodeSelector",
    ]
    assert violation(STRICT, spec_of(manifest)) == found[0] + " (and 4 more)"


@pytest.mark.parametrize(
    ("argument", "shown"),
    [
        ("--trust-remote-code", "--trust-remote-code"),
        ("--model-path=/etc/secret", "--model-path"),
        ("--x\n--y", "this argument"),  # never a second line in a message
        ("-" + "x" * 500, "this argument"),  # nor a pasted blob
    ],
)
def test_a_flag_is_shown_plainly_or_not_at_all(argument: str, shown: str) -> None:
    assert flag_shown(argument) == shown
    line = violation(Policy(allowed_engine_flags=("--ok",)), spec_of(pools({"engineArgs": [argument]})))
    assert line is not None and "\n" not in line and len(line) < 200 and f"]: {shown} is not" in line


# ----------------------------------------------------------------------------- status


def test_the_policy_violation_condition_goes_once_the_run_is_allowed() -> None:
    refused = refused_run_status({}, 1, "spec.trainer.image: x is not an allowed image (...)", "t0")
    c = {c["type"]: c for c in refused["conditions"]}
    assert refused["phase"] == "Invalid"
    assert (c["PolicyViolation"]["status"], c["PolicyViolation"]["reason"]) == ("True", "PolicyViolation")
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "PolicyViolation")
    assert c["InvalidSpec"]["status"] == "False", "the spec is valid; the cluster refuses it"
    allowed = run_status(refused, 2, {}, [], "t1")
    assert "PolicyViolation" not in {c["type"] for c in allowed["conditions"]}


# ----------------------------------------------------------------------------- the operator


async def refused_with_nothing_created(api: ApiServer, line: str) -> None:
    """The run ``demo`` is marked PolicyViolation with ``line``, Invalid, and nothing of it is made.
    Not retried: the resyncs reconcile it again (reads only), no write."""

    def refused() -> bool:
        run = api.live(RLRUNS, NAMESPACE, "demo")
        return conditions(run).get("PolicyViolation", {}).get("status") == "True"

    await eventually(refused, what="PolicyViolation=True")
    await writes_settled(api, quiet=1.0)
    run = api.live(RLRUNS, NAMESPACE, "demo")
    assert conditions(run)["PolicyViolation"]["message"] == line
    assert run["status"]["phase"] == "Invalid"
    created = [r for r in writes(api) if r.resource is not None and r.resource.plural != "rlruns"]
    assert not [r for r in created if r.resource.plural not in ("events", "clusterkopfpeerings")], (
        "nothing of the run"
    )


async def test_a_refused_run_is_marked_and_creates_nothing(api: ApiServer, operator: Any) -> None:
    manifest = pools({}, {"image": "docker.io/evil/sglang:1"})
    line = (
        "spec.samplerPools[1].image: docker.io/evil/sglang:1 is not an allowed image (the cluster's "
        "policy allows images starting with ghcr.io/mixrl/, lmsysorg/sglang:)"
    )
    async with operator(policy=STRICT, resync_interval_s=0.2):
        await create(api, manifest)
        await refused_with_nothing_created(api, line)
        warnings = [e for e in events(api) if e["reason"] == "PolicyViolation"]
        assert len(warnings) == 1 and warnings[0]["type"] == "Warning" and warnings[0]["message"] == line

        # An allowed image is a change the operator acts on: the run is built, the condition goes.
        fixed = copy.deepcopy(manifest["spec"]["samplerPools"])
        fixed[1]["image"] = "lmsysorg/sglang:v0.5.6"
        await patch(api, run_path("demo"), {"spec": {"samplerPools": fixed}})

        def built() -> bool:
            return bool(api.names("apps/v1/deployments", NAMESPACE))

        await eventually(built, what="the run's Deployments")
        await eventually(
            lambda: "PolicyViolation" not in conditions(api.live(RLRUNS, NAMESPACE, "demo")),
            what="PolicyViolation gone",
        )


async def test_a_run_whose_sandbox_image_is_refused_creates_nothing(api: ApiServer, operator: Any) -> None:
    """The sandbox pods' image is the run's own, under the same prefixes: no sandbox account, role or
    pod template (nor anything else of the run) for an image from elsewhere."""
    line = (
        "spec.rollout.sandbox.image: docker.io/evil/sandbox:1 is not an allowed image (the cluster's "
        "policy allows images starting with ghcr.io/mixrl/, lmsysorg/sglang:)"
    )
    async with operator(policy=STRICT, resync_interval_s=0.2):
        await create(api, with_sandbox(image="docker.io/evil/sandbox:1"))
        await refused_with_nothing_created(api, line)
