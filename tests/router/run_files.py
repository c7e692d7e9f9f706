"""The router's two inputs as files: a resolved run (``--config``) and its replicas (``--replicas``)."""

from __future__ import annotations

import json
from pathlib import Path

from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import resolve


def write_run(
    directory: Path, pools: dict[str, list[str]], run: str = "r", capacity: float | None = 1.0
) -> tuple[Path, Path]:
    """A CPU run named ``run`` with one bf16 torch pool per name of ``pools`` (capacity ``capacity``),
    written as ``run.json``, and ``replicas.json`` listing each pool's replica URLs."""
    manifest = {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": run},
        "spec": {
            "model": {"path": "/models/tiny"},
            "trainer": {"gpuType": "cpu", "gpusPerNode": 0},
            "samplerPools": [
                {
                    "name": name,
                    "gpuType": "cpu",
                    "engine": "torch",
                    "weightPrecision": "bf16",
                    "gpusPerReplica": 0,
                    "capacity": capacity,
                }
                for name in pools
            ],
        },
    }
    parsed = parse_document(manifest)
    assert isinstance(parsed, RLRun)
    config, replicas = directory / "run.json", directory / "replicas.json"
    config.write_text(resolve(parsed).model_dump_json())
    replicas.write_text(json.dumps(pools))
    return config, replicas
