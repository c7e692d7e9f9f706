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
