"""The tensor-parallel seam with real collectives: two processes on gloo, each holding half of
the vocabulary, must reproduce the unsharded loss, metrics and gradients.

The ranks are separate Python processes running tp_worker.py (rather than
torch.multiprocessing.spawn, which would have to pickle a function from this test module by a name
that pytest's importlib import mode does not make importable in the child).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mixrl.rl.corrections import CorrectionConfig, chunked_token_policy_loss, token_policy_loss

WORKER = Path(__file__).with_name("tp_worker.py")
CONFIGS: list[dict[str, Any]] = [
    {},
    {"topp_replay": False},
    {"mis": None, "tis": 1.5},
    {"mis": None, "score_centering": False, "topp_replay": False},
]


def run_ranks(tmp_path: Path, world: int) -> list[dict[str, Any]]:
    init = tmp_path / "init"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(rank),
                str(world),
                str(init),
                str(tmp_path / "in.pt"),
                str(tmp_path / f"out{rank}.pt"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=180)
            outputs.append(out.decode())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{outputs[rank]}"
    return [torch.load(tmp_path / f"out{rank}.pt") for rank in range(world)]


def test_two_vocab_shards_on_gloo_equal_the_whole_vocabulary(
    tmp_path: Path, make_batch: Callable[..., Any]
) -> None:
    n, vocab, width = 14, 23, 6  # 23 splits unevenly: 12 + 11 columns
    batch = make_batch(n, vocab, 6, seed=17, mask_prob=0.2, mismatch=1.5)
    g = torch.Generator().manual_seed(17)
    hidden = torch.randn(n, width, generator=g, dtype=torch.float64)
    head = torch.randn(vocab, width, generator=g, dtype=torch.float64)
    # Candidates and sampled tokens land on both shards, so the gathers really cross ranks.
    assert (batch.cand_ids[batch.cand_ids >= 0] < 12).any() and (batch.cand_ids >= 12).any()
    torch.save(
        {
            "logits": batch.logits,
            "records": vars(batch.records()),  # plain tensors: the worker loads with weights_only
            "loss_mask": batch.loss_mask,
            "hidden": hidden,
            "head": head,
            "configs": CONFIGS,
        },
        tmp_path / "in.pt",
    )
    ranks = run_ranks(tmp_path, world=2)
    assert [(r["start"], r["stop"]) for r in ranks] == [(0, 12), (12, 23)]

    for i, kwargs in enumerate(CONFIGS):
        config = CorrectionConfig(**kwargs)
        z = batch.logits.clone().requires_grad_(True)
        loss, metrics = token_policy_loss(z, batch.records(), config, batch.loss_mask)
        loss.backward()
        h, w = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
        chunked, _ = chunked_token_policy_loss(
            h, w, batch.records(), config, batch.loss_mask, chunk_size=3, temperature=0.7
        )
        chunked.backward()
        parts = [r["results"][i] for r in ranks]
        for part in parts:  # every rank gets the whole loss and the whole metrics
            torch.testing.assert_close(part["loss"], loss.detach(), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(part["chunked_loss"], chunked.detach(), rtol=1e-12, atol=1e-14)
            for key, values in metrics.per_token.items():
                torch.testing.assert_close(part["metrics"][key], values, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(torch.cat([p["grad"] for p in parts], 1), z.grad, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(
            torch.cat([p["grad_head"] for p in parts], 0), w.grad, rtol=1e-10, atol=1e-13
        )
        # The hidden-state gradient is each shard's contribution; their sum is the whole gradient.
        torch.testing.assert_close(sum(p["grad_hidden"] for p in parts), h.grad, rtol=1e-10, atol=1e-13)
        assert all(p["grad_hidden"].abs().max() > 0 for p in parts)
