"""``mixrl prepare-model``: the model a ``tiny:<kind>`` run starts from, built from a config, cached.

``model.path: tiny:<kind>`` builds a tiny ``transformers`` model locally (nothing is downloaded),
with mixrl's word tokenizer over the environment's vocabulary, and, for the built-in filetree
environment, runs the warm start (:mod:`mixrl.rl.rollout.demos`): a short supervised phase on
generated demonstrations that stops at a moderate success rate, so RL starts neither near 0 nor
near 1.  Other environments have no demonstrations: their tiny model starts from its random
initialization.  The result is cached under ``<cache>/models/`` by a hash of everything that
determines it, so later runs skip it.

One function, :func:`prepare_tiny_model`, for both places a run starts: ``mixrl run`` calls it
before it publishes version 0 (:mod:`mixrl.local.prepare`), and in a cluster the trainer pod's
``model-init`` init container runs this command (the launch table, :mod:`mixrl.api.launch`), which
points ``--output`` at the prepared directory; the trainer loads it from there and publishes it as
version 0, as it publishes a real ``model.path``.  The same run spec gives the same weights in
both, so a cluster run and a laptop run start alike.  (It is a command of its own, not the
trainer's: the warm start runs the rollout's agent loop, which the trainer must not import.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from mixrl.api.loader import RunConfigError, component_parser, load_resolved
from mixrl.api.models import tiny_kind
from mixrl.api.resolve import ResolvedRun, SamplingParams
from mixrl.rl.environments.filetree import Difficulty
from mixrl.rl.environments.registry import load_environment
from mixrl.rl.rollout.demos import WarmStartRecipe, warm_start_recipe
from mixrl.rl.rollout.tokenizer import Tokenizer
from mixrl.rl.sandbox.backend import NoCommands, use_sandbox
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model

TOKENIZER_FILE = "tokenizer.json"
RECIPE_VERSION = 1
"""Bump when the recipe below changes in a way the cache key does not see."""

# The tiny model.  Sized so that 4 engines, the trainer and the rollout share two CPU cores and the
# quickstart finishes in minutes.  The warm start is the rollout package's tuned recipe.
TINY_ARCHITECTURE: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
MODEL_SEED = 0

Say = Callable[[str], None]


def tiny_recipe(run: ResolvedRun, kind: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """Everything that determines a tiny model's weights (its cache key)."""
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


def build_tiny_model(run: ResolvedRun, kind: str, tokenizer: Tokenizer, out: Path, say: Say) -> None:
    """Create, warm-start and save a tiny model into ``out`` (which must not exist yet)."""
    tmp = out.with_name(out.name + f".tmp-{time.time_ns()}")
    create_tiny_checkpoint(tmp, kind, vocab_size=tokenizer.vocab_size, seed=MODEL_SEED, **TINY_ARCHITECTURE)
    if run.rollout.environment != "filetree":
        say(f"no warm start: {run.rollout.environment} has no demonstrations; RL starts from random weights")
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
    say(f"warm start of a tiny {kind} model (cached after this run)")
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
            progress=say,
        )
    torch.set_num_threads(threads)
    say(f"warm start done: {report.steps} steps in {report.seconds:.0f}s, probe success {report.success:.2f}")
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


def word_tokenizer(run: ResolvedRun) -> Tokenizer:
    """A tiny model's tokenizer: mixrl's word tokenizer over the environment's vocabulary (the one
    the rollout worker builds for a ``tiny:`` model: mixrl.rl.rollout.chat_tokenizer)."""
    # Only the vocabulary is read here: no episode, so no sandbox (a trainer pod cannot build one).
    previous = use_sandbox(lambda _config: NoCommands("mixrl prepare-model"))
    try:
        words = load_environment(run.rollout.environment, run.rollout.environment_args).vocabulary()
    finally:
        use_sandbox(previous)
    if words is None:
        raise ValueError(
            f"model.path: {run.model.path} uses mixrl's word tokenizer, but {run.rollout.environment} has "
            "no vocabulary(); use a real model directory with its tokenizer"
        )
    return Tokenizer.from_words(words)


def prepare_tiny_model(run: ResolvedRun, cache: Path, say: Say) -> Path:
    """The directory of the run's ``tiny:<kind>`` model (its weights and ``tokenizer.json``): built
    into ``<cache>/models/<kind>-<hash>`` the first time, found there afterwards."""
    kind = tiny_kind(run.model.path)
    if kind is None:
        raise ValueError(f"model.path: {run.model.path} is not a tiny:<kind> model")
    hf_logging.disable_progress_bar()  # our own progress lines say what is happening
    tokenizer = word_tokenizer(run)
    key = hashlib.sha256(json.dumps(tiny_recipe(run, kind, tokenizer), sort_keys=True).encode()).hexdigest()
    model_dir = cache / "models" / f"{kind}-{key[:16]}"
    if (model_dir / "config.json").exists():
        say(f"using the cached warm-started model {model_dir}")
    else:
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        build_tiny_model(run, kind, tokenizer, model_dir, say)
    return model_dir


def point_at(link: Path, target: Path) -> None:
    """Make ``link`` a symlink to ``target`` (relative where it can be, so the volume may be mounted
    anywhere), replacing an older one in one rename: a reader sees the old target or the new one."""
    link.parent.mkdir(parents=True, exist_ok=True)
    try:
        destination = os.path.relpath(target, link.parent)
    except ValueError:  # another drive (Windows)
        destination = str(target)
    tmp = link.with_name(f"{link.name}.tmp-{time.time_ns()}")
    tmp.symlink_to(destination, target_is_directory=True)
    tmp.replace(link)


def main(argv: list[str]) -> int:
    parser = component_parser("mixrl prepare-model", __doc__)
    parser.add_argument("--cache", required=True, help="directory of prepared models (models/<kind>-<hash>)")
    parser.add_argument(
        "--output", required=True, help="made a symlink to the prepared model: the trainer's --model-path"
    )
    args = parser.parse_args(argv)

    def say(message: str) -> None:
        print(f"mixrl prepare-model: {message}", flush=True)

    try:
        run = load_resolved(args.config)
        model_dir = prepare_tiny_model(run, Path(args.cache), say)
    except (RunConfigError, ValueError) as exc:  # a RunConfigError is a ValueError: one line
        print(f"mixrl prepare-model: {exc}", file=sys.stderr)
        return 2
    point_at(Path(args.output), model_dir)
    say(f"{args.output} -> {model_dir}")
    return 0
