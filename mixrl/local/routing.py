"""MoE routing mismatch per pool, measured from a finished run directory (``mixrl report``).

For every weight version the run's store still holds, the samples each pool drew entirely with
that version are fed again through two models: the pool's model as its engine serves it (built
from the pool's own engine arguments: precision, quantized inputs, compute dtype, attention, FP8
KV cache) and the trainer's (float32, transformers' attention), and each MoE layer's top-k experts
are compared at every position whose next token the pool sampled (the positions that decided a
sampled token).  So the share is the pool's routing mismatch at staleness 0: precision and kernels
alone, as a sampler and a trainer without routing replay have it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.rl.engine.attention import use_engine_attention
from mixrl.rl.engine.kv_cache import new_cache
from mixrl.rl.engine.server import build_parser, config_from_args
from mixrl.rl.engine.service import serving_model
from mixrl.rl.moe_routing import RoutingDisagreement, routed_experts, routing_disagreement
from mixrl.rl.tiny_models import load_model
from mixrl.rl.weights import WeightStore

SAMPLES_PER_POOL_AND_VERSION = 32


def _fresh_samples(path: Path, versions: set[int], limit: int) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Per (pool, version): up to ``limit`` of the newest samples whose tokens that pool drew all
    with that version."""
    found: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    if not path.is_file():
        return found
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            try:
                sample = json.loads(line)
                drawn = {v for v in sample["weight_version"] if v >= 0}
            except (ValueError, KeyError, TypeError):
                continue  # a torn or foreign line
            if len(drawn) == 1 and (version := drawn.pop()) in versions:
                kept = found[(str(sample.get("pool")), version)]
                kept.append(sample)
                del kept[:-limit]
    return found


def _deciding_positions(sample: dict[str, Any]) -> torch.Tensor:
    """[len(prompt) + len(tokens)] bool: the positions whose next token the pool sampled."""
    prompt, mask = len(sample["prompt_ids"]), sample["loss_mask"]
    length = prompt + len(mask)
    deciding = torch.zeros(length, dtype=torch.bool)
    for index, sampled in enumerate(mask):
        if sampled:
            deciding[prompt + index - 1] = True
    return deciding


NEWEST_VERSIONS = 2
"""Versions measured: the store's newest (a run's last steps, the policy it ended with)."""


def is_moe_run(run_dir: Path) -> bool:
    """Whether the run's model routes tokens to experts (from a stored version's config.json)."""
    for config in sorted((run_dir / "weights").glob("v*/config.json"), reverse=True):
        try:
            fields = json.loads(config.read_text())
            return int(fields.get("num_experts") or fields.get("num_local_experts") or 0) > 0
        except (OSError, ValueError, TypeError):
            continue
    return False


def measure(run_dir: Path, limit: int = SAMPLES_PER_POOL_AND_VERSION) -> dict[str, RoutingDisagreement]:
    """Each pool's routing mismatch against the trainer (empty for a dense model, or a run whose
    store and samples share no version)."""
    if not is_moe_run(run_dir):
        return {}
    resolved = resolve(load_rlrun(run_dir / "rlrun.yaml"))
    store = WeightStore(str(run_dir / "weights"))
    versions = set(store.versions()[-NEWEST_VERSIONS:])
    samples = _fresh_samples(run_dir / "buffer" / "trajectories.jsonl", versions, limit)
    per_pool: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for version in sorted({v for _, v in samples}):
        directory = store.convert(version, "bf16")  # a delta is materialised, a snapshot is its own
        trainer = load_model(directory, dtype=torch.float32).eval()
        for pool in resolved.pools:
            drawn = samples.get((pool.name, version))
            if not drawn:
                continue
            args = build_parser().parse_args([*pool.engine_args, "--model-path", directory])
            config = config_from_args(args)
            served, _, _ = serving_model(config)
            use_engine_attention(served, config.attention_backend)
            # the engine's KV cache: FP8 at scale 1.0 (mixrl's checkpoints carry no KV scales) or as computed
            scale = (1.0, 1.0) if config.kv_cache_dtype == "fp8" else None
            layers = int(served.config.num_hidden_layers)
            for sample in drawn:
                ids = torch.tensor([sample["prompt_ids"] + sample["tokens"]])
                sampler_routes = routed_experts(
                    served,
                    ids,
                    attention_mask=torch.ones_like(ids, dtype=torch.bool),
                    cache=new_cache([scale] * layers),
                    use_cache=True,
                )
                trainer_routes = routed_experts(trainer, ids)
                per_pool[pool.name].append((sampler_routes, trainer_routes, _deciding_positions(sample)))
    results = {}
    for name, rows in per_pool.items():
        results[name] = routing_disagreement(
            torch.cat([r[0] for r in rows], dim=1),
            torch.cat([r[1] for r in rows], dim=1),
            torch.cat([r[2] for r in rows]),
        )
    return results


def routing_lines(run_dir: Path) -> list[str]:
    """The report's MoE routing section (none for a dense model); also writes ``routing.json``."""
    measured = measure(run_dir)
    if not measured:
        return []
    (run_dir / "routing.json").write_text(
        json.dumps({pool: asdict(figures) for pool, figures in measured.items()}, indent=2) + "\n",
        encoding="utf-8",
    )
    lines = [
        "## MoE routing mismatch per pool",
        "",
        "Positions whose next token the pool sampled, fed again through the pool's model as its engine",
        "serves it and through the trainer's, at a version that drew them (staleness 0, the store's",
        f"{NEWEST_VERSIONS} newest): the share whose top-k experts differ in at least one layer, and per layer.",
        "",
        "| pool | positions | routed differently (any layer) | per layer |",
        "|---|---|---|---|",
    ]
    for pool in sorted(measured):
        figures = measured[pool]
        per_layer = " / ".join(f"{share:.1%}" for share in figures.per_layer)
        lines.append(f"| {pool} | {figures.tokens} | {figures.any_layer:.1%} | {per_layer} |")
    return lines
