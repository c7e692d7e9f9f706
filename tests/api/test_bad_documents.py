"""Bad RLRun documents, each refused with exactly one line naming the field.

Each case starts from examples/rlrun-mixed.yaml and breaks one thing a careless or hostile user
might write; the expected line is what `mixrl validate` prints after the file name.  The same table
also goes through the real command once, as one multi-document file.  Before the hardening, 24 of
these were accepted silently (maxReplicas 1e20, capacity .inf, volumeSize lots, ...).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from mixrl.api import models
from mixrl.api.errors import InvalidSpec
from mixrl.api.loader import parse_document, parse_yaml

from .conftest import ROOT, set_at

Doc = dict[str, Any]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())


def pool(index: int, **fields: Any) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        doc["spec"]["samplerPools"][index].update(fields)

    return mutate


def many_pools(count: int) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        first = doc["spec"]["samplerPools"][0]
        doc["spec"]["samplerPools"] = [{**first, "name": f"p{i}"} for i in range(count)]

    return mutate


P0 = "spec.samplerPools[0]"
QUANTITY = "(e.g. 500Gi, 1.5, 100m, 1e3)"
LABEL = "at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric"

# name -> (mutation of the mixed example, the one line `mixrl validate` prints for it)
CASES: dict[str, tuple[Callable[[Doc], None], str]] = {
    # ---- numbers: int32, finite, no booleans or strings for numbers
    "max-replicas-1e20": (pool(0, maxReplicas=1e20), f"{P0}.maxReplicas: expected an integer, got 1e+20"),
    "max-replicas-beyond-int32": (
        pool(0, maxReplicas=2**31),
        f"{P0}.maxReplicas: Input should be less than or equal to 2147483647",
    ),
    "max-replicas-as-string": (
        pool(0, maxReplicas="8"),
        f"{P0}.maxReplicas: expected an integer, got the string '8'",
    ),
    "huge-integer": (
        set_at("spec", "trainer", "nodes", value=10**400),
        "spec.trainer.nodes: Input should be less than or equal to 2147483647",
    ),
    "capacity-inf": (pool(0, capacity=float("inf")), f"{P0}.capacity: must be a finite number, got inf"),
    "capacity-nan": (pool(0, capacity=float("nan")), f"{P0}.capacity: must be a finite number, got nan"),
    "capacity-astronomical": (
        pool(0, capacity=1e300),
        f"{P0}.capacity: Input should be less than or equal to 1000000",
    ),
    "lr-inf": (
        set_at("spec", "trainer", "optimizer", "lr", value=float("inf")),
        "spec.trainer.optimizer.lr: must be a finite number, got inf",
    ),
    "lr-above-one": (
        set_at("spec", "trainer", "optimizer", "lr", value=3.0),
        "spec.trainer.optimizer.lr: Input should be less than or equal to 1",
    ),
    "beta-nan": (
        set_at("spec", "trainer", "optimizer", "betas", value=[0.9, float("nan")]),
        "spec.trainer.optimizer.betas[1]: must be a finite number, got nan",
    ),
    "mis-inf": (
        set_at("spec", "algorithm", "corrections", "mis", value=[0.2, float("inf")]),
        "spec.algorithm.corrections.mis[1]: must be a finite number, got inf",
    ),
    "gpus-per-node-true": (
        set_at("spec", "trainer", "gpusPerNode", value=True),
        "spec.trainer.gpusPerNode: expected an integer, got true",
    ),
    "capacity-true": (pool(0, capacity=True), f"{P0}.capacity: expected a number, got true"),
    "mask-replay-one": (
        set_at("spec", "algorithm", "topP", "maskReplay", value=1),
        "spec.algorithm.topP.maskReplay: expected true or false, got 1",
    ),
    "pass-k-true": (
        set_at("spec", "evaluation", "passK", value=[1, True]),
        "spec.evaluation.passK[1]: expected an integer, got true",
    ),
    "temperature-tiny": (
        set_at("spec", "algorithm", "temperature", value=1e-300),
        "spec.algorithm.temperature: Input should be greater than or equal to 0.001",
    ),
    "poll-interval-a-century": (
        set_at("spec", "autoscaling", "pollIntervalSeconds", value=3.2e9),
        "spec.autoscaling.pollIntervalSeconds: Input should be less than or equal to 604800",
    ),
    "negative-seed": (
        set_at("spec", "rollout", "dataset", value={"seed": -1}),
        "spec.rollout.dataset.seed: Input should be greater than or equal to 0",
    ),
    "gpus-per-replica-beyond-a-node": (
        pool(0, gpusPerReplica=1000),
        f"{P0}.gpusPerReplica: Input should be less than or equal to 64",
    ),
    # ---- quantities, by Kubernetes' rules
    "volume-size-lots": (
        set_at("spec", "weights", "volumeSize", value="lots"),
        f"spec.weights.volumeSize: 'lots' is not a Kubernetes quantity {QUANTITY}",
    ),
    "volume-size-with-space": (
        set_at("spec", "weights", "volumeSize", value="5 Gi"),
        f"spec.weights.volumeSize: '5 Gi' is not a Kubernetes quantity {QUANTITY}",
    ),
    "volume-size-capital-k": (  # kilo is k; K only in Ki
        set_at("spec", "weights", "volumeSize", value="500K"),
        f"spec.weights.volumeSize: '500K' is not a Kubernetes quantity {QUANTITY}",
    ),
    "volume-size-beyond-int64": (
        set_at("spec", "weights", "volumeSize", value="8Ei"),
        "spec.weights.volumeSize: '8Ei' is larger than 9223372036854775807 (the int64 Kubernetes stores)",
    ),
    "memory-negative": (
        set_at("spec", "trainer", "resources", value={"memory": "-5Gi"}),
        f"spec.trainer.resources.memory: '-5Gi' must be a positive quantity {QUANTITY}",
    ),
    "cpu-zero": (
        set_at("spec", "trainer", "resources", value={"cpu": "0"}),
        f"spec.trainer.resources.cpu: '0' must be a positive quantity {QUANTITY}",
    ),
    "cpu-fractional-exponent": (
        set_at("spec", "trainer", "resources", value={"cpu": "1e1.5"}),
        f"spec.trainer.resources.cpu: '1e1.5' is not a Kubernetes quantity {QUANTITY}",
    ),
    # ---- cross-field rules (with CEL twins in the CRD)
    "no-gpus-on-b200": (
        pool(0, gpusPerReplica=0),
        f"{P0}.gpusPerReplica: gpuType B200 needs at least 1 GPU per replica (0 is for gpuType cpu)",
    ),
    "trainer-without-gpus": (
        set_at("spec", "trainer", "gpusPerNode", value=0),
        "spec.trainer.gpusPerNode: gpuType H200 needs at least 1 GPU per node (0 is for gpuType cpu)",
    ),
    "tensor-parallel-3-on-32": (
        set_at("spec", "trainer", "parallelism", "tp", value=3),
        "spec.trainer.parallelism: tp x pp x cp (3 x 1 x 1) must divide the trainer's world size 32"
        " (nodes x gpusPerNode)",
    ),
    "expert-parallel-16-with-tp-4-on-32": (
        set_at("spec", "trainer", "parallelism", value={"tp": 4, "ep": 16}),
        "spec.trainer.parallelism.ep: tp x pp x ep (4 x 1 x 16) must divide the trainer's world size 32"
        " (nodes x gpusPerNode)",
    ),
    "megatron-backend-on-cpu": (
        lambda doc: doc["spec"]["trainer"].update(backend="megatron", gpuType="cpu"),
        "spec.trainer.backend: backend megatron trains on CUDA GPUs only (megatron-core); gpuType cpu"
        " needs backend torch",
    ),
    "megatron-backend-with-context-parallelism": (
        lambda doc: doc["spec"]["trainer"].update(backend="megatron", parallelism={"cp": 2}),
        "spec.trainer.parallelism: the megatron backend does not support context parallelism yet: cp"
        " must be 1",
    ),
    "tensor-parallel-on-the-torch-backend": (
        set_at("spec", "trainer", "parallelism", "tp", value=2),
        "spec.trainer.parallelism: the torch backend is data parallel (FSDP2): tp, pp, ep and cp must be 1"
        " (tensor, pipeline, expert and context parallelism need the megatron backend)",
    ),
    "model-path-on-s3": (
        set_at("spec", "model", "path", value="s3://models/Qwen3-8B"),
        "spec.model.path: must be a directory the trainer can read (a mounted volume) or tiny:<kind>: the"
        " trainer loads it with transformers from local files and downloads nothing (no s3://, hf:// or"
        " https:// URLs)",
    ),
    "weight-store-on-s3": (
        set_at("spec", "weights", "store", value="s3://bucket/run"),
        "spec.weights.store: must be an absolute path or a file:/// URL (the trainer and the engines share"
        " it as a volume mounted there: a relative path would name each container's own working"
        " directory); object stores such as s3:// have no storage backend yet",
    ),
    "gpu-budget-below-minimums": (
        set_at("spec", "autoscaling", "gpuBudget", value=2),
        "spec.autoscaling.gpuBudget: 2 GPUs cannot hold the pools' minimums: minReplicas x gpusPerReplica"
        " sum to 5",
    ),
    "toleration-exists-with-value": (
        pool(0, scheduling={"tolerations": [{"key": "dedicated", "value": "rl"}]}),
        f"{P0}.scheduling.tolerations[0].value: must be empty with operator Exists (use operator Equal to"
        " match a value)",
    ),
    # ---- counts of things
    "a-thousand-pools": (many_pools(1000), "spec.samplerPools: at most 32 entries, got 1000"),
    "thirty-three-pools": (many_pools(33), "spec.samplerPools: at most 32 entries, got 33"),
    "a-thousand-engine-args": (
        pool(0, engineArgs=["--x"] * 1000),
        f"{P0}.engineArgs: at most 256 entries, got 1000",
    ),
    # ---- Kubernetes names
    "namespace-not-a-dns-label": (
        set_at("metadata", "namespace", value="RL_Team"),
        "metadata.namespace: 'RL_Team' is not a DNS label (lowercase alphanumerics and '-', starting and"
        " ending alphanumeric)",
    ),
    "namespace-too-long": (
        set_at("metadata", "namespace", value="n" * 64),
        f"metadata.namespace: {'n' * 60!r}... (64 characters) is longer than 63 characters",
    ),
    "label-key-with-space": (
        set_at("metadata", "labels", value={"team name": "rl"}),
        f"metadata.labels: key 'team name': the name part must be {LABEL}",
    ),
    "label-key-bad-prefix": (
        set_at("metadata", "labels", value={"Example.COM/team": "rl"}),
        "metadata.labels: key 'Example.COM/team': the prefix before '/' must be a DNS subdomain"
        " (e.g. example.com/name)",
    ),
    "label-key-two-slashes": (
        set_at("metadata", "labels", value={"a/b/c": "rl"}),
        "metadata.labels: key 'a/b/c': the prefix before '/' must be a DNS subdomain (e.g. example.com/name)",
    ),
    "label-value-too-long": (
        set_at("metadata", "labels", value={"team": "v" * 64}),
        f"metadata.labels: value of 'team': {'v' * 60!r}... (64 characters) is not a label value ({LABEL}, or"
        " empty)",
    ),
    "annotation-key-empty-name": (
        set_at("metadata", "annotations", value={"example.com/": "x"}),
        "metadata.annotations: key 'example.com/': the name part is empty",
    ),
    "annotations-too-large": (
        set_at("metadata", "annotations", value={"note": "x" * (256 * 1024)}),
        "metadata.annotations: 262148 bytes in all, more than Kubernetes' 262144",
    ),
    "node-selector-key": (
        pool(0, scheduling={"nodeSelector": {"-zone": "a"}}),
        f"{P0}.scheduling.nodeSelector: key '-zone': the name part must be {LABEL}",
    ),
    "node-selector-value": (
        pool(0, scheduling={"nodeSelector": {"zone": "eu west"}}),
        f"{P0}.scheduling.nodeSelector.zone: 'eu west' is not a label value ({LABEL}, or empty)",
    ),
    "node-selector-key-with-newline": (  # the path stays one line
        pool(0, scheduling={"nodeSelector": {"a\nb": "x y"}}),
        f"{P0}.scheduling.nodeSelector['a\\nb']: 'x y' is not a label value ({LABEL}, or empty)",
    ),
    "gpu-product-with-space": (
        pool(0, scheduling={"gpuProducts": ["NVIDIA B200"]}),
        f"{P0}.scheduling.gpuProducts[0]: 'NVIDIA B200' is not a label value ({LABEL}, or empty)",
    ),
    "priority-class-uppercase": (
        pool(0, scheduling={"priorityClassName": "High"}),
        f"{P0}.scheduling.priorityClassName: 'High' is not a DNS subdomain (lowercase alphanumerics, '-' and '.')",
    ),
    "toleration-key": (
        pool(0, scheduling={"tolerations": [{"key": "bad key"}]}),
        f"{P0}.scheduling.tolerations[0].key: 'bad key': the name part must be {LABEL}",
    ),
    "image-with-space": (
        pool(0, image="sglang latest"),
        f"{P0}.image: 'sglang latest' is not an image reference (1 to 512 characters, no whitespace)",
    ),
    # ---- shapes and sizes of what was pasted
    "kind-a-list": (set_at("kind", value=["RLRun"]), "kind: expected one of RLRun, SamplerPool, got a list"),
    "api-version-null": (
        set_at("apiVersion", value=None),
        "apiVersion: expected mixrl.dev/v1alpha1, got null",
    ),
    "a-kubectl-list": (
        lambda doc: doc.update(apiVersion="v1", kind="List", items=[]),
        "kind: List: a list of objects (as kubectl get -o yaml prints) is not read; give one RLRun or"
        " SamplerPool per YAML document (separated by ---)",
    ),
    "no-pools": (set_at("spec", "samplerPools", value=[]), "spec.samplerPools: at least 1 entry, got 0"),
    "no-tools": (set_at("spec", "rollout", "tools", value=[]), "spec.rollout.tools: at least 1 entry, got 0"),
    "api-version-a-mapping": (
        set_at("apiVersion", value={"v": 1}),
        "apiVersion: expected mixrl.dev/v1alpha1, got a mapping",
    ),
    "unknown-gpu-a-megabyte": (
        pool(0, gpuType="X" * 2**20),
        f"{P0}.gpuType: unknown GPU type {'X' * 60!r}... (1048576 characters); known: A100, H100, H200,"
        " B200, B300, RTX-PRO-6000, cpu",
    ),
    "unknown-field-a-kilobyte": (
        set_at("spec", "x" * 1000, value=1),
        f"spec[{'x' * 60!r}... (1000 characters)]: unknown field (check the spelling; unknown fields are rejected)",
    ),
    # an unknown key that looks like one of pydantic's own location segments is still named
    "unknown-field-a-bracket": (
        set_at("[", value=0),
        "['[']: unknown field (check the spelling; unknown fields are rejected)",
    ),
    "unknown-field-like-a-validator": (
        set_at("spec", "trainer", "function-after[x]", value=0),
        "spec.trainer['function-after[x]']: unknown field (check the spelling; unknown fields are rejected)",
    ),
    "integer-key": (set_at("spec", "trainer", 7, value=1), "spec.trainer[7]: keys must be strings"),
    "model-a-list": (
        set_at("spec", "model", value=["tiny:qwen3"]),
        "spec.model: expected a mapping, got a list",
    ),
    "model-path-empty": (
        set_at("spec", "model", "path", value=""),
        "spec.model.path: String should have at least 1 character",
    ),
}


def broken(name: str) -> Doc:
    doc = copy.deepcopy(EXAMPLE)
    CASES[name][0](doc)
    return doc


@pytest.mark.parametrize("name", list(CASES))
def test_each_bad_document_gives_its_one_line(name: str) -> None:
    with pytest.raises(InvalidSpec) as info:
        parse_document(broken(name))
    assert [str(p) for p in info.value.problems] == [CASES[name][1]]


def test_the_command_prints_the_same_lines(tmp_path: Path) -> None:
    # One real `mixrl validate` over every case, written as YAML (the float cases as .inf/.nan, as a
    # user would write them): one line per document, the same as above.
    names = [n for n in CASES if n != "unknown-gpu-a-megabyte"]  # a file over the loader's 1 MiB
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all([broken(n) for n in names], sort_keys=False, width=2**20))
    done = subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "validate", "-q", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 1 and done.stderr == ""
    expected = [f"{path}{f'#{i}' if i else ''}: {CASES[n][1]}" for i, n in enumerate(names)]
    assert done.stdout.splitlines() == expected


@pytest.mark.parametrize(
    ("text", "line"),
    [
        # YAML 1.1 would read these exponent floats as strings; Kubernetes reads numbers
        ("spec: {trainer: {optimizer: {lr: 1e-6}}}", None),
        ("spec: {samplerPools: [{maxReplicas: 1e20}]}", f"{P0}.maxReplicas: expected an integer, got 1e+20"),
        ("spec: {samplerPools: [{capacity: .inf}]}", f"{P0}.capacity: must be a finite number, got inf"),
        ("spec: {samplerPools: [{capacity: .NaN}]}", f"{P0}.capacity: must be a finite number, got nan"),
        ("spec: {trainer: {gpusPerNode: yes}}", "spec.trainer.gpusPerNode: expected an integer, got true"),
        ("spec: {weights: {volumeSize: 1e3}}", "spec.weights.volumeSize: expected a string, got 1000.0"),
        # YAML 1.1 would read 1:30 as 90 (base 60); Kubernetes reads a string
        (
            "spec: {rollout: {maxTurns: 1:30}}",
            "spec.rollout.maxTurns: expected an integer, got the string '1:30'",
        ),
    ],
)
def test_yaml_scalars_as_kubernetes_reads_them(text: str, line: str | None) -> None:
    """Fields set from YAML text (the values above are built in Python): the merge of a YAML snippet
    into the example keeps every other field valid."""
    [document] = parse_yaml(text, "snippet.yaml")
    doc = copy.deepcopy(EXAMPLE)
    _merge(doc, document.data)
    if line is None:
        run = parse_document(doc)
        assert isinstance(run, models.RLRun) and run.spec.trainer.optimizer.lr == 1e-6
        return
    with pytest.raises(InvalidSpec) as info:
        parse_document(doc)
    assert [str(p) for p in info.value.problems] == [line]


def _merge(into: Any, patch: Any) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            for index, item in enumerate(value):
                _merge(into[key][index], item)
        else:
            into[key] = value


# ----------------------------------------------------------------------------- every number is bounded

SPEC_MODELS = [
    m
    for m in vars(models).values()
    if isinstance(m, type) and issubclass(m, models.Model) and m is not models.Model
    and not m.__name__.endswith(("Status", "Summary"))
    and m.__name__ not in {"Condition", "ScaleDecision", "ConcurrencyRecommendation"}  # written by the operator
]  # fmt: skip


def _scalars(annotation: Any) -> list[tuple[Any, list[Any]]]:
    """(type, metadata) of each scalar inside an annotation (through Optional, list, tuple, dict)."""
    if typing.get_origin(annotation) is typing.Annotated:
        inner, *metadata = typing.get_args(annotation)
        return [(t, [*metadata, *m]) for t, m in _scalars(inner)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return []
    args = typing.get_args(annotation)
    if args:
        return [s for arg in args if arg is not type(None) and arg is not Ellipsis for s in _scalars(arg)]
    return [(annotation, [])]


@pytest.mark.parametrize("model", SPEC_MODELS, ids=[m.__name__ for m in SPEC_MODELS])
def test_every_number_is_strict_and_bounded(model: type[BaseModel]) -> None:
    schema = model.model_json_schema(by_alias=False)
    for name, info in model.model_fields.items():
        for kind, metadata in _scalars(info.rebuild_annotation()):
            if kind not in (int, float, bool):
                continue
            assert any(getattr(m, "strict", False) for m in metadata), f"{model.__name__}.{name}: not strict"
            if kind is int:
                node = schema["properties"][name]
                node = node.get("items", next((o for o in node.get("anyOf", []) if o.get("type")), node))
                assert node.get("maximum", 2**31) <= 2**31 - 1, f"{model.__name__}.{name}: no int32 bound"
    assert model.model_config.get("allow_inf_nan") is False
