"""What a run's pods request, derived from the run: GPUs only on GPU types, CPUs and memory that let a
CPU-only run fit a small node, volumes from the model's size, explicit values first.

Real: the example manifests, resolved and built by the operator's pure builders (every object the
run's controller and its pools' controllers write).  Before this, examples/quickstart.yaml asked for
four ``nvidia.com/gpu`` (``gpusPerReplica`` defaulted to 1 on ``gpuType: cpu``, so its engine pods
stayed Pending on CPU nodes), 8.9 CPUs and 25 GiB of requests, and 250 GiB of volumes.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from mixrl.api.gpus import GPU_RESOURCE
from mixrl.api.loader import load_rlrun, parse_document
from mixrl.api.models import RLRun
from mixrl.api.quantity import parse_quantity
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.operator.builders.objects import TINY_MODEL_PARAMETERS, BuildOptions, Owner
from mixrl.operator.builders.pools import pool_children
from mixrl.operator.builders.resources import run_objects, seed_replicas

ROOT = Path(__file__).resolve().parents[2]
Obj = dict[str, Any]


def manifest(name: str) -> Obj:
    return load_rlrun(ROOT / "examples" / f"{name}.yaml").model_dump(
        by_alias=True, exclude_none=True, mode="json"
    )


def resolved_of(doc: Obj) -> ResolvedRun:
    run = parse_document(copy.deepcopy(doc))
    assert isinstance(run, RLRun)
    return resolve(run)


def built(resolved: ResolvedRun, options: BuildOptions | None = None) -> list[Obj]:
    """Every object of the run, as its controller and each pool's controller build them."""
    options = options or BuildOptions()
    objects = run_objects(resolved, Owner("mixrl.dev/v1alpha1", "RLRun", resolved.name, "u"), options)
    for pool in resolved.pools:
        owner = Owner("mixrl.dev/v1alpha1", "SamplerPool", pool.object_name, "p")
        objects += pool_children(resolved, pool, seed_replicas(pool), owner, options)
    return objects


def containers(objects: list[Obj]) -> dict[str, Obj]:
    """``<workload>/<container>`` -> its resources, init containers included."""
    out = {}
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            spec = obj["spec"]["template"]["spec"]
            for container in [*spec.get("initContainers", []), *spec["containers"]]:
                out[f"{obj['metadata']['name']}/{container['name']}"] = container["resources"]
    return out


def volumes(objects: list[Obj]) -> dict[str, str]:
    """Every claim the run makes (its PVCs and its StatefulSets' claim templates) -> its size."""
    out = {}
    for obj in objects:
        if obj["kind"] == "PersistentVolumeClaim":
            out[obj["metadata"]["name"]] = obj["spec"]["resources"]["requests"]["storage"]
        for claim in obj.get("spec", {}).get("volumeClaimTemplates", []):
            out[f"{obj['metadata']['name']}/{claim['metadata']['name']}"] = claim["spec"]["resources"][
                "requests"
            ]["storage"]
    return out


def requested(objects: list[Obj], resource: str) -> float:
    """The scheduler's sum of ``resource`` requests over all the run's pods: per pod the larger of
    its containers' sum and its largest init container, times the replicas."""
    total = 0.0
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = obj["spec"]["template"]["spec"]

        def request(container: Obj) -> float:
            return float(parse_quantity(container["resources"]["requests"][resource]))

        main = sum(request(c) for c in spec["containers"])
        init = max((request(c) for c in spec.get("initContainers", [])), default=0.0)
        total += obj["spec"]["replicas"] * max(main, init)
    return total


CPU_RUNS = ("quickstart", "ablation-fp4", "rlrun-coding")


@pytest.mark.parametrize("name", CPU_RUNS)
def test_cpu_runs_ask_for_no_gpu(name: str) -> None:
    for where, resources in containers(built(resolved_of(manifest(name)))).items():
        assert GPU_RESOURCE not in resources["limits"] and GPU_RESOURCE not in resources["requests"], where


def test_cpu_types_ask_for_no_gpu_whatever_the_count_says() -> None:
    """``gpusPerNode`` counts trainer processes on ``gpuType: cpu``; an explicit ``gpusPerReplica``
    on a cpu pool has no GPU to ask for either."""
    doc = manifest("quickstart")
    doc["spec"]["trainer"]["gpusPerNode"] = 2
    for pool in doc["spec"]["samplerPools"]:
        pool["gpusPerReplica"] = 1
    resolved = resolved_of(doc)
    objects = built(resolved)
    for where, resources in containers(objects).items():
        assert GPU_RESOURCE not in resources["limits"], where
    trainer = next(
        o for o in objects if o["metadata"]["name"] == "quickstart-trainer" and o["kind"] == "StatefulSet"
    )
    spec = trainer["spec"]["template"]["spec"]
    assert "affinity" not in spec and "tolerations" not in spec  # schedules on any node
    assert spec["containers"][0]["resources"]["requests"]["cpu"] == "1"  # half a core per process


def test_the_quickstart_fits_a_two_core_node() -> None:
    objects = built(resolved_of(manifest("quickstart")))
    assert requested(objects, "cpu") <= 2.0
    assert requested(objects, "memory") <= 5 * 2**30
    assert volumes(objects) == {
        "quickstart-weights": "1Gi",  # a tiny model: its 4 + 2 versions are a few MiB
        "quickstart-trainer/run": "1Gi",
        "quickstart-buffer/data": "3Gi",  # 102 steps x 128 trajectories of at most 256 tokens
    }


def test_a_tiny_model_is_within_the_bound_the_sizes_assume() -> None:
    from transformers import AutoModelForCausalLM

    from mixrl.rl.environments.registry import load_environment
    from mixrl.rl.prepare_model import TINY_ARCHITECTURE
    from mixrl.rl.rollout.tokenizer import Tokenizer
    from mixrl.rl.tiny_models import MODEL_KINDS, tiny_config

    for environment in ("filetree", "coding-plain"):
        words = load_environment(environment, {}).vocabulary()
        assert words is not None
        vocab = Tokenizer.from_words(words).vocab_size
        for kind in MODEL_KINDS:
            model = AutoModelForCausalLM.from_config(tiny_config(kind, vocab, **TINY_ARCHITECTURE))
            parameters = sum(p.numel() for p in model.parameters())
            assert parameters <= TINY_MODEL_PARAMETERS / 4, (environment, kind, parameters)


MINIMAL = {
    "qwen3-small-buffer/buffer": {
        "limits": {"cpu": "2", "memory": "8Gi"},
        "requests": {"cpu": "1", "memory": "2Gi"},
    },
    "qwen3-small-h100-bf16/engine": {
        "limits": {"cpu": "8", "memory": "32Gi", GPU_RESOURCE: "1"},
        "requests": {"cpu": "4", "memory": "16Gi"},
    },
    "qwen3-small-h100-bf16/weight-sync": {
        "limits": {"cpu": "2", "memory": "4Gi"},
        "requests": {"cpu": "500m", "memory": "4Gi"},
    },
    "qwen3-small-h100-bf16/weights-init": {
        "limits": {"cpu": "2", "memory": "4Gi"},
        "requests": {"cpu": "500m", "memory": "4Gi"},
    },
    "qwen3-small-rollout/rollout": {
        "limits": {"cpu": "4", "memory": "8Gi"},
        "requests": {"cpu": "1", "memory": "2Gi"},
    },
    "qwen3-small-router/router": {
        "limits": {"cpu": "2", "memory": "2Gi"},
        "requests": {"cpu": "500m", "memory": "1Gi"},
    },
    "qwen3-small-trainer/trainer": {
        "limits": {"cpu": "8", "memory": "32Gi", GPU_RESOURCE: "1"},
        "requests": {"cpu": "4", "memory": "32Gi"},
    },
}
"""examples/rlrun-minimal.yaml's containers as the builders sized them before the sizes were derived."""


def test_a_gpu_example_keeps_its_sizes() -> None:
    objects = built(resolved_of(manifest("rlrun-minimal")))
    assert containers(objects) == MINIMAL
    # its explicit weights.volumeSize for both of its volumes; the buffer's from its 20 steps
    assert volumes(objects) == {
        "qwen3-small-weights": "20Gi",
        "qwen3-small-trainer/run": "20Gi",
        "qwen3-small-buffer/data": "5Gi",
    }


def test_gpu_pools_and_trainers_keep_per_gpu_sizes() -> None:
    doc = manifest("rlrun-mixed")
    for where, resources in containers(built(resolved_of(doc))).items():
        if where.endswith("/engine"):
            assert resources["requests"] == {"cpu": "4", "memory": "16Gi"}, where
        if where.endswith("/trainer"):
            assert resources["requests"] == {"cpu": "32", "memory": "256Gi"}, where
            assert resources["limits"][GPU_RESOURCE] == "8"


def test_volumes_follow_the_model_size() -> None:
    doc = manifest("rlrun-minimal")
    del doc["spec"]["weights"]["volumeSize"]
    # 0.6B parameters: (4 kept + 2) BF16 versions and the base model on the volume (/weights/base/...),
    # 7 x 2 x 0.6e9 bytes = 8.4e9, +25 %: 9.8 GiB
    assert volumes(built(resolved_of(doc)))["qwen3-small-weights"] == "10Gi"
    # the trainer's volume: two checkpoints of FP32 masters and AdamW's moments, 2 x 12 x 0.6e9, +25 %
    assert volumes(built(resolved_of(doc)))["qwen3-small-trainer/run"] == "17Gi"
    doc["spec"]["samplerPools"][0]["weightPrecision"] = "fp8"
    # each version also holds the pool's FP8 conversion: 6 x 3 + 2 bytes per parameter
    assert volumes(built(resolved_of(doc)))["qwen3-small-weights"] == "14Gi"
    del doc["spec"]["model"]["parametersBillions"]
    assert volumes(built(resolved_of(doc)))["qwen3-small-weights"] == "200Gi"  # a model of unknown size
    doc["spec"]["trainer"]["totalSteps"] = None
    assert volumes(built(resolved_of(doc)))["qwen3-small-buffer/data"] == "50Gi"  # an unbounded run


def test_explicit_sizes_win() -> None:
    doc = manifest("quickstart")
    doc["spec"]["weights"]["volumeSize"] = "7Gi"
    doc["spec"]["trainer"]["resources"] = {"cpu": "3", "memory": "5Gi"}
    objects = built(resolved_of(doc), BuildOptions(buffer_volume_size="9Gi"))
    assert volumes(objects) == {
        "quickstart-weights": "7Gi",
        "quickstart-trainer/run": "7Gi",
        "quickstart-buffer/data": "9Gi",
    }
    trainer = containers(objects)["quickstart-trainer/trainer"]
    assert trainer == {"requests": {"cpu": "3", "memory": "5Gi"}, "limits": {"cpu": "3", "memory": "5Gi"}}
    # its init container builds the tiny model with the trainer's CPU and memory
    assert containers(objects)["quickstart-trainer/model-init"] == trainer
