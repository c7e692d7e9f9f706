"""Benchmark: cost of the corrected objective against plain GRPO and a naive dense implementation.

Forward + backward of the loss from hidden states [N, 512] through an LM head [V, 512], fp32 on
CPU, for each size N × V:

- (a) ``grpo``: a chunked plain GRPO loss (log-prob gather only), written below with the same
  chunking and in-place tricks as the library, so it is the cost floor of any chunked loss;
- ``ours``: :func:`chunked_token_policy_loss` with SC + MIS + top-p replay (the default config);
- (b) ``naive``: the dense reference (:func:`reference_token_policy_loss`) on materialized logits,
  differentiated by autograd — every distribution a full [N, V] tensor;
- ``logits``: materialized logits ``hidden @ Wᵀ`` fed to :func:`token_policy_loss` (what a trainer
  that already holds all logits would pay; for information).

Time: process CPU time of all threads (the targets are judged on it: on shared cores wall time
mostly measures the neighbours), the minimum over rounds, the methods alternating within one
process per size; wall time is shown too.  Each process first runs every method once on 128 rows
(code pages, library state), uncounted.  Peak memory: the process's resident-set high-water mark
(VmHWM) reset through /proc/self/clear_refs right before each run, minus the resident set at that
moment, after ``gc`` and ``malloc_trim``.  It counts every byte the run touches — torch's
allocations and MKL's work buffers included, which tracemalloc cannot see — and includes the
gradients of the hidden states and the LM head, which every method returns.  glibc's mmap
threshold is fixed at 1 MiB in the measuring process so freed buffers leave the resident set at
once (otherwise heap reuse makes the mark depend on history).  The naive methods run only where
their estimated peak fits ``--naive-budget-gib``.

    python bench/corrections.py            # the full grid (12 minutes on 2 busy shared cores)
    python bench/corrections.py --quick    # N=2048, V=32768 only (2 minutes, most of it the naive run)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mixrl.rl.corrections import (
    CorrectionConfig,
    LossTokens,
    chunked_token_policy_loss,
    reference_token_policy_loss,
    token_policy_loss,
)

HIDDEN = 512
CANDIDATES = 20
CHUNK = 1024
FULL_SIZES = [(2048, 32768), (8192, 32768), (2048, 151936), (8192, 151936)]
QUICK_SIZES = [(2048, 32768)]
# Estimated peak bytes per logit, to skip naive runs that would not fit (measured at 2048 × 32768).
NAIVE_BYTES_PER_LOGIT = {"naive": 66.0, "logits": 9.5}
NAIVE = tuple(NAIVE_BYTES_PER_LOGIT)


# ----------------------------------------------------------------------------- baseline (a)


class ChunkedGrpo(torch.autograd.Function):
    """−Σ A log p(a) / N from hidden states, chunk by chunk; the backward recomputes each chunk."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, tokens: Tensor, advantages: Tensor, chunk: int
    ) -> Tensor:  # type: ignore[override]
        n = hidden.shape[0]
        shift, log_norm, token_logit = (torch.empty(n) for _ in range(3))
        for r0 in range(0, n, chunk):
            sl = slice(r0, r0 + chunk)
            z = hidden[sl] @ weight.T
            shift[sl] = z.amax(dim=1)
            token_logit[sl] = z.gather(1, tokens[sl, None]).squeeze(1)
            log_norm[sl] = z.sub_(shift[sl, None]).exp_().sum(dim=1).log_()
        log_p = token_logit - shift - log_norm
        ctx.save_for_backward(hidden, weight, tokens, advantages, shift, log_norm)
        ctx.chunk = chunk
        return -(advantages * log_p).sum() / n

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, tokens, advantages, shift, log_norm = ctx.saved_tensors
        n = hidden.shape[0]
        coef = -advantages * grad / n  # d loss / dz = coef (e_a − p)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros_like(weight)
        for r0 in range(0, n, ctx.chunk):
            sl = slice(r0, r0 + ctx.chunk)
            z = hidden[sl] @ weight.T
            z.sub_((shift[sl] + log_norm[sl])[:, None]).exp_().mul_(-coef[sl, None])
            z.scatter_add_(1, tokens[sl, None], coef[sl, None])
            grad_h[sl] = z @ weight
            grad_w.addmm_(z.T, hidden[sl])
        return grad_h, grad_w, None, None, None


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    hidden: Tensor
    weight: Tensor
    records: LossTokens


def make_inputs(n: int, vocab: int, seed: int = 0) -> Inputs:
    """Valid synthetic sampler records: half the tokens from a top-p support, half from the whole
    vocabulary; log-probabilities plausible but not derived from the logits (the cost does not
    depend on their values)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g)
    weight = torch.randn(vocab, HIDDEN, generator=g) / HIDDEN**0.5
    # Distinct ids per row without per-row temporaries: an odd prime stride is a bijection mod V.
    cand_ids = (torch.randint(vocab, (n, 1), generator=g) + 7919 * torch.arange(CANDIDATES)) % vocab
    cand_logprobs = (-torch.rand(n, CANDIDATES, generator=g) * 6.0 - 0.5).sort(dim=1, descending=True).values
    support = torch.where(
        torch.rand(n, generator=g) < 0.5, torch.randint(1, CANDIDATES + 1, (n,), generator=g), 0
    )
    pick = (torch.rand(n, generator=g) * support.clamp(min=1)).long()
    tokens = torch.where(
        support > 0, cand_ids.gather(1, pick[:, None]).squeeze(1), torch.randint(vocab, (n,), generator=g)
    )
    sampler_logprobs = torch.where(support > 0, cand_logprobs.gather(1, pick[:, None]).squeeze(1), -8.0)
    advantages = torch.randn(n, generator=g)
    records = LossTokens(
        tokens=tokens,
        advantages=advantages,
        sampler_logprobs=sampler_logprobs,
        cand_ids=cand_ids,
        cand_logprobs=cand_logprobs,
        support_size=support,
    )
    return Inputs(hidden, weight, records)


def run_method(name: str, x: Inputs) -> None:
    """One forward + backward; gradients land in x.hidden.grad / x.weight.grad."""
    h, w = x.hidden, x.weight
    if name == "grpo":
        loss = ChunkedGrpo.apply(h, w, x.records.tokens, x.records.advantages, CHUNK)
    elif name == "ours":
        loss, _ = chunked_token_policy_loss(h, w, x.records, CorrectionConfig(), chunk_size=CHUNK)
    elif name == "naive":
        loss = reference_token_policy_loss(h @ w.T, x.records, CorrectionConfig())
    elif name == "logits":
        loss, _ = token_policy_loss(h @ w.T, x.records, CorrectionConfig())
    else:
        raise ValueError(f"unknown method {name!r}")
    loss.backward()


# ----------------------------------------------------------------------------- measurement


_LIBC = ctypes.CDLL("libc.so.6")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match, key
    return int(match.group(1)) * 1024


def measure(fn: Callable[[], None]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of all threads, peak resident bytes above the start) of one call."""
    gc.collect()
    _LIBC.malloc_trim(0)
    start_rss = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, _status_bytes("VmHWM") - start_rss


def child(n: int, vocab: int, methods: list[str], rounds: int) -> dict[str, dict[str, float]]:
    warm = make_inputs(128, vocab)  # first calls fault in code pages and library state: not counted
    warm.hidden.requires_grad_(True)
    warm.weight.requires_grad_(True)
    for m in methods:
        run_method(m, warm)
    del warm
    x = make_inputs(n, vocab)
    x.hidden.requires_grad_(True)
    x.weight.requires_grad_(True)
    results = {m: {"wall_s": float("inf"), "cpu_s": float("inf"), "peak_bytes": 0.0} for m in methods}
    for r in range(rounds):
        order = methods if r % 2 == 0 else methods[::-1]  # alternate to cancel drift between methods
        for m in order:
            wall, cpu, peak = measure(lambda m=m: run_method(m, x))
            x.hidden.grad = x.weight.grad = None
            res = results[m]
            res["wall_s"], res["cpu_s"] = min(res["wall_s"], wall), min(res["cpu_s"], cpu)
            res["peak_bytes"] = max(res["peak_bytes"], float(peak))
            print(
                f"    N={n} V={vocab} round {r + 1}/{rounds} {m}: wall {wall:.2f} s, cpu {cpu:.2f} s, "
                f"peak {peak / 2**20:.0f} MiB",
                file=sys.stderr,
                flush=True,
            )
    return results


# ----------------------------------------------------------------------------- driver


def _plan(n: int, vocab: int, budget: float) -> list[str]:
    methods = ["grpo", "ours"]
    for name, per_logit in NAIVE_BYTES_PER_LOGIT.items():
        if per_logit * n * vocab <= budget:
            methods.append(name)
    return methods


def _child_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    # A fixed glibc mmap threshold: every buffer of 1 MiB or more is its own mapping, returned to the
    # OS when freed, so the high-water mark follows live memory instead of heap reuse and retention.
    env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # idle OpenMP threads sleep: CPU time counts work, not spinning
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _table(rows: list[dict[str, Any]]) -> str:
    mib = 2**20
    lines = [
        "| N | V | (a) GRPO cpu s | ours cpu s | **time ours/(a)** | wall ours/(a) | (a) MiB | ours MiB "
        "| **mem ours/(a)** | (b) naive MiB | **mem ours/(b)** | logits+API MiB | mem ours/(logits+API) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        res = row["results"]
        a, o = res["grpo"], res["ours"]

        mem = {k: f"{res[k]['peak_bytes'] / mib:.0f}" if k in res else "not run (too big)" for k in NAIVE}
        ratio = {k: f"{o['peak_bytes'] / res[k]['peak_bytes']:.3f}" if k in res else "–" for k in NAIVE}

        lines.append(
            f"| {row['n']} | {row['vocab']} | {a['cpu_s']:.2f} | {o['cpu_s']:.2f} | {o['cpu_s'] / a['cpu_s']:.3f} "
            f"| {o['wall_s'] / a['wall_s']:.3f} | {a['peak_bytes'] / mib:.0f} | {o['peak_bytes'] / mib:.0f} "
            f"| {o['peak_bytes'] / a['peak_bytes']:.3f} | {mem['naive']} | {ratio['naive']} | {mem['logits']} "
            f"| {ratio['logits']} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only N=2048, V=32768")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per size")
    parser.add_argument("--threads", type=int, help="OpenMP threads (default: torch's default)")
    parser.add_argument(
        "--naive-budget-gib", type=float, default=8.0, help="skip naive runs estimated above this"
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", nargs=2, type=int, metavar=("N", "V"), help=argparse.SUPPRESS)
    parser.add_argument("--methods", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        n, vocab = args.child
        print(json.dumps(child(n, vocab, args.methods.split(","), args.rounds)))
        return 0

    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    work = [n * v for n, v in sizes]
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    print(f"torch {torch.__version__}, hidden {HIDDEN}, K {CANDIDATES}, chunk {CHUNK}, fp32 CPU", flush=True)
    for i, (n, vocab) in enumerate(sizes):
        methods = _plan(n, vocab, args.naive_budget_gib * 2**30)
        rounds = args.rounds
        cmd = [sys.executable, __file__, "--child", str(n), str(vocab), "--methods", ",".join(methods)]
        cmd += ["--rounds", str(rounds)]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=_child_env(args.threads))
        rows.append(
            {"n": n, "vocab": vocab, "rounds": rounds, "results": json.loads(out.stdout.splitlines()[-1])}
        )
        elapsed = time.perf_counter() - started
        done = sum(work[: i + 1])
        eta = elapsed / done * (sum(work) - done)
        print(
            f"[{i + 1}/{len(sizes)}] N={n} V={vocab} done; elapsed {elapsed:.0f} s, about {eta:.0f} s left",
            flush=True,
        )
    print()
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
