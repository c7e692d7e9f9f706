"""`mixrl run` end to end: every component as a real local process on loopback.

Real: the buffer, torch engines at emulated precisions, the router, the rollout worker and the
trainer, each started by the runner exactly as `make run` starts them, with a tiny model built and
warm-started locally. Nothing is a stand-in here; what these tests cannot show (GPUs, SGLang,
Kubernetes) is covered by the operator and engine tests with their own stand-ins.

The warm-started model is cached in one directory per test session, so the warm start runs once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shared = os.environ.get("MIXRL_TEST_CACHE")
    return Path(shared) if shared else tmp_path_factory.mktemp("mixrl-cache")


def small_run(path: Path, name: str, steps: int, **algorithm: object) -> Path:
    """The quickstart, shrunk: two pools (nvfp4 with an FP8 KV cache, bf16), a few small steps."""
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["samplerPools"] = [p for p in spec["samplerPools"] if p["name"] in ("nvfp4", "bf16")]
    spec["trainer"]["totalSteps"] = steps
    spec["trainer"]["checkpointEvery"] = 1
    spec["algorithm"].update({"promptsPerUpdate": 4, "samplesPerPrompt": 4, **algorithm})
    spec["rollout"]["concurrency"] = 16
    spec["evaluation"] = {"everySteps": steps, "passK": [1], "samplesPerTask": 1, "tasks": 16}
    out = path / f"{name}.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out
