"""API tests: the pydantic models, validation messages, CRD generation and `mixrl validate`.

Everything here is real: the models, the generated CRD files, the example manifests in examples/,
the `mixrl` command run as a subprocess. No stand-ins. The CRD schemas are checked with jsonschema
after a faithful translation of OpenAPI v3.0 (nullable, boolean exclusiveMinimum) to JSON Schema;
no Kubernetes API server can run here, so structural rules are checked by walking the schema.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def set_at(*path: str | int, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change to a document: set one field, creating the mappings on its path."""

    def mutate(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
        node[path[-1]] = value

    return mutate


def sampler_pool(**spec: Any) -> dict[str, Any]:
    """A valid SamplerPool of examples/rlrun-mixed.yaml's run (its H100 FP8 pool), with ``spec``'s
    fields set over its own."""
    return {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "SamplerPool",
        "metadata": {"name": "qwen3-moe-coding-h100-fp8"},
        "spec": {
            "run": "qwen3-moe-coding",
            "pool": "h100-fp8",
            "gpuType": "H100",
            "weightPrecision": "fp8",
            "kvCacheDtype": "fp8",
            "engine": "sglang",
            "replicas": 1,
            **spec,
        },
    }


@pytest.fixture
def minimal_run() -> dict[str, Any]:
    return copy.deepcopy(
        {
            "apiVersion": "mixrl.dev/v1alpha1",
            "kind": "RLRun",
            "metadata": {"name": "demo"},
            "spec": {
                "model": {"path": "tiny:qwen3"},
                "samplerPools": [{"name": "b200", "gpuType": "B200", "weightPrecision": "nvfp4"}],
            },
        }
    )
