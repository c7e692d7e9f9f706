"""API tests: the pydantic models, validation messages, CRD generation and `mixrl validate`.

Everything here is real: the models, the generated CRD files, the example manifests in examples/,
the `mixrl` command run as a subprocess. No stand-ins. The CRD schemas are checked with jsonschema
after a faithful translation of OpenAPI v3.0 (nullable, boolean exclusiveMinimum) to JSON Schema;
no Kubernetes API server can run here, so structural rules are checked by walking the schema.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def openapi_to_jsonschema(node: Any) -> Any:
    """OpenAPI v3.0 (what Kubernetes uses) -> JSON Schema draft 2020-12, for jsonschema."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: openapi_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if out.get(bound) is True:
            out[bound] = out.pop(plain)
    if out.pop("nullable", False):
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out
