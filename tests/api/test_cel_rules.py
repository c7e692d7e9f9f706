"""The CRDs' CEL rules agree with the pydantic validators: the same documents are refused, with the
same one-line reason at the same path.

Every rule of the generated CRDs is evaluated here with cel-python (``celpy``) where and as the API
server evaluates it: after the schema's defaults are applied, on every node of the document that
carries rules, with ``self`` typed by the schema (``number`` fields as doubles even when written as
integers; null fields absent, as the API server treats them), skipping null nodes, and reporting
``<path><fieldPath>: <message or messageExpression>``.  tests/cluster/test_admission.py sends the
same kinds of documents to a real kube-apiserver.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes

from mixrl.api import rules
from mixrl.api.crd import rlrun_crd, samplerpool_crd
from mixrl.api.errors import InvalidSpec
from mixrl.api.gpus import GPU_TABLE, GpuCapability
from mixrl.api.loader import parse_document
from mixrl.api.models import SamplerPoolTemplate

from .conftest import ROOT, sampler_pool, set_at

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
Doc = dict[str, Any]
Schema = dict[str, Any]

# ----------------------------------------------------------------------------- the API server's CEL pass

_ENV = celpy.Environment()


def _format(pattern: celtypes.StringType, arguments: celtypes.ListType) -> celtypes.StringType:
    """``string.format(list)`` of the API server's CEL strings library, which cel-python lacks, for the
    two verbs mixrl.api.rules emits: ``%s`` (the arguments are strings) and ``%%``."""
    values = iter(arguments)

    def verb(match: re.Match[str]) -> str:
        if match.group(1) == "%":
            return "%"
        assert match.group(1) == "s", f"verb %{match.group(1)} in {pattern!r}"
        return str(next(values))

    text = re.sub(r"%(.)", verb, str(pattern))
    assert next(values, None) is None, f"more arguments than verbs in {pattern!r}"
    return celtypes.StringType(text)


def _sum(values: celtypes.ListType) -> celtypes.IntType:
    """``list.sum()`` of the API server's CEL lists library (cel-python lacks it), for int lists."""
    return celtypes.IntType(sum(int(v) for v in values))


@functools.cache
def _program(expression: str) -> celpy.Runner:
    return _ENV.program(_ENV.compile(expression), functions={"format": _format, "sum": _sum})


def _evaluate(expression: str, self_value: Any) -> Any:
    result = _program(expression).evaluate({"self": self_value})
    if isinstance(result, celpy.CELEvalError):  # the API server would report it; a bug in a rule
        raise AssertionError(f"{expression!r} failed to evaluate: {result}")
    return result


def _to_cel(value: Any, schema: Schema) -> Any:
    """A JSON value as the API server hands it to CEL, typed by its schema."""
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties")
        if properties is not None:  # undeclared fields are invisible, null ones absent
            return celtypes.MapType(
                {
                    celtypes.StringType(k): _to_cel(v, properties[k])
                    for k, v in value.items()
                    if k in properties and v is not None
                }
            )
        if isinstance(schema.get("additionalProperties"), dict):
            items = schema["additionalProperties"]
            return celtypes.MapType({celtypes.StringType(k): _to_cel(v, items) for k, v in value.items()})
        return celpy.json_to_cel(value)
    if kind == "array":
        return celtypes.ListType([_to_cel(v, schema["items"]) for v in value])
    converters: dict[str, Callable[[Any], Any]] = {
        "number": lambda v: celtypes.DoubleType(float(v)),
        "integer": celtypes.IntType,
        "string": celtypes.StringType,
        "boolean": celtypes.BoolType,
    }
    return converters[kind](value)


def _apply_defaults(value: Any, schema: Schema) -> None:
    """Structural defaulting: an absent field with a schema default gets it (a null one keeps null)."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if value.get(key) is not None:
                _apply_defaults(value[key], sub)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _apply_defaults(item, schema["items"])


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _validate(schema: Schema, value: Any, path: str, problems: list[str]) -> None:
    if value is None:  # the API server validates only non-null values
        return
    validations = schema.get("x-kubernetes-validations", [])
    if validations:
        self_value = _to_cel(value, schema)
        for rule in validations:
            result = _evaluate(rule["rule"], self_value)
            assert isinstance(result, celtypes.BoolType), (rule["rule"], result)
            if result:
                continue
            if "messageExpression" in rule:
                message = str(_evaluate(rule["messageExpression"], self_value))
            else:
                message = rule["message"]
            where = path
            for part in rule.get("fieldPath", "").split(".")[1:]:
                where = _child(where, part)
            problems.append(f"{where}: {message}")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _validate(sub, value[key], _child(path, key), problems)
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            _validate(schema["items"], item, f"{path}[{index}]", problems)


def admission_problems(doc: Doc, crd: dict[str, Any]) -> list[str]:
    """What the API server's CEL rules refuse in ``doc``, one ``path: reason`` line each."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    doc = copy.deepcopy(doc)
    _apply_defaults(doc, schema)
    problems: list[str] = []
    _validate(schema, doc, "", problems)
    return sorted(problems)


def validate_problems(doc: Doc) -> list[str]:
    """What `mixrl validate` refuses in ``doc`` (the same function: mixrl.api.loader.parse_document)."""
    try:
        parse_document(doc)
    except InvalidSpec as exc:
        return sorted(str(p) for p in exc.problems)
    return []


# ----------------------------------------------------------------------------- documents


def example() -> Doc:
    return yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())


def quickstart() -> Doc:
    return yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())


def pools(doc: Doc) -> list[Doc]:
    return doc["spec"]["samplerPools"]


def table_with(changes: dict[str, dict[str, Any]]) -> dict[str, GpuCapability]:
    """The GPU table with some GPUs' capabilities changed (``{"H100": {"fp4_tensor_cores": True}}``)."""
    table = dict(GPU_TABLE)
    for gpu_type, fields in changes.items():
        table[gpu_type] = replace(GPU_TABLE[gpu_type], **fields)
    return table


@dataclass(frozen=True)
class Case:
    rule: str
    """The rule the document breaks (every rule has at least one case)."""
    mutate: Callable[[Doc], None]
    expected: str
    """The one line `mixrl validate` prints for it."""
    cel_path: str | None = None
    """Where the API server reports it, when a static fieldPath cannot name the list index."""
    table: Mapping[str, GpuCapability] | None = None
    """A GPU table other than the real one (the rule does not fire with the real table)."""
    start: Callable[[], Doc] = example


def _pool(index: int, **fields: Any) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        pool = pools(doc)[index]
        for key, value in fields.items():
            if value is None:
                pool.pop(key, None)
            else:
                pool[key] = value

    return mutate


def _rename_pools(*names: str) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        for pool, name in zip(pools(doc), names, strict=False):
            pool["name"] = name

    return mutate


FP4_WITHOUT_FP8 = table_with({"A100": {"fp4_tensor_cores": True}})
"""A made-up GPU with FP4 but no FP8 tensor cores: the only way the default-KV-cache rule can fire."""


def _store_refusal(store: str) -> str:
    return (
        f"spec.weights.store: {store} is the root or lies in a directory where the pods mount a volume of"
        " their own (/etc/mixrl, /var/cache/mixrl, /var/run/mixrl/auth, /tmp, /var/lib/mixrl/engine-weights,"
        " /var/lib/mixrl/buffer, /var/lib/mixrl/trainer): the weights volume mounted there would collide"
        " with it; choose another directory (the default is /var/lib/mixrl/weights)"
    )


CASES: dict[str, Case] = {
    "reserved-name": Case(
        "reserved-pool-name",
        _pool(0, name="trainer"),
        "spec.samplerPools[0].name: 'trainer' is reserved for the run's own trainer objects",
    ),
    # Before, valid: its figures took the run's place (the trainer's pool="all" series, the collapse
    # signs' scope "run").
    "pool-named-all": Case(
        "reserved-pool-name",
        _pool(2, name="all"),
        "spec.samplerPools[2].name: 'all' is reserved for the whole run's figures (metrics label pool"
        " 'all', collapse signs scope 'run')",
    ),
    "pool-named-run": Case(
        "reserved-pool-name",
        _pool(0, name="run"),
        "spec.samplerPools[0].name: 'run' is reserved for the whole run's figures (metrics label pool"
        " 'all', collapse signs scope 'run')",
    ),
    "min-above-max": Case(
        "replica-bounds",
        _pool(1, minReplicas=9, maxReplicas=8),
        "spec.samplerPools[1].minReplicas: 9 exceeds maxReplicas 8",
    ),
    "min-above-default-max": Case(
        "replica-bounds",
        _pool(0, minReplicas=2, maxReplicas=None),
        "spec.samplerPools[0].minReplicas: 2 exceeds maxReplicas 1",
    ),
    "fp8-weights-on-a100": Case(
        "weights-need-fp8",
        _pool(6, weightPrecision="fp8"),
        "spec.samplerPools[6].weightPrecision: fp8 needs FP8 tensor cores, which A100 lacks",
    ),
    "fp8-weights-and-fp8-kv-on-a100": Case(  # the weights are reported, not the KV cache too
        "weights-need-fp8",
        _pool(6, weightPrecision="fp8", kvCacheDtype="fp8"),
        "spec.samplerPools[6].weightPrecision: fp8 needs FP8 tensor cores, which A100 lacks",
    ),
    "nvfp4-on-h200": Case(
        "weights-need-fp4",
        _pool(2, weightPrecision="nvfp4"),
        "spec.samplerPools[2].weightPrecision: nvfp4 needs FP4 tensor cores, which H200 lacks",
    ),
    "mxfp4-on-a100-default-kv": Case(
        "weights-need-fp4",
        _pool(6, weightPrecision="mxfp4", kvCacheDtype=None),
        "spec.samplerPools[6].weightPrecision: mxfp4 needs FP4 tensor cores, which A100 lacks",
    ),
    "fp8-kv-on-a100": Case(
        "fp8-kv-cache-needs-fp8",
        _pool(6, kvCacheDtype="fp8"),
        "spec.samplerPools[6].kvCacheDtype: an fp8 KV cache needs FP8 tensor cores, which A100 lacks",
    ),
    "default-fp8-kv-without-fp8": Case(
        "default-fp8-kv-cache-needs-fp8",
        _pool(6, weightPrecision="nvfp4", kvCacheDtype=None),
        "spec.samplerPools[6].kvCacheDtype: an fp8 KV cache needs FP8 tensor cores, which A100 lacks"
        " (the default for low-precision pools; set bf16)",
        table=FP4_WITHOUT_FP8,
    ),
    "sglang-on-cpu": Case(
        "sglang-needs-gpu",
        _pool(7, gpuType="cpu"),
        "spec.samplerPools[7].engine: sglang needs a GPU; use the torch engine for gpuType cpu",
    ),
    # Before, accepted: the pool's pods requested an H200 each and the engine computed on CPU.
    "torch-engine-on-a-gpu": Case(
        "torch-engine-on-cpu",
        _pool(4, engine="torch"),
        "spec.samplerPools[4].gpuType: the torch engine computes on CPU only (it never places the model on"
        " a GPU): on gpuType H200 its pods would hold GPUs they never use; use gpuType cpu, or engine sglang",
    ),
    "beta-one": Case(
        "betas-in-unit-interval",
        set_at("spec", "trainer", "optimizer", "betas", value=[0.9, 1]),
        "spec.trainer.optimizer.betas: each beta must be in [0, 1)",
    ),
    "top-k-zero": Case(
        "top-k-nonzero",
        set_at("spec", "algorithm", "topP", "k", value=0),
        "spec.algorithm.topP.k: k must be -1 (no cut) or positive",
    ),
    "tiny-llama": Case(
        "tiny-model-kind-known",
        set_at("spec", "model", "path", value="tiny:llama"),
        "spec.model.path: tiny:llama is not a tiny model mixrl builds: expected one of tiny:qwen3, tiny:qwen3_moe",
        start=quickstart,
    ),
    **{
        f"tiny-with-a-{field}": Case(
            f"tiny-model-own-{rule}",
            set_at("spec", "model", field, value=value),
            f"spec.model.{field}: a tiny: model uses mixrl's word tokenizer, which renders chats itself:"
            f" leave {field} out",
            start=quickstart,
        )
        for field, rule, value in (
            ("tokenizer", "tokenizer", "/models/tok"),
            ("chatTemplate", "chat-template", "{{ messages }}"),
        )
    },
    "store-in-tmp": Case(
        "weight-store-off-pod-directories",
        set_at("spec", "weights", "store", value="file:///tmp/weights"),
        _store_refusal("file:///tmp/weights"),
    ),
    "store-at-the-root": Case(
        "weight-store-off-pod-directories", set_at("spec", "weights", "store", value="/"), _store_refusal("/")
    ),
    "store-is-the-trainers": Case(
        "weight-store-off-pod-directories",
        set_at("spec", "weights", "store", value="/var/lib/mixrl/trainer/"),
        _store_refusal("/var/lib/mixrl/trainer/"),
    ),
    "groups-of-one": Case(
        "grpo-groups-of-two",
        set_at("spec", "algorithm", "samplesPerPrompt", value=1),
        "spec.algorithm.samplesPerPrompt: GRPO needs at least 2 samples per prompt: a group of one has"
        " advantage 0 (its reward minus its own mean) and no standard deviation, so nothing would be learned",
    ),
    "mis-below-one": Case(
        "mis-range",
        set_at("spec", "algorithm", "corrections", "mis", value=[0.5, 0.9]),
        "spec.algorithm.corrections.mis: range [lo, hi] must satisfy 0 < lo < 1 < hi",
    ),
    "mis-from-zero": Case(  # integers in a number field
        "mis-range",
        set_at("spec", "algorithm", "corrections", "mis", value=[0, 5]),
        "spec.algorithm.corrections.mis: range [lo, hi] must satisfy 0 < lo < 1 < hi",
    ),
    "tis-with-default-mis": Case(
        "mis-or-tis",
        set_at("spec", "algorithm", "corrections", value={"tis": 2.0}),
        "spec.algorithm.corrections.tis: choose one of mis and tis, not both",
    ),
    "tis-with-mis": Case(
        "mis-or-tis",
        set_at("spec", "algorithm", "corrections", "tis", value=2),
        "spec.algorithm.corrections.tis: choose one of mis and tis, not both",
    ),
    "pass-k-zero": Case(
        "pass-k-positive",
        set_at("spec", "evaluation", "passK", value=[1, 0, -2]),
        "spec.evaluation.passK: every k must be positive, got 0",
    ),
    "pass-k-above-samples": Case(
        "samples-cover-pass-k",
        set_at("spec", "evaluation", "passK", value=[1, 16, 8]),
        "spec.evaluation.samplesPerTask: 8 is below the largest passK 16",
    ),
    "pass-k-above-default-samples": Case(
        "samples-cover-pass-k",
        set_at("spec", "evaluation", value={"passK": [4]}),
        "spec.evaluation.samplesPerTask: 1 is below the largest passK 4",
    ),
    "duplicate-pool": Case(
        "unique-pool-names",
        _pool(3, name="b300-nvfp4"),
        "spec.samplerPools[3].name: duplicate pool name 'b300-nvfp4'",
        cel_path="spec.samplerPools",
    ),
    "duplicates-reported-in-list-order": Case(
        "unique-pool-names",
        _rename_pools("x", "y", "y", "x"),
        "spec.samplerPools[3].name: duplicate pool name 'x'",
        cel_path="spec.samplerPools",
    ),
    "long-run-name": Case(
        "run-name-length",
        set_at("metadata", "name", value="r" * 31),
        "metadata.name: at most 30 characters (children are <run>-<pool>)",
    ),
    "no-gpus-on-b200": Case(
        "gpus-per-replica-on-gpu",
        _pool(0, gpusPerReplica=0),
        "spec.samplerPools[0].gpusPerReplica: gpuType B200 needs at least 1 GPU per replica (0 is for gpuType cpu)",
    ),
    "replica-across-nodes-not-whole": Case(
        "gpus-per-replica-whole-nodes",
        _pool(3, gpusPerReplica=12),
        "spec.samplerPools[3].gpusPerReplica: 12 GPUs per replica span nodes of 8 H100 GPUs: a replica"
        " across nodes takes whole nodes, so use a multiple of 8",
    ),
    "replica-across-four-gpu-nodes-not-whole": Case(
        "gpus-per-replica-whole-nodes",
        _pool(3, gpusPerReplica=6),
        "spec.samplerPools[3].gpusPerReplica: 6 GPUs per replica span nodes of 4 H100 GPUs: a replica"
        " across nodes takes whole nodes, so use a multiple of 4",
        table=table_with({"H100": {"gpus_per_node": 4}}),
    ),
    "pool-name-taking-the-lws-suffix": Case(
        "reserved-pool-suffix",
        _pool(0, name="b200-lws"),
        "spec.samplerPools[0].name: 'b200-lws' ends in '-lws', which names a multi-node pool's"
        " LeaderWorkerSet and its Service",
    ),
    "multi-node-pool-name-too-long": Case(
        "multi-node-pool-name-length",
        lambda doc: (
            set_at("metadata", "name", value="r" * 30)(doc),
            _pool(3, name="h100-fp8-across-2-nodes", gpusPerReplica=16)(doc),
        ),
        "metadata.name: '<run>-<pool>' of pool 'h100-fp8-across-2-nodes', whose replica spans nodes,"
        " must be at most 46 characters (its LeaderWorkerSet's revision labels are"
        " '<run>-<pool>-lws-<group>-<hash>'): shorten the run or the pool name",
    ),
    "replica-across-nodes-on-torch": Case(
        "multi-node-replica-needs-sglang",
        _pool(4, gpusPerReplica=16, engine="torch", weightPrecision="bf16"),
        "spec.samplerPools[4].engine: a replica of 16 H200 GPUs spans nodes, which only engine sglang"
        " does (the torch engine runs on one node)",
    ),
    "toleration-exists-with-value": Case(
        "toleration-exists-has-no-value",
        _pool(1, scheduling={"tolerations": [{"key": "dedicated", "value": "rl"}]}),
        "spec.samplerPools[1].scheduling.tolerations[0].value: must be empty with operator Exists"
        " (use operator Equal to match a value)",
    ),
    "toleration-equal-without-key": Case(
        "toleration-equal-needs-key",
        set_at("spec", "trainer", "scheduling", value={"tolerations": [{"operator": "Equal", "value": "x"}]}),
        "spec.trainer.scheduling.tolerations[0].key: operator Equal needs a key (an empty key with operator"
        " Exists tolerates every taint)",
    ),
    "trainer-without-gpus": Case(
        "gpus-per-node-on-gpu",
        set_at("spec", "trainer", "gpusPerNode", value=0),
        "spec.trainer.gpusPerNode: gpuType H200 needs at least 1 GPU per node (0 is for gpuType cpu)",
    ),
    "trainer-default-type-without-gpus": Case(  # gpuType absent: the default H100
        "gpus-per-node-on-gpu",
        set_at("spec", "trainer", value={"gpusPerNode": 0}),
        "spec.trainer.gpusPerNode: gpuType H100 needs at least 1 GPU per node (0 is for gpuType cpu)",
    ),
    "tensor-parallel-3-on-32": Case(
        "parallelism-divides-gpus",
        set_at("spec", "trainer", "parallelism", "tp", value=3),
        "spec.trainer.parallelism: tp x pp x cp (3 x 1 x 1) must divide the trainer's world size 32"
        " (nodes x gpusPerNode)",
    ),
    "context-parallel-with-defaults": Case(  # no parallelism block, no nodes: 1 x 8 GPUs
        "parallelism-divides-gpus",
        set_at("spec", "trainer", value={"gpuType": "H200", "parallelism": {"cp": 16}}),
        "spec.trainer.parallelism: tp x pp x cp (1 x 1 x 16) must divide the trainer's world size 8"
        " (nodes x gpusPerNode)",
    ),
    "expert-parallel-beyond-data-parallel": Case(
        "expert-parallelism-divides-gpus",
        set_at("spec", "trainer", "parallelism", value={"tp": 4, "ep": 16}),
        "spec.trainer.parallelism.ep: tp x pp x ep (4 x 1 x 16) must divide the trainer's world size 32"
        " (nodes x gpusPerNode)",
    ),
    "huge-parallel-sizes-do-not-overflow": Case(  # tp x pp x cp would overflow int64 in CEL
        "parallelism-divides-gpus",
        set_at("spec", "trainer", "parallelism", value={"tp": 2**31 - 1, "pp": 2**31 - 1, "cp": 2**31 - 1}),
        "spec.trainer.parallelism: tp x pp x cp (2147483647 x 2147483647 x 2147483647) must divide the"
        " trainer's world size 32 (nodes x gpusPerNode)",
    ),
    "megatron-backend-on-cpu": Case(
        "megatron-backend-needs-gpus",
        lambda doc: doc["spec"]["trainer"].update(backend="megatron", gpuType="cpu"),
        "spec.trainer.backend: backend megatron trains on CUDA GPUs only (megatron-core); gpuType cpu"
        " needs backend torch",
    ),
    "megatron-backend-with-context-parallelism": Case(
        "megatron-backend-without-context-parallelism",
        lambda doc: doc["spec"]["trainer"].update(backend="megatron", parallelism={"cp": 2}),
        "spec.trainer.parallelism: the megatron backend does not support context parallelism yet: cp"
        " must be 1",
    ),
    "tensor-parallel-on-the-torch-backend": Case(  # 2 divides 32: only the backend refuses it
        "torch-backend-is-data-parallel",
        set_at("spec", "trainer", "parallelism", value={"tp": 2}),
        "spec.trainer.parallelism: the torch backend is data parallel (FSDP2): tp, pp, ep and cp must be 1"
        " (tensor, pipeline, expert and context parallelism need the megatron backend)",
    ),
    "model-path-on-s3": Case(
        "model-path-is-local",
        set_at("spec", "model", "path", value="s3://models/Qwen3-8B"),
        "spec.model.path: must be a directory the trainer can read (a mounted volume) or tiny:<kind>: the"
        " trainer loads it with transformers from local files and downloads nothing (no s3://, hf:// or"
        " https:// URLs)",
    ),
    "weight-store-on-s3": Case(
        "weight-store-is-a-path",
        set_at("spec", "weights", "store", value="s3://bucket/run"),
        "spec.weights.store: must be an absolute path or a file:/// URL (the trainer and the engines share"
        " it as a volume mounted there: a relative path would name each container's own working"
        " directory); object stores such as s3:// have no storage backend yet",
    ),
    # Before, a relative store passed validation and the operator mounted no volume: the trainer
    # wrote its versions into its own container and the engines never saw them.
    "weight-store-relative": Case(
        "weight-store-is-a-path",
        set_at("spec", "weights", "store", value="weights"),
        "spec.weights.store: must be an absolute path or a file:/// URL (the trainer and the engines share"
        " it as a volume mounted there: a relative path would name each container's own working"
        " directory); object stores such as s3:// have no storage backend yet",
    ),
    "top-p-without-top-k-on-sglang": Case(
        "sglang-mask-needs-top-k",
        set_at("spec", "algorithm", "topP", "k", value=-1),
        "spec.algorithm.topP.k: top-p below 1 needs a positive k on SGLang pools: SGLang returns the"
        " sampling support only under a finite top-k and aborts the request otherwise (or run every"
        " pool on the torch engine)",
    ),
    "gpu-budget-below-minimums": Case(  # minReplicas 2 + 1 + 1 + 1 at one GPU each
        "gpu-budget-covers-minimums",
        set_at("spec", "autoscaling", "gpuBudget", value=4),
        "spec.autoscaling.gpuBudget: 4 GPUs cannot hold the pools' minimums: minReplicas x gpusPerReplica"
        " sum to 5",
    ),
    "trainer-objective-with-keda": Case(
        "trainer-objective-needs-builtin",
        lambda doc: [
            set_at("spec", "autoscaling", "objective", value="trainer")(doc),
            set_at("spec", "autoscaling", "engine", value="keda")(doc),
        ],
        "spec.autoscaling.objective: trainer sizes the whole fleet in mixrl's own loop and needs engine"
        " builtin, not keda (KEDA scales each pool from its own query)",
    ),
    # Before, valid: the workers past trainSize died at their start (no task in their shard).
    "more-rollout-workers-than-tasks": Case(
        "rollout-workers-have-tasks",
        set_at("spec", "rollout", value={"workers": 5, "dataset": {"trainSize": 4}}),
        "spec.rollout.workers: 5 workers each play their own shard of the training split, and trainSize 4"
        " leaves some of them none: at most trainSize workers",
    ),
    "gpu-budget-with-keda": Case(
        "gpu-budget-needs-builtin",
        lambda doc: [
            set_at("spec", "autoscaling", "gpuBudget", value=5)(doc),
            set_at("spec", "autoscaling", "engine", value="keda")(doc),
        ],
        "spec.autoscaling.gpuBudget: a GPU budget shared by the pools is kept by mixrl's own loop and needs"
        " engine builtin, not keda (KEDA scales each pool on its own; none scales nothing)",
    ),
    "cost-budget-with-the-queue-objective": Case(
        "cost-budget-needs-trainer-objective",
        set_at("spec", "autoscaling", "costBudgetPerHour", value=100.0),
        "spec.autoscaling.costBudgetPerHour: only objective trainer plans the fleet by cost; objective"
        " queue sizes each pool to its load and would ignore it",
    ),
    "gpu-budget-below-default-minimums": Case(  # pools without minReplicas or gpusPerReplica: 1 x 1
        "gpu-budget-covers-minimums",
        lambda doc: [
            set_at("spec", "autoscaling", "gpuBudget", value=6)(doc),
            _pool(4, minReplicas=None)(doc),
            _pool(5, minReplicas=None, gpusPerReplica=2)(doc),
        ],
        "spec.autoscaling.gpuBudget: 6 GPUs cannot hold the pools' minimums: minReplicas x gpusPerReplica"
        " sum to 8",
    ),
    "sampler-pool-min-above-default-max": Case(
        "replica-bounds",
        set_at("spec", "minReplicas", value=2),
        "spec.minReplicas: 2 exceeds maxReplicas 1",
        start=sampler_pool,
    ),
}

VALID: dict[str, Callable[[Doc], None]] = {
    "mis-off-with-tis": set_at("spec", "algorithm", "corrections", value={"mis": None, "tis": 2.0}),
    "kv-null-reads-as-default": _pool(2, kvCacheDtype=None),
    "nvfp4-on-rtx-pro": _pool(7, weightPrecision="nvfp4"),
    "cpu-with-torch": _pool(7, gpuType="cpu", engine="torch"),
    "pass-k-within-samples": set_at("spec", "evaluation", value={"passK": [1, 4], "samplesPerTask": 4}),
    "name-of-30": set_at("metadata", "name", value="r" * 30),
    # k off with top-p on: refused on SGLang pools (sglang-mask-needs-top-k); with p = 1 it is valid.
    "top-k-off": set_at("spec", "algorithm", "topP", value={"p": 1.0, "k": -1}),
    "cpu-pool-without-gpus": _pool(7, gpuType="cpu", engine="torch", gpusPerReplica=0),
    "cpu-trainer-without-gpus": set_at("spec", "trainer", value={"gpuType": "cpu", "gpusPerNode": 0}),
    "data-parallel-trainer-on-cpu": set_at(  # two trainer processes, sizes 1 spelled out
        "spec", "trainer", value={"gpuType": "cpu", "gpusPerNode": 2, "parallelism": {"tp": 1, "ep": 1}}
    ),
    # Before, validate and the operator refused this for every backend ("the torch backend is data
    # parallel"), while the API server's CEL limited that rule to backend torch (issue #28).
    "megatron-with-tensor-pipeline-and-expert-parallelism": set_at(
        "spec",
        "trainer",
        value={
            "backend": "megatron",
            "gpuType": "H100",
            "nodes": 1,
            "gpusPerNode": 8,
            "parallelism": {"tp": 2, "pp": 2, "ep": 2},
        },
    ),
    "gpu-budget-that-covers": set_at("spec", "autoscaling", "gpuBudget", value=5),
    "cost-budget-with-the-trainer-objective": set_at(
        "spec", "autoscaling", value={"engine": "builtin", "objective": "trainer", "costBudgetPerHour": 100.0}
    ),
    "weight-store-as-an-absolute-path": set_at("spec", "weights", "store", value="/weights"),
    # a cpu pool's gpusPerReplica defaults to 0 (null reads as absent): only 2 + 1 + 1 of the budget
    "cpu-pools-take-no-gpus-of-the-budget": lambda doc: [
        set_at("spec", "autoscaling", "gpuBudget", value=4)(doc),
        _pool(3, gpuType="cpu", engine="torch")(doc),
        set_at("spec", "samplerPools", 2, "gpusPerReplica", value=None)(doc),
        _pool(2, gpuType="cpu", engine="torch", minReplicas=3)(doc),
    ],
    "toleration-equal-with-key": _pool(
        0, scheduling={"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl"}]}
    ),
    "toleration-of-everything": _pool(0, scheduling={"tolerations": [{"operator": "Exists"}]}),
    # a replica of two whole H100 nodes (a LeaderWorkerSet), and one of a whole node
    "two-node-replica": _pool(3, gpusPerReplica=16),
    "one-whole-node-replica": _pool(3, gpusPerReplica=8),
    # on gpuType cpu, gpusPerReplica requests nothing and spans nothing
    "cpu-pool-with-a-large-gpu-count": _pool(7, gpuType="cpu", engine="torch", gpusPerReplica=12),
    # a reserved name only as a part of the pool's name
    "pool-name-starting-with-all": _pool(0, name="all-h200"),
}


def _crd_for(doc: Doc, table: Mapping[str, GpuCapability] | None) -> dict[str, Any]:
    if doc.get("kind") == "SamplerPool":
        return samplerpool_crd()
    return rlrun_crd(table) if table is not None else rlrun_crd()


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(CASES))
def test_api_server_refuses_what_validate_refuses_with_the_same_reason(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[name]
    if case.table is not None:  # the models read the table at validation time
        monkeypatch.setattr("mixrl.api.models.GPU_TABLE", case.table)
        monkeypatch.setattr("mixrl.api.base.GPU_TABLE", case.table)  # the rules validator reads it there
    doc = case.start()
    case.mutate(doc)
    assert validate_problems(doc) == [case.expected]
    path, reason = case.expected.split(": ", 1)
    assert admission_problems(doc, _crd_for(doc, case.table)) == [f"{case.cel_path or path}: {reason}"]


def test_every_rule_has_a_case() -> None:
    assert {case.rule for case in CASES.values()} == {rule.name for rule in rules.RULES}


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_examples_pass_every_rule(example: Any) -> None:
    for doc in yaml.safe_load_all(example.read_text()):
        assert validate_problems(doc) == []
        assert admission_problems(doc, rlrun_crd()) == []


@pytest.mark.parametrize("name", list(VALID))
def test_valid_variants_pass_both(name: str) -> None:
    doc = example()
    VALID[name](doc)
    assert validate_problems(doc) == []
    assert admission_problems(doc, rlrun_crd()) == []


def test_valid_sampler_pool_passes_both() -> None:
    assert validate_problems(sampler_pool()) == []
    assert admission_problems(sampler_pool(), samplerpool_crd()) == []


def test_the_api_server_fills_in_mis_so_tis_alone_is_refused() -> None:
    # null and absent look alike to CEL; the default in the schema makes absent mean "the paper's range"
    corrections = rlrun_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    corrections = corrections["properties"]["algorithm"]["properties"]["corrections"]
    assert corrections["properties"]["mis"]["default"] == [0.2, 5.0]
    assert corrections["properties"]["mis"]["nullable"] is True


# ----------------------------------------------------------------------------- the GPU table


def _pool_rules(table: Mapping[str, GpuCapability] = GPU_TABLE) -> dict[str, str]:
    """The pool node's rules by field: ``weightPrecision`` has one per kind of tensor cores."""
    rules_by_field: dict[str, str] = {}
    for validation in rules.cel_validations(SamplerPoolTemplate, table):
        rules_by_field[validation["fieldPath"]] = rules_by_field.get(validation["fieldPath"], "") + (
            "\n" + validation["rule"]
        )
    return rules_by_field


def _gpu_list(gpu_types: list[str]) -> str:
    return "self.gpuType in [" + ", ".join(f'"{g}"' for g in gpu_types) + "]"


def test_generated_gpu_lists_are_the_table() -> None:
    lacking_fp4 = [g for g, c in GPU_TABLE.items() if not (c.fp4_tensor_cores or c.emulated)]
    lacking_fp8 = [g for g, c in GPU_TABLE.items() if not (c.fp8_tensor_cores or c.emulated)]
    emulated = [g for g, c in GPU_TABLE.items() if c.emulated]
    assert (lacking_fp4, lacking_fp8, emulated) == (["A100", "H100", "H200"], ["A100"], ["cpu"])
    generated = _pool_rules()
    assert _gpu_list(lacking_fp4) in generated[".weightPrecision"]
    assert _gpu_list(lacking_fp8) in generated[".weightPrecision"]
    assert _gpu_list(lacking_fp8) in generated[".kvCacheDtype"]
    assert _gpu_list(emulated) in generated[".engine"]
    # and what the CRD files carry is exactly that
    items = rlrun_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    items = items["properties"]["samplerPools"]["items"]
    assert items["x-kubernetes-validations"] == rules.cel_validations(SamplerPoolTemplate)


def test_rules_follow_a_changed_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # H100 gains FP4 and A100 gains FP8: H100 leaves the FP4 list, and no GPU lacks FP8 any more,
    # so the FP8 weight and KV-cache rules disappear.
    table = table_with({"H100": {"fp4_tensor_cores": True}, "A100": {"fp8_tensor_cores": True}})
    generated = _pool_rules(table)
    assert _gpu_list(["A100", "H200"]) in generated[".weightPrecision"]
    assert "H100" not in generated[".weightPrecision"]
    assert ".kvCacheDtype" not in generated
    assert [v["fieldPath"] for v in rules.cel_validations(SamplerPoolTemplate, table)].count(
        ".weightPrecision"
    ) == 1
    # the same documents change verdict on both sides
    monkeypatch.setattr("mixrl.api.models.GPU_TABLE", table)
    monkeypatch.setattr("mixrl.api.base.GPU_TABLE", table)  # the rules validator reads it there
    doc = example()
    _pool(3, weightPrecision="nvfp4")(doc)  # h100-fp8 -> nvfp4
    _pool(6, weightPrecision="fp8", kvCacheDtype="fp8")(doc)  # a100-bf16 -> fp8, fp8 KV cache
    assert validate_problems(doc) == [] == admission_problems(doc, rlrun_crd(table))
    _pool(4, weightPrecision="nvfp4")(doc)  # h200 still lacks FP4
    line = "spec.samplerPools[4].weightPrecision: nvfp4 needs FP4 tensor cores, which H200 lacks"
    assert validate_problems(doc) == [line] == admission_problems(doc, rlrun_crd(table))


def test_rule_costs_are_bounded_by_the_schema() -> None:
    # The API server estimates a rule's cost from the sizes the schema allows; the quadratic rules
    # range over lists with a maxItems, and their strings have an enum or a maxLength.
    spec = rlrun_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    sampler_pools = spec["properties"]["samplerPools"]
    assert sampler_pools["maxItems"] == rules.MAX_SAMPLER_POOLS
    assert spec["properties"]["evaluation"]["properties"]["passK"]["maxItems"] == rules.MAX_PASS_K
    pool = sampler_pools["items"]["properties"]
    assert pool["name"]["maxLength"] == 24
    for field in ("gpuType", "weightPrecision", "kvCacheDtype", "engine"):
        assert pool[field]["enum"], field


def test_a_rule_listed_before_a_rule_that_pre_empts_it_is_refused() -> None:
    # The Python side reports the first broken rule of a model, the CEL side lets ``unless`` pre-empt:
    # they agree only if every pre-empting rule is checked first.
    pre_empted = replace(rules.FP8_KV_CACHE, unless=(rules.SGLANG_NEEDS_GPU.name,))
    with pytest.raises(ValueError, match="must come before it on SamplerPoolTemplate"):
        rules._check_order((pre_empted, rules.SGLANG_NEEDS_GPU))
    assert rules._check_order((rules.SGLANG_NEEDS_GPU, pre_empted))["SamplerPoolTemplate"] == (
        rules.SGLANG_NEEDS_GPU,
        pre_empted,
    )


def test_every_model_a_rule_names_is_a_model_that_enforces_it() -> None:
    import mixrl.api.models as models

    for model_name in rules.RULES_BY_MODEL:
        model = getattr(models, model_name)
        assert issubclass(model, models.Model), model_name
