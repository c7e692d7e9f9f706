"""Where a small model's weight update is prepared: a thread of the engine against the preparer
process, in one run (``--weight-preparer``, mixrl/rl/engine/staging.py).

    .venv/bin/python bench/weight_preparer.py

The tests' tiny Qwen3-shaped model (vocabulary 512), FP8 weights: the first update (the process
starts a second interpreter and imports torch) and the next one, per way, with ratios.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from mixrl.rl.engine.staging import StagedWeights
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = create_tiny_checkpoint(Path(tmp) / "qwen3", "qwen3", vocab_size=512, seed=0)
        live = load_model(path)
        state = load_file(Path(path) / "model.safetensors")
        size = sum(p.numel() * p.element_size() for p in live.parameters())
        times: dict[str, tuple[float, float]] = {}
        for way in ("thread", "process"):
            staged = StagedWeights(live.config, "fp8", torch.float32, way)
            try:
                started = time.perf_counter()
                staged.prepare_state(live, state)
                first = time.perf_counter() - started
                started = time.perf_counter()
                staged.prepare_state(live, state)
                times[way] = (first, time.perf_counter() - started)
            finally:
                staged.close()
        print(f"model: {size / 2**20:.2f} MiB of parameters")
        for way, (first, then) in times.items():
            print(f"{way:<8} first update {first * 1000:8.1f} ms, next {then * 1000:6.1f} ms")
        (t1, t2), (p1, p2) = times["thread"], times["process"]
        print(f"process ÷ thread: first {p1 / t1:.0f}x, next {p2 / t2:.1f}x")


if __name__ == "__main__":
    main()
