"""The model a local run starts from, and its version 0.

``model.path: tiny:<kind>`` is built (and warm-started for filetree) by
:func:`mixrl.rl.prepare_model.prepare_tiny_model`, cached under ``<cache>/models/`` by a hash of
everything that determines it: the same function the trainer pod's ``model-init`` container runs,
so a cluster run of the same spec starts from the same weights.  Any other ``model.path`` is a
local Hugging Face directory used as is.  The starting weights are then published as version 0 of
the run's weight store (BF16, as the trainer publishes every later version).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from mixrl.api.models import tiny_kind
from mixrl.api.resolve import ResolvedRun
from mixrl.rl.prepare_model import TOKENIZER_FILE, prepare_tiny_model
from mixrl.rl.tiny_models import load_model
from mixrl.rl.weights import DELTA, WeightStore, tokenizer_files


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


def prepare_model(run: ResolvedRun, cache: Path, run_dir: Path) -> PreparedModel:
    hf_logging.disable_progress_bar()  # our own progress lines say what is happening
    path = run.model.path
    if tiny_kind(path) is not None:
        model_dir = prepare_tiny_model(run, cache, _say)
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
    # A restarted run whose latest version is a delta: the engines start with from_pretrained, which
    # needs whole weights, so they start from that version written out in full (vN/bf16).
    start = (
        store.convert(latest, "bf16") if store.manifest(latest).get("kind") == DELTA else store.path(latest)
    )
    return PreparedModel(str(model_dir), tokenizer_path, latest, start)
