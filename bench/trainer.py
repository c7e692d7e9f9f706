"""Benchmark: the torch trainer's memory per rank and step time under FSDP2, and BF16 against FP32.

One batch of synthetic trajectories (random prompts and generated tokens, K candidates each, a
reward per episode) trains a Qwen3-shaped model built locally (``--hidden``, ``--layers``; nothing
downloaded) for ``--steps`` timed steps after one warm-up step, in three configurations, each as
real processes under torchrun:

- ``1 rank fp32``: the baseline, one process (what ``mixrl run`` runs on a CPU);
- ``2 ranks fp32``: FSDP2 over gloo, each rank half the trajectories;
- ``1 rank bf16``: BF16 compute (autocast), FP32 masters, as on a GPU.

Reported per configuration: the bytes of model state each rank holds (its parameter shards, their
gradients and AdamW's two moments), the process's peak resident set and the part of it training
added (the peak less the resident set after the imports, before the model is loaded), the median
step time and the batch's tokens per second; as ratios against the baseline measured in the same
run.  ``--plot PATH`` draws them.  BF16's last column is the largest change
of any weight against the FP32 update after the same steps (how far BF16 compute moves it).

On a CPU the BF16 figure measures this CPU's BF16 matmuls (without native BF16 units, emulated and
slow), not a GPU's; the memory figures do not depend on the device.

    python bench/trainer.py           # hidden 768, 8 layers (74M parameters), 2 timed steps
    python bench/trainer.py --quick   # hidden 128, 2 layers, 2 timed steps (64 s on 2 busy cores)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mixrl.api.trajectory import TokenRecord, Trajectory
from mixrl.rl.corrections import CorrectionConfig
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model
from mixrl.rl.trainer import distributed
from mixrl.rl.trainer.batch import collate
from mixrl.rl.trainer.torch_backend import OptimizerSettings, TorchPolicyTrainer

VOCAB = 2048
CANDIDATES = 8
CONFIGS = [("1 rank fp32", 1, "float32"), ("2 ranks fp32", 2, "float32"), ("1 rank bf16", 1, "bfloat16")]


def synthetic_groups(groups: int, group_size: int, tokens: int, seed: int = 0) -> list[list[Trajectory]]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        group = []
        for index in range(group_size):
            trajectory = Trajectory(
                prompt_id=f"p{g}",
                sample_index=index,
                pool="bench",
                prompt_ids=[rng.randrange(VOCAB) for _ in range(16)],
            )
            for _ in range(tokens):
                ids = rng.sample(range(VOCAB), CANDIDATES)
                logprobs = sorted((-rng.uniform(0.1, 8.0) for _ in ids), reverse=True)
                trajectory.append_generated(
                    TokenRecord(token_id=ids[0], logprob=logprobs[0], cand_ids=ids, cand_logprobs=logprobs,
                                support_size=0, weight_version=0)
                )  # fmt: skip
            trajectory.reward = float(rng.random() < 0.5)
            trajectory.finish_reason = "submitted"
            group.append(trajectory)
        out.append(group)
    return out


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def current_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor holds one shard
    return local.numel() * local.element_size()


def worker(model_dir: str, groups_json: str, out: str, steps: int, dtype: str) -> None:
    rss_at_start = current_rss_bytes()
    ranks = distributed.Ranks.from_env()
    distributed.init_process_group(ranks, torch.device("cpu"))
    torch.manual_seed(0)
    trainer = TorchPolicyTrainer(
        load_model(model_dir), CorrectionConfig(), OptimizerSettings(lr=1e-4, micro_batch_tokens=4096),
        compute_dtype=getattr(torch, dtype), ranks=ranks,
    )  # fmt: skip
    raw = json.loads(Path(groups_json).read_text())
    batch = collate([[Trajectory.model_validate(t) for t in g] for g in raw], trainer_version=0)
    times = []
    for step in range(steps + 1):
        started = time.perf_counter()
        trainer.step(batch)
        if step:  # the first step warms up (allocations, FSDP's lazy init)
            times.append(time.perf_counter() - started)
    parameters = [p for p in trainer.trunk.parameters()]
    state = sum(local_bytes(p) for p in parameters) + sum(
        local_bytes(p.grad) for p in parameters if p.grad is not None
    )
    state += sum(local_bytes(t) for s in trainer.optimizer.state.values() for t in s.values() if t.dim() > 0)
    weights = trainer.state_dict_for_publication(torch.float32)
    record = {
        "rank": ranks.rank,
        "state_bytes": state,
        "peak_rss": peak_rss_bytes(),
        "training_rss": peak_rss_bytes() - rss_at_start,
        "step_s": statistics.median(times),
        "tokens": batch.num_tokens,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
    }
    Path(out, f"rank{ranks.rank}.json").write_text(json.dumps(record))
    if ranks.is_main:
        torch.save(weights, Path(out, "weights.pt"))
    distributed.destroy_process_group()


def run_config(ranks: int, dtype: str, model_dir: str, groups_json: Path, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   __file__, "--worker", model_dir, str(groups_json), out, str(steps), dtype]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"bench/trainer.py: {ranks} rank(s) {dtype} failed:\n{done.stderr[-3000:]}")
        records = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(ranks)]
        weights = torch.load(Path(out, "weights.pt"), weights_only=True)
    return {
        "state_bytes": max(r["state_bytes"] for r in records),
        "peak_rss": max(r["peak_rss"] for r in records),
        "training_rss": max(r["training_rss"] for r in records),
        "step_s": max(r["step_s"] for r in records),
        "tokens_per_s": records[0]["tokens"] / max(r["step_s"] for r in records),
        "parameters": records[0]["parameters"],
        "weights": weights,
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2], argv[3], int(argv[4]), argv[5])
        return 0
    parser = argparse.ArgumentParser(prog="bench/trainer.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="write the figures as a PNG here")
    args = parser.parse_args(argv)
    hidden = args.hidden or (128 if args.quick else 768)
    layers = args.layers or (2 if args.quick else 8)
    steps = args.steps or 2
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny_checkpoint(
            Path(tmp, "model"), "qwen3", vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
            intermediate_size=4 * hidden, num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        groups_json = Path(tmp, "groups.json")
        groups = synthetic_groups(groups=4, group_size=4, tokens=96)
        groups_json.write_text(json.dumps([[t.model_dump(mode="json") for t in g] for g in groups]))
        results: dict[str, dict[str, Any]] = {}
        started = time.perf_counter()
        for index, (name, ranks, dtype) in enumerate(CONFIGS):
            results[name] = run_config(ranks, dtype, model_dir, groups_json, steps)
            elapsed = time.perf_counter() - started
            eta = elapsed / (index + 1) * (len(CONFIGS) - index - 1)
            print(f"[{index + 1}/{len(CONFIGS)}] {name}: {results[name]['step_s']:.2f} s/step; "
                  f"elapsed {elapsed:.0f} s, about {eta:.0f} s left", file=sys.stderr, flush=True)  # fmt: skip
    base = results[CONFIGS[0][0]]
    print(f"\nmodel: hidden {hidden}, {layers} layers, vocabulary {VOCAB}, {base['parameters'] / 1e6:.1f}M parameters; "
          f"batch 16 trajectories x 112 tokens; {steps} timed steps\n")  # fmt: skip
    print(
        "| configuration | model state per rank | vs 1 rank | peak RSS per rank | training's part of it | vs 1 rank"
        " | step s | tokens/s | vs 1 rank | max abs weight change vs fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in results:
        r = results[name]
        drift = max(float((r["weights"][k] - base["weights"][k]).abs().max()) for k in base["weights"])
        drift_text = "0 (baseline)" if r is base else f"{drift:.1e}"
        print(
            f"| {name} | {r['state_bytes'] / 2**20:.1f} MiB | {r['state_bytes'] / base['state_bytes']:.2f} | "
            f"{r['peak_rss'] / 2**20:.0f} MiB | {r['training_rss'] / 2**20:.0f} MiB | "
            f"{r['training_rss'] / base['training_rss']:.2f} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} | {drift_text} |"
        )
    if args.plot is not None:
        plot(results, base, args.plot, f"{base['parameters'] / 1e6:.0f}M-parameter Qwen3-shaped model")
        print(f"\nplot: {args.plot}")
    return 0


def plot(results: dict[str, dict[str, Any]], base: dict[str, Any], path: Path, title: str) -> None:
    """Per configuration, against one rank in FP32: memory per rank, and throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    figure, (memory, speed) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = range(len(names))
    state = [results[n]["state_bytes"] / base["state_bytes"] for n in names]
    training = [results[n]["training_rss"] / base["training_rss"] for n in names]
    memory.bar([i - 0.2 for i in x], state, 0.4, label="model state per rank")
    memory.bar([i + 0.2 for i in x], training, 0.4, label="training's peak RSS per rank")
    memory.axhline(0.6, color="grey", linestyle="--", linewidth=1, label="target for 2 ranks (0.6x)")
    memory.set_ylabel("x one rank, FP32")
    memory.legend(fontsize=8)
    speed.bar(list(x), [results[n]["tokens_per_s"] / base["tokens_per_s"] for n in names], 0.5)
    speed.set_ylabel("tokens/s, x one rank FP32")
    for axes in (memory, speed):
        axes.set_xticks(list(x), names)
    figure.suptitle(f"bench/trainer.py: {title}, on this machine's CPUs")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
