"""An environment's free-form arguments are refused, with one line naming the leaf, where the API
server could not store them (integers beyond 64 bits, non-finite numbers)."""

from __future__ import annotations

from typing import Any

import pytest

from mixrl.api.errors import InvalidSpec
from mixrl.api.loader import parse_document


def run_with(arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "coding"},
        "spec": {
            "model": {"path": "tiny:qwen3", "maxContextTokens": 512},
            "samplerPools": [
                {"name": "bf16", "gpuType": "cpu", "engine": "torch", "weightPrecision": "bf16"}
            ],
            "rollout": {"environment": "coding-plain", "environmentArgs": arguments},
        },
    }


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        ({"levels": [1, 2**63]}, "levels[1]: integer out of range (Kubernetes stores integers in 64 bits)"),
        ({"limits": {"cpu_s": -(2**63) - 1}}, "limits.cpu_s: integer out of range"),
        ({"limits": {"wall_s": float("inf")}}, "limits.wall_s: must be a finite number"),
        # a pasted key is cut, so the reason after it is still on the line
        (
            {"k" * 1000: [1, float("inf")]},
            "['" + "k" * 60 + "'... (1000 characters)][1]: must be a finite number",
        ),
    ],
)
def test_arguments_kubernetes_cannot_store_are_refused_by_leaf(arguments: dict[str, Any], line: str) -> None:
    with pytest.raises(InvalidSpec) as refused:
        parse_document(run_with(arguments))
    assert refused.value.first_line.startswith("spec.rollout.environmentArgs: ")
    assert line in refused.value.first_line


def test_ordinary_json_arguments_pass() -> None:
    arguments = {
        "levels": [1, 2, 2**63 - 1],
        "limits": {"wall_s": 5.0},
        "name": "x",
        "flag": True,
        "none": None,
    }
    run = parse_document(run_with(arguments))
    assert run.spec.rollout.environment_args == arguments
