"""When a run is evaluated, and what the BF16 evaluator has done: pure, for the evaluator that
plays the held-out episodes and the trainer that must keep their versions until it has."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from mixrl.api.resolve import ResolvedRun

BF16_PROTOCOL = "bf16"
"""The ``protocol`` of the evaluations ``mixrl evaluate`` posts (``evaluation.sampler: bf16``)."""


def evaluation_steps(every: int, total: int | None) -> Iterator[int]:
    """0, every multiple of ``every`` below ``total``, then ``total`` (forever when it is None)."""
    step = 0
    while total is None or step < total:
        yield step
        step += every
    if total is not None:
        yield total


def is_evaluation_step(step: int, every: int, total: int | None) -> bool:
    return step % every == 0 or step == total


def evaluated_steps(evaluations: Iterable[dict[str, Any]]) -> set[int]:
    """Steps the buffer's evaluation log already holds an evaluation of by the BF16 protocol."""
    return {int(e["step"]) for e in evaluations if e.get("protocol") == BF16_PROTOCOL}


def protected_versions(run: ResolvedRun, published: Iterable[int], evaluated: set[int]) -> set[int]:
    """Published versions the trainer must not prune: evaluation steps of the BF16 evaluator that
    it has not posted yet (version N is the weights after step N)."""
    if run.evaluation.sampler != BF16_PROTOCOL:
        return set()
    every, total = run.evaluation.every_steps, run.trainer.spec.total_steps
    return {v for v in published if v not in evaluated and is_evaluation_step(v, every, total)}
