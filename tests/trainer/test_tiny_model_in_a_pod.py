"""A ``tiny:`` model in the trainer's pod: its ``model-init`` container builds it as ``mixrl run`` does,
and the trainer publishes it as version 0, the same weights ``mixrl run`` publishes for the same spec.

Real: the trainer StatefulSet the operator builds for examples/quickstart.yaml, its init container's
and its trainer's command lines and environment run as processes (the pod's paths moved under
tmp_path), with no network (every HTTP proxy points at a closed port), and ``mixrl run``'s own
preparation.  Before the fix the trainer handed ``tiny:qwen3`` to transformers as a repository id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mixrl.api.loader import load_rlrun
from mixrl.api.pod_dirs import AUTH_DIR, CACHE_DIR, TRAINER_RUN_DIR
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.local.prepare import prepare_model
from mixrl.operator.builders.objects import BuildOptions, Owner
from mixrl.operator.builders.podspec import AUTH_TOKEN_KEY, CONFIG_PATH, TINY_MODEL_PATH
from mixrl.operator.builders.resources import run_objects
from mixrl.rl.auth import AuthToken, write_token_file
from mixrl.rl.environments.registry import load_environment
from mixrl.rl.prepare_model import TOKENIZER_FILE
from mixrl.rl.rollout.chat_tokenizer import load_chat_tokenizer
from mixrl.rl.rollout.tokenizer import Tokenizer
from mixrl.rl.rollout.worker import tokenizer_location
from mixrl.rl.trainer import main as trainer_main
from mixrl.rl.weights import WeightStore

from ..api.conftest import ROOT

NO_NETWORK = {
    name: "http://127.0.0.1:9"  # the discard port: nothing listens, every request fails at once
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")
} | {"NO_PROXY": "", "no_proxy": ""}


def quickstart(store: Path) -> ResolvedRun:
    run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    return run.model_copy(update={"weights": run.weights.model_copy(update={"store": str(store)})})


def trainer_pod(resolved: ResolvedRun) -> dict[str, Any]:
    objects = run_objects(resolved, Owner("mixrl.dev/v1alpha1", "RLRun", resolved.name, "u"), BuildOptions())
    (trainer,) = (
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("-trainer")
    )
    spec: dict[str, Any] = trainer["spec"]["template"]["spec"]
    return spec


def here(value: str, moved: dict[str, Path]) -> str:
    for pod_path, local in moved.items():
        if value == pod_path or value.startswith(pod_path + "/"):
            return str(local) + value.removeprefix(pod_path)
    return value


def process(container: dict[str, Any], moved: dict[str, Path]) -> tuple[list[str], dict[str, str]]:
    """The container's command (``mixrl`` as this interpreter) and environment, the pod's paths moved."""
    command = [here(arg, moved) for arg in container["command"]]
    assert command[0] == "mixrl"
    env = {e["name"]: here(e["value"], moved) for e in container["env"] if "value" in e}
    return [sys.executable, "-m", "mixrl.cli", *command[1:]], {
        "PATH": os.environ["PATH"],
        **env,
        **NO_NETWORK,
    }


@pytest.mark.slow
def test_the_trainer_pod_publishes_the_tiny_model_mixrl_run_publishes(tmp_path: Path) -> None:
    pod_store, local_store = tmp_path / "pod" / "weights", tmp_path / "local" / "weights"
    resolved = quickstart(pod_store)
    moved = {
        CONFIG_PATH: tmp_path / "pod" / "run.json",
        AUTH_DIR: tmp_path / "pod" / "auth",
        TRAINER_RUN_DIR: tmp_path / "pod" / "trainer",
        CACHE_DIR: tmp_path / "pod" / "cache",
        "/tmp": tmp_path / "pod" / "home",
    }
    for pod_path, path in moved.items():
        (path.parent if pod_path == CONFIG_PATH else path).mkdir(parents=True, exist_ok=True)
    moved[CONFIG_PATH].write_text(resolved.model_dump_json(indent=2))
    write_token_file(moved[AUTH_DIR] / AUTH_TOKEN_KEY, AuthToken("t" * 32))
    spec = trainer_pod(resolved)
    (model_init,) = spec["initContainers"]
    (trainer,) = spec["containers"]
    assert model_init["name"] == "model-init" and model_init["image"] == trainer["image"]

    command, env = process(model_init, moved)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "warm start done" in done.stdout

    # The trainer as its container starts it: it publishes version 0 before it asks the buffer
    # (unreachable here) for step 1, then it is stopped as the kubelet stops it.
    command, env = process(trainer, moved)
    started = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    store = WeightStore(str(pod_store))
    try:
        deadline = time.monotonic() + 300
        while not store.versions() and started.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        started.terminate()
        output, _ = started.communicate(timeout=60)
    assert store.versions() == [0], output[-4000:]

    # The rollout worker's pod names no tokenizer, so it builds the word tokenizer the model was built with.
    rollout = next(
        o
        for o in run_objects(resolved, Owner("v1", "RLRun", resolved.name, "u"), BuildOptions())
        if o["metadata"]["name"] == "quickstart-rollout"
    )["spec"]["template"]["spec"]["containers"][0]
    assert "--tokenizer" not in rollout["command"]
    environment = load_environment(resolved.rollout.environment, resolved.rollout.environment_args)
    words = load_chat_tokenizer(
        tokenizer_location(resolved, None), None, environment.vocabulary(), "filetree"
    )
    assert isinstance(words, Tokenizer)
    model_dir = Path(here(TINY_MODEL_PATH, moved))
    assert words.to_json() == Tokenizer.load(model_dir / TOKENIZER_FILE).to_json()

    local = prepare_model(quickstart(local_store), tmp_path / "local" / "cache", tmp_path / "local")
    assert local.tokenizer_path == str(Path(local.model_path) / TOKENIZER_FILE)
    assert (Path(local.model_path) / "model.safetensors").read_bytes() == (
        model_dir / "model.safetensors"
    ).read_bytes()
    assert local.initial_version == 0
    published, expected = store.load(0), WeightStore(str(local_store)).load(0)
    assert published.keys() == expected.keys()
    assert all(torch.equal(published[name], expected[name]) for name in expected)

    def config(version_dir: str) -> dict[str, Any]:  # the path it was loaded from aside
        loaded: dict[str, Any] = json.loads((Path(version_dir) / "config.json").read_text())
        return {key: value for key, value in loaded.items() if key != "_name_or_path"}

    assert config(store.path(0)) == config(local.initial_version_path)


def test_the_trainer_refuses_a_tiny_path_instead_of_asking_hugging_face(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.json"
    config.write_text(quickstart(tmp_path / "weights").model_dump_json())
    argv = ["--config", str(config), "--buffer", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "run")]
    assert trainer_main.main([*argv, "--insecure-no-auth"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("mixrl trainer: --model-path: tiny:qwen3 is built, not loaded"), line
    assert "\n" not in line and "mixrl prepare-model" in line
    assert not (tmp_path / "weights").exists()


def test_a_coding_runs_model_init_needs_no_sandbox(tmp_path: Path) -> None:
    """A trainer pod cannot build a bubblewrap sandbox (no user namespaces for uid 1000), and
    model-init only reads the environment's vocabulary: it must not try (it crash-looped so)."""
    import yaml

    from mixrl.api.models import RLRun
    from mixrl.api.resolve import resolve
    from mixrl.rl.prepare_model import word_tokenizer

    manifest = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "examples" / "rlrun-coding.yaml").read_text()
    )
    manifest["spec"]["rollout"]["environmentArgs"]["bwrap"] = str(tmp_path / "no-bwrap-here")
    tokenizer = word_tokenizer(resolve(RLRun.model_validate(manifest)))
    assert tokenizer.vocab_size > 100
