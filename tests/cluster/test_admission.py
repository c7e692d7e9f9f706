"""Admission-time validation: the real kube-apiserver refuses an invalid RLRun or SamplerPool, through
the CEL rules that mixrl.api.rules generates into the CRDs, with the reason `mixrl validate` prints.

Each document below starts from examples/rlrun-mixed.yaml (or a SamplerPool) and breaks one rule.
The expected reasons are not written here: one `mixrl validate` run over all the documents gives
them, and every `kubectl apply` must fail with that reason on a line naming the same field.
tests/api/test_cel_rules.py checks the same rules without a cluster.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import pytest
import yaml

from mixrl.api import rules
from mixrl.api.crd import rlrun_crd, samplerpool_crd

from ..api.conftest import sampler_pool

Doc = dict[str, Any]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlrun-mixed.yaml"


class Cluster(Protocol):
    """What these tests use of the ``cluster`` fixture (tests/cluster/conftest.py): the real kubectl."""

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]: ...


def get(cluster: Cluster, *args: str) -> Doc:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def example() -> Doc:
    return yaml.safe_load(EXAMPLE.read_text())


def pool(index: int, **fields: Any) -> Callable[[], Doc]:
    def build() -> Doc:
        doc = example()
        for key, value in fields.items():
            if value is None:
                doc["spec"]["samplerPools"][index].pop(key, None)
            else:
                doc["spec"]["samplerPools"][index][key] = value
        return doc

    return build


def at(*path: str, value: Any) -> Callable[[], Doc]:
    def build() -> Doc:
        doc = example()
        node = doc
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        return doc

    return build


# name -> (the rule it breaks, the document)
INVALID: dict[str, tuple[str, Callable[[], Doc]]] = {
    "reserved-name": (rules.RESERVED_POOL_NAME.name, pool(0, name="trainer")),
    "pool-named-all": (rules.RESERVED_POOL_NAME.name, pool(2, name="all")),
    "min-above-max": (rules.REPLICA_BOUNDS.name, pool(1, minReplicas=9, maxReplicas=8)),
    "min-above-default-max": (rules.REPLICA_BOUNDS.name, pool(0, minReplicas=2, maxReplicas=None)),
    "fp8-weights-on-a100": (rules.WEIGHTS_NEED["FP8"].name, pool(6, weightPrecision="fp8")),
    "nvfp4-on-h200": (rules.WEIGHTS_NEED["FP4"].name, pool(2, weightPrecision="nvfp4")),
    "mxfp4-on-a100-default-kv": (
        rules.WEIGHTS_NEED["FP4"].name,
        pool(6, weightPrecision="mxfp4", kvCacheDtype=None),
    ),
    "fp8-kv-on-a100": (rules.FP8_KV_CACHE.name, pool(6, kvCacheDtype="fp8")),
    "sglang-on-cpu": (rules.SGLANG_NEEDS_GPU.name, pool(7, gpuType="cpu")),
    "beta-one": (rules.BETAS.name, at("spec", "trainer", "optimizer", "betas", value=[0.9, 1])),
    "top-k-zero": (rules.TOP_K.name, at("spec", "algorithm", "topP", "k", value=0)),
    "tiny-llama": (rules.TINY_KIND_KNOWN.name, at("spec", "model", "path", value="tiny:llama")),
    "tiny-with-a-tokenizer": (
        rules.TINY_OWN_TOKENIZER.name,
        at("spec", "model", value={"path": "tiny:qwen3", "tokenizer": "/models/tok"}),
    ),
    "tiny-with-a-chat-template": (
        rules.TINY_OWN_CHAT_TEMPLATE.name,
        at("spec", "model", value={"path": "tiny:qwen3", "chatTemplate": "{{ messages }}"}),
    ),
    "store-in-tmp": (rules.STORE_OFF_POD_DIRS.name, at("spec", "weights", "store", value="file:///tmp/w")),
    "groups-of-one": (rules.GRPO_GROUPS.name, at("spec", "algorithm", "samplesPerPrompt", value=1)),
    "mis-below-one": (rules.MIS_RANGE.name, at("spec", "algorithm", "corrections", "mis", value=[0.5, 0.9])),
    "mis-from-zero": (rules.MIS_RANGE.name, at("spec", "algorithm", "corrections", "mis", value=[0, 5])),
    "tis-with-default-mis": (
        rules.MIS_OR_TIS.name,
        at("spec", "algorithm", "corrections", value={"tis": 2.0}),
    ),
    "tis-with-mis": (rules.MIS_OR_TIS.name, at("spec", "algorithm", "corrections", "tis", value=2)),
    "pass-k-zero": (rules.PASS_K_POSITIVE.name, at("spec", "evaluation", "passK", value=[1, 0])),
    "pass-k-above-samples": (
        rules.SAMPLES_COVER_PASS_K.name,
        at("spec", "evaluation", value={"passK": [1, 16], "samplesPerTask": 8}),
    ),
    "duplicate-pool": (rules.UNIQUE_POOL_NAMES.name, pool(3, name="b300-nvfp4")),
    "long-run-name": (rules.RUN_NAME_LENGTH.name, at("metadata", "name", value="r" * 31)),
    "sampler-pool-min-above-max": (
        rules.REPLICA_BOUNDS.name,
        lambda: sampler_pool(minReplicas=3, maxReplicas=2),
    ),
    "no-gpus-on-b200": (rules.POOL_NEEDS_GPUS.name, pool(0, gpusPerReplica=0)),
    "replica-across-nodes-not-whole": (rules.REPLICA_WHOLE_NODES.name, pool(3, gpusPerReplica=12)),
    "replica-across-nodes-on-torch": (
        rules.MULTI_NODE_NEEDS_SGLANG.name,
        pool(4, gpusPerReplica=16, engine="torch", weightPrecision="bf16"),
    ),
    "torch-engine-on-a-gpu": (rules.TORCH_ENGINE_ON_CPU.name, pool(4, engine="torch")),
    "pool-name-taking-the-lws-suffix": (rules.RESERVED_POOL_SUFFIX.name, pool(0, name="b200-lws")),
    "multi-node-pool-name-too-long": (
        rules.MULTI_NODE_NAME_LENGTH.name,
        lambda: {
            **(doc := pool(3, name="h100-fp8-across-2-nodes", gpusPerReplica=16)()),
            "metadata": {**doc["metadata"], "name": "r" * 30},
        },
    ),
    "toleration-exists-with-value": (
        rules.TOLERATION_EXISTS_NO_VALUE.name,
        pool(1, scheduling={"tolerations": [{"key": "dedicated", "value": "rl"}]}),
    ),
    "toleration-equal-without-key": (
        rules.TOLERATION_EQUAL_NEEDS_KEY.name,
        at("spec", "trainer", "scheduling", value={"tolerations": [{"operator": "Equal", "value": "x"}]}),
    ),
    "trainer-without-gpus": (rules.TRAINER_NEEDS_GPUS.name, at("spec", "trainer", "gpusPerNode", value=0)),
    "tensor-parallel-3-on-32": (
        rules.PARALLELISM_DIVIDES.name,
        at("spec", "trainer", "parallelism", "tp", value=3),
    ),
    "huge-parallel-sizes": (  # tp x pp x cp beyond int64: the rule divides step by step, no overflow
        rules.PARALLELISM_DIVIDES.name,
        at("spec", "trainer", "parallelism", value={"tp": 2**31 - 1, "pp": 2**31 - 1, "cp": 2**31 - 1}),
    ),
    "expert-parallel-16-with-tp-4-on-32": (
        rules.EXPERT_PARALLELISM_DIVIDES.name,
        at("spec", "trainer", "parallelism", value={"tp": 4, "ep": 16}),
    ),
    "megatron-backend-on-cpu": (
        rules.MEGATRON_NEEDS_GPUS.name,
        at(
            "spec", "trainer", value={**example()["spec"]["trainer"], "backend": "megatron", "gpuType": "cpu"}
        ),
    ),
    "megatron-backend-with-context-parallelism": (
        rules.MEGATRON_NO_CONTEXT_PARALLEL.name,
        at(
            "spec",
            "trainer",
            value={**example()["spec"]["trainer"], "backend": "megatron", "parallelism": {"cp": 2}},
        ),
    ),
    "tensor-parallel-on-the-torch-backend": (
        rules.TORCH_IS_DATA_PARALLEL.name,
        at("spec", "trainer", "parallelism", "tp", value=2),
    ),
    "model-path-on-s3": (rules.MODEL_PATH_IS_LOCAL.name, at("spec", "model", "path", value="s3://m/qwen3")),
    "weight-store-on-s3": (
        rules.STORE_IS_A_PATH.name,
        at("spec", "weights", "store", value="s3://bucket/run"),
    ),
    "weight-store-relative": (rules.STORE_IS_A_PATH.name, at("spec", "weights", "store", value="weights")),
    "top-p-without-top-k-on-sglang": (
        rules.SGLANG_MASK_NEEDS_TOP_K.name,
        at("spec", "algorithm", "topP", "k", value=-1),
    ),
    "gpu-budget-below-minimums": (
        rules.GPU_BUDGET_COVERS_MINIMUMS.name,
        at("spec", "autoscaling", "gpuBudget", value=2),
    ),
    "trainer-objective-with-keda": (
        rules.TRAINER_OBJECTIVE_NEEDS_BUILTIN.name,
        at("spec", "autoscaling", value={"engine": "keda", "objective": "trainer"}),
    ),
    "more-rollout-workers-than-tasks": (
        rules.WORKERS_HAVE_TASKS.name,
        at("spec", "rollout", value={"workers": 5, "dataset": {"trainSize": 4}}),
    ),
    "gpu-budget-with-keda": (
        rules.GPU_BUDGET_NEEDS_BUILTIN.name,
        at("spec", "autoscaling", value={"engine": "keda", "gpuBudget": 64}),
    ),
    "cost-budget-with-the-queue-objective": (
        rules.COST_BUDGET_NEEDS_TRAINER_OBJECTIVE.name,
        at("spec", "autoscaling", "costBudgetPerHour", value=100.0),
    ),
}

# name -> (the field the schema's bounds refuse, the document): simple bounds live in the schema
# (maximum, pattern, maxItems), so the API server refuses them without a CEL rule.
OUT_OF_BOUNDS: dict[str, tuple[str, Callable[[], Doc]]] = {
    "max-replicas-beyond-int32": ("spec.samplerPools[0].maxReplicas", pool(0, maxReplicas=2**31)),
    "gpus-per-node-true": ("spec.trainer.gpusPerNode", at("spec", "trainer", "gpusPerNode", value=True)),
    "volume-size-lots": ("spec.weights.volumeSize", at("spec", "weights", "volumeSize", value="lots")),
    "memory-negative": (
        "spec.trainer.resources.memory",
        at("spec", "trainer", "resources", value={"memory": "-5Gi"}),
    ),
    "lr-above-one": ("spec.trainer.optimizer.lr", at("spec", "trainer", "optimizer", "lr", value=3.0)),
    "node-selector-value": (
        "spec.samplerPools[0].scheduling.nodeSelector.zone",
        pool(0, scheduling={"nodeSelector": {"zone": "eu west"}}),
    ),
    "image-with-space": ("spec.samplerPools[0].image", pool(0, image="sglang latest")),
    "thirty-three-pools": (
        "spec.samplerPools",
        lambda: {
            **example(),
            "spec": {
                **example()["spec"],
                "samplerPools": [
                    {**example()["spec"]["samplerPools"][0], "name": f"p{i}"} for i in range(33)
                ],
            },
        },
    ),
}


def test_every_rule_the_real_table_can_break_is_sent() -> None:
    # With the real GPU table no GPU has FP4 without FP8, so the default-KV-cache rule cannot fire
    # (tests/api/test_cel_rules.py breaks it with a made-up table).
    unreachable = {rules.DEFAULT_FP8_KV_CACHE.name}
    assert {rule for rule, _ in INVALID.values()} == {r.name for r in rules.RULES} - unreachable


@pytest.fixture(scope="module")
def validate_reasons(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """name -> (path, reason) as one `mixrl validate` run prints them, one line per document."""
    names = list(INVALID)
    path = tmp_path_factory.mktemp("admission") / "invalid.yaml"
    path.write_text(yaml.safe_dump_all([INVALID[name][1]() for name in names], sort_keys=False))
    done = subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "validate", "-q", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 1, done.stdout + done.stderr
    reasons: dict[str, tuple[str, str]] = {}
    for line in done.stdout.splitlines():
        label, where, reason = line.split(": ", 2)
        index = int(label.rpartition("#")[2]) if "#" in label else 0
        assert names[index] not in reasons, f"{names[index]}: more than one problem: {done.stdout}"
        reasons[names[index]] = (where, reason)
    assert set(reasons) == set(names), done.stdout
    return reasons


def test_each_document_breaks_its_rule(validate_reasons: dict[str, tuple[str, str]]) -> None:
    # No cluster needed: the fixture already found one problem per document; it is the named rule's.
    for name, (rule_name, _) in INVALID.items():
        rule = next(r for r in rules.RULES if r.name == rule_name)
        fixed = [part for part in re.split(r"\{\w+\}", rule.template) if part]
        reason = validate_reasons[name][1]
        assert all(part in reason for part in fixed), (name, reason)


def apply(cluster: Cluster, namespace: str, doc: Doc) -> subprocess.CompletedProcess[str]:
    doc = copy.deepcopy(doc)
    doc["metadata"]["namespace"] = namespace
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)


def test_the_installed_crds_carry_the_generated_rules(cluster: Cluster) -> None:
    # The chart's CRDs are the generated ones, and the API server accepted their rules' cost.
    for crd in (rlrun_crd(), samplerpool_crd()):
        live = get(cluster, "crd", crd["metadata"]["name"])
        schema = live["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert schema == crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        established = {c["type"]: c["status"] for c in live["status"]["conditions"]}
        assert established.get("Established") == "True", live["status"]


@pytest.mark.parametrize("name", list(INVALID))
def test_the_api_server_refuses_with_the_reason_validate_gives(
    cluster: Cluster, namespace: str, validate_reasons: dict[str, tuple[str, str]], name: str
) -> None:
    rule, build = INVALID[name]
    where, reason = validate_reasons[name]
    done = apply(cluster, namespace, build())
    assert done.returncode != 0, f"accepted: {done.stdout}"
    # The same field, except where a static fieldPath cannot name the list index (duplicate names).
    field = "spec.samplerPools" if rule == rules.UNIQUE_POOL_NAMES.name else where
    pattern = re.escape(field) + r': (Forbidden|Invalid value(: "\w+")?): ' + re.escape(reason)
    assert re.search(pattern, done.stderr), f"{field}: {reason!r} not in {done.stderr!r}"
    kind = build()["kind"]
    assert cluster.kubectl("get", kind.lower(), "-n", namespace, "-o", "name").stdout.strip() == ""


@pytest.mark.parametrize("name", list(OUT_OF_BOUNDS))
def test_the_api_server_schema_refuses_what_the_bounds_refuse(
    cluster: Cluster, namespace: str, tmp_path: Path, name: str
) -> None:
    field, build = OUT_OF_BOUNDS[name]
    path = tmp_path / "doc.yaml"
    path.write_text(yaml.safe_dump(build()))
    validated = subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "validate", "-q", str(path)], capture_output=True, text=True
    )
    assert validated.returncode == 1 and validated.stdout.startswith(f"{path}: {field}: "), validated.stdout
    done = apply(cluster, namespace, build())
    assert done.returncode != 0, f"accepted: {done.stdout}"
    assert f"{field}: " in done.stderr, done.stderr
    assert cluster.kubectl("get", "rlrun", "-n", namespace, "-o", "name").stdout.strip() == ""


def test_the_valid_example_is_accepted(cluster: Cluster, namespace: str) -> None:
    done = apply(cluster, namespace, example())
    assert done.returncode == 0, done.stderr
    stored = get(cluster, "rlrun", "qwen3-moe-coding", "-n", namespace)
    assert [p["name"] for p in stored["spec"]["samplerPools"]] == [
        p["name"] for p in example()["spec"]["samplerPools"]
    ]
    assert apply(cluster, namespace, sampler_pool()).returncode == 0


def test_a_megatron_trainer_with_model_parallelism_is_accepted_by_both(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """Before, validate and the operator refused it ("the torch backend is data parallel") for
    every backend while the API server's CEL accepted it (issue #28)."""
    trainer = {"backend": "megatron", "gpuType": "H100", "nodes": 1, "gpusPerNode": 8,
               "parallelism": {"tp": 2, "pp": 2, "ep": 2}}  # fmt: skip
    doc = at("spec", "trainer", value=trainer)()
    path = tmp_path / "megatron.yaml"
    path.write_text(yaml.safe_dump(doc))
    validated = subprocess.run([sys.executable, "-m", "mixrl.cli", "validate", str(path)], capture_output=True, text=True)  # fmt: skip
    assert validated.returncode == 0, validated.stdout + validated.stderr
    done = apply(cluster, namespace, doc)
    assert done.returncode == 0, done.stderr
    stored = get(cluster, "rlrun", "qwen3-moe-coding", "-n", namespace)["spec"]["trainer"]["parallelism"]
    assert (stored["tp"], stored["pp"], stored["ep"]) == (2, 2, 2)


def test_mis_off_with_tis_is_accepted_and_absent_mis_is_filled_in(cluster: Cluster, namespace: str) -> None:
    tis_only = at("spec", "algorithm", "corrections", value={"mis": None, "tis": 2.0})()
    tis_only["metadata"]["namespace"] = namespace
    text = yaml.safe_dump(tis_only)
    # Client-side `kubectl apply` drops null fields, so there `mis: null` arrives as an absent mis,
    # which is the paper's range: refused with tis. Server-side apply (and create) keep the null.
    refused = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=text, check=False)
    assert "choose one of mis and tis, not both" in refused.stderr, refused.stderr
    cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=text)
    corrections = get(cluster, "rlrun", "qwen3-moe-coding", "-n", namespace)["spec"]["algorithm"][
        "corrections"
    ]
    assert corrections["mis"] is None and corrections["tis"] == 2.0
    # An absent mis is the paper's range, filled in by the API server (the CEL rules cannot tell
    # null from absent, so the CRD carries that default).
    doc = at("spec", "algorithm", "corrections", value={"scoreCentering": True})()
    doc["metadata"]["name"] = "defaults"
    assert apply(cluster, namespace, doc).returncode == 0
    corrections = get(cluster, "rlrun", "defaults", "-n", namespace)["spec"]["algorithm"]["corrections"]
    assert corrections["mis"] == [0.2, 5.0]
