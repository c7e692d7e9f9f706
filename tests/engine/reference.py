"""Float64 references for the sampling math, written to be read against docs/architecture.md#the-token-record."""

from __future__ import annotations

import math


def log_softmax(logits: list[float], temperature: float) -> list[float]:
    scaled = [z / temperature for z in logits]
    top = max(scaled)
    log_total = top + math.log(sum(math.exp(z - top) for z in scaled))
    return [z - log_total for z in scaled]


def order(logprobs: list[float]) -> list[int]:
    """Token ids by decreasing log-prob, lower id first on ties."""
    return sorted(range(len(logprobs)), key=lambda i: (-logprobs[i], i))


def support(logprobs: list[float], top_k: int, top_p: float, min_p: float) -> list[int]:
    """S: leading tokens kept by top-k (rank < k), top-p (mass before < p) and min-p (q >= min_p·max q)."""
    ranked = order(logprobs)
    probs = [math.exp(logprobs[i]) for i in ranked]
    kept: list[int] = []
    mass = 0.0
    for rank, (token, p) in enumerate(zip(ranked, probs, strict=True)):
        if rank > 0 and (
            (top_k > 0 and rank >= top_k) or (top_p < 1.0 and mass >= top_p) or p < min_p * probs[0]
        ):
            break
        kept.append(token)
        mass += p
    return kept


def boundary_gap(logprobs: list[float], top_p: float, size: int) -> float:
    """How far the top-p boundary after ``size`` tokens is from a tie: |mass of the first size − p|."""
    probs = sorted((math.exp(lp) for lp in logprobs), reverse=True)
    return min(abs(sum(probs[:size]) - top_p), abs(sum(probs[: size - 1]) - top_p) if size > 1 else 1.0)
