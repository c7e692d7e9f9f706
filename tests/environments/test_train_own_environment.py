"""A user trains on an environment of their own with ``mixrl run``, without touching mixrl: the
package lives in tmp_path, reaches the spawned components through PYTHONPATH, and its tasks come
from JSONL files.  Every component is a real local process (as in tests/local)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mixrl.local.report import read_jsonl
from mixrl.rl.rollout.tokenizer import Tokenizer

from .conftest import USER_ENVIRONMENT, write_user_package, write_words

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TRAIN_WORDS = ["apple", "pear", "plum", "fig", "lime", "kiwi"]


def test_mixrl_run_trains_a_users_environment(tmp_path: Path) -> None:
    site = write_user_package(tmp_path / "site")
    train = write_words(tmp_path / "train.jsonl", TRAIN_WORDS)
    heldout = write_words(tmp_path / "heldout.jsonl", ["fig", "kiwi"])
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = "own-env"
    spec = doc["spec"]
    spec["samplerPools"] = [p for p in spec["samplerPools"] if p["name"] == "bf16"]
    spec["trainer"].update({"totalSteps": 2, "checkpointEvery": 1})
    # the vocabulary has 19 tokens: fewer candidates than the quickstart's 32
    spec["algorithm"].update(
        {"promptsPerUpdate": 2, "samplesPerPrompt": 4, "topCandidates": 8, "topP": {"p": 0.95, "k": 8}}
    )
    spec["rollout"] = {
        "environment": USER_ENVIRONMENT,
        "environmentArgs": {"prefix": "say"},
        "dataset": {"train": str(train), "heldout": str(heldout), "trainSize": 4},
        "maxTurns": 3,
        "maxObservationTokens": 8,
        "concurrency": 8,
    }
    spec["evaluation"] = {"everySteps": 2, "passK": [1], "samplesPerTask": 2}
    path = tmp_path / "own-env.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "run", str(path), "--run-dir", str(run_dir),
         "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=900, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no warm start: my_envs.echo:EchoEnv has no demonstrations" in result.stdout

    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    rollout_log = (run_dir / "logs" / "rollout.log").read_text()
    assert f"environment {USER_ENVIRONMENT}" in rollout_log
    trajectories = read_jsonl(run_dir / "buffer" / "trajectories.jsonl")
    # training groups come from the first trainSize rows of the train file, and only from them
    assert {t["prompt_id"].split("/")[0] for t in trajectories} <= {"w0", "w1", "w2", "w3"}
    assert {t["finish_reason"] for t in trajectories} <= {
        "said",
        "format_errors",
        "max_turns",
        "context_limit",
    }
    # the tiny model speaks the word tokenizer over the environment's vocabulary
    (saved,) = (tmp_path / "cache" / "models").glob("*/tokenizer.json")
    words = ("say", "say", "look", "a", "word", *TRAIN_WORDS)
    assert Tokenizer.load(saved) == Tokenizer.from_words(words)
    assert all(max(t["tokens"], default=0) < Tokenizer.from_words(words).vocab_size for t in trajectories)
    evaluations = read_jsonl(run_dir / "evaluations.jsonl")
    assert [e["step"] for e in evaluations] == [0, 2]
    assert all(e["tasks"] == 2 and e["episodes"] == 4 for e in evaluations)
