"""The model a local run starts from: a tiny model built from a config and warm-started, cached.

``model.path: tiny:<kind>`` builds a tiny ``transformers`` model locally (nothing is downloaded),
with mixrl's word tokenizer over the environment's vocabulary, and, for the built-in filetree
environment, runs the warm start: a short supervised phase on generated demonstrations that stops
at a moderate success rate, so RL starts neither near 0 nor near 1.  Other environments have no
demonstrations: their tiny model starts from its random initialization.  The result is cached under ``<cache>/models/`` by a hash of everything that determines
it, so later runs skip it.  Any other ``model.path`` is a local Hugging Face directory used as is.
The starting weights are then published as version 0 of the run's weight store (BF16, as the
trainer publishes every later version).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from mixrl.api.resolve import ResolvedRun, SamplingParams
from mixrl.local.demos import WarmStartRecipe, warm_start_recipe
from mixrl.rl.environments.filetree import Difficulty
from mixrl.rl.environments.registry import load_environment
from mixrl.rl.models import create_tiny_checkpoint, load_model
from mixrl.rl.rollout.tokenizer import Tokenizer
from mixrl.rl.weights import WeightStore, tokenizer_files

TINY_PREFIX = "tiny:"
TOKENIZER_FILE = "tokenizer.json"
RECIPE_VERSION = 1
"""Bump when the recipe below changes in a way the cache key does not see."""

# The tiny model.  Sized so that 4 engines, the trainer and the rollout share two CPU cores and the
# quickstart finishes in minutes.  The warm start is the rollout package's tuned recipe.
TINY_ARCHITECTURE: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
MODEL_SEED = 0


@dataclass(frozen=True)
class PreparedModel:
    model_path: str
    """Checkpoint the trainer starts from."""
    tokenizer_path: str
    initial_version: int
    initial_version_path: str
    """Weight-store directory the engines start from."""


def _say(message: str) -> None:
    print(f"mixrl run: {message}", flush=True)


def tiny_recipe(run: ResolvedRun, kind: str, tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        "recipe": RECIPE_VERSION,
        "kind": kind,
        "architecture": TINY_ARCHITECTURE,
        "warm_start": WarmStartRecipe().as_dict(),
        "tokenizer": hashlib.sha256(tokenizer.to_json().encode()).hexdigest(),
        "environment": run.rollout.environment,
        "environment_args": run.rollout.environment_args,
        "dataset_seed": run.rollout.dataset.seed,
        "temperature": run.sampling.temperature,
        "top_p": run.sampling.top_p,
        "top_k": run.sampling.top_k,
        "max_turns": run.rollout.max_turns,
    }


def build_tiny_model(run: ResolvedRun, kind: str, tokenizer: Tokenizer, out: Path) -> None:
    """Create, warm-start and save a tiny model into ``out`` (which must not exist yet)."""
    tmp = out.with_name(out.name + f".tmp-{time.time_ns()}")
    create_tiny_checkpoint(tmp, kind, vocab_size=tokenizer.vocab_size, seed=MODEL_SEED, **TINY_ARCHITECTURE)
    if run.rollout.environment != "filetree":
        _say(f"no warm start: {run.rollout.environment} has no demonstrations; RL starts from random weights")
        tokenizer.save(tmp / TOKENIZER_FILE)
        _publish_dir(tmp, out)
        return
    model = load_model(tmp)
    sampling = SamplingParams(
        temperature=run.sampling.temperature,
        top_p=run.sampling.top_p,
        top_k=run.sampling.top_k,
        max_new_tokens=run.sampling.max_new_tokens,
        top_logprobs_num=0,
        return_sampling_mask=False,
    )
    _say(f"warm start of a tiny {kind} model (cached after this run)")
    threads = torch.get_num_threads()
    # A tiny model gains nothing from intra-op threads, and OpenMP threads spinning on oversubscribed
    # cores (other runs, other jobs) can slow it down tenfold.
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        report = warm_start_recipe(
            model,
            tokenizer,
            run.rollout.dataset.seed,
            sampling,
            WarmStartRecipe(),
            difficulty=Difficulty(**run.rollout.environment_args),
            progress=_say,
        )
    torch.set_num_threads(threads)
    _say(
        f"warm start done: {report.steps} steps in {report.seconds:.0f}s, probe success {report.success:.2f}"
    )
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save(tmp / TOKENIZER_FILE)
    (tmp / "warm_start.json").write_text(
        json.dumps({"steps": report.steps, "seconds": report.seconds, "probes": report.probes}, indent=2)
    )
    _publish_dir(tmp, out)


def _publish_dir(tmp: Path, out: Path) -> None:
    try:
        tmp.rename(out)  # atomic: a concurrent or interrupted build never leaves a half-written cache entry
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise


def prepare_model(run: ResolvedRun, cache: Path, run_dir: Path) -> PreparedModel:
    hf_logging.disable_progress_bar()  # our own progress lines say what is happening
    path = run.model.path
    if path.startswith(TINY_PREFIX):
        kind = path.removeprefix(TINY_PREFIX)
        words = load_environment(run.rollout.environment, run.rollout.environment_args).vocabulary()
        if words is None:
            raise ValueError(
                f"model.path: {path} uses mixrl's word tokenizer, but {run.rollout.environment} has no "
                "vocabulary(); use a real model directory with its tokenizer"
            )
        tokenizer = Tokenizer.from_words(words)
        key = hashlib.sha256(
            json.dumps(tiny_recipe(run, kind, tokenizer), sort_keys=True).encode()
        ).hexdigest()
        model_dir = cache / "models" / f"{kind}-{key[:16]}"
        if (model_dir / "config.json").exists():
            _say(f"using the cached warm-started model {model_dir}")
        else:
            model_dir.parent.mkdir(parents=True, exist_ok=True)
            build_tiny_model(run, kind, tokenizer, model_dir)
        tokenizer_path = str(model_dir / TOKENIZER_FILE)
    else:
        model_dir = Path(path)
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(f"model.path: {path} is not a local model directory (no config.json)")
        # a Hugging Face tokenizer directory and its chat template (or model.chatTemplate)
        tokenizer_path = run.model.tokenizer or str(model_dir)

    store = WeightStore(run.weights.store)
    latest = store.latest()
    if latest is None:
        model = load_model(model_dir)
        state = {
            name: t.detach().to(torch.bfloat16).contiguous().clone() for name, t in model.state_dict().items()
        }
        files = tokenizer_files(tokenizer_path)  # none for tiny: models (the word tokenizer is mixrl's)
        store.publish(0, state, {"source": str(model_dir)}, model.config.to_dict(), files=files)
        latest = 0
    return PreparedModel(str(model_dir), tokenizer_path, latest, store.path(latest))
