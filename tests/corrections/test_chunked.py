"""chunked_token_policy_loss against token_policy_loss on the materialized logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixrl.rl.corrections import (
    CorrectionConfig,
    chunked_token_policy_loss,
    reference_token_policy_loss,
    token_policy_loss,
)

CONFIGS = [CorrectionConfig(), CorrectionConfig(topp_replay=False), CorrectionConfig.grpo()]


def hidden_and_head(
    n: int, vocab: int, width: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, width, generator=g, dtype=torch.float64)
    head = torch.randn(vocab, width, generator=g, dtype=torch.float64) / width**0.5
    return hidden.to(dtype), head.to(dtype)


def both_ways(
    batch: Any, hidden: torch.Tensor, head: torch.Tensor, config: CorrectionConfig, **kw: Any
) -> Any:
    """(loss, grad hidden, grad head) chunked, and the same through materialized logits + autograd."""
    temperature = kw.get("temperature", 1.0)
    h1, w1 = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
    loss1, m1 = chunked_token_policy_loss(h1, w1, batch.records(), config, batch.loss_mask, **kw)
    loss1.backward()
    h2, w2 = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
    loss2, m2 = token_policy_loss((h2 @ w2.T) / temperature, batch.records(), config, batch.loss_mask)
    loss2.backward()
    return (loss1, h1.grad, w1.grad, m1), (loss2, h2.grad, w2.grad, m2)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 24),
    vocab=st.integers(2, 60),
    chunk=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
    config=st.sampled_from(CONFIGS),
    mask_prob=st.sampled_from([0.0, 0.3]),
    temperature=st.sampled_from([1.0, 0.6]),
)
def test_chunked_equals_unchunked(
    make_batch: Callable[..., Any],
    n: int,
    vocab: int,
    chunk: int,
    seed: int,
    config: CorrectionConfig,
    mask_prob: float,
    temperature: float,
) -> None:
    batch = make_batch(n, vocab, min(5, vocab), seed=seed, mask_prob=mask_prob)
    hidden, head = hidden_and_head(n, vocab, 8, seed, torch.float64)
    # The sampler's record is about the logits the chunked path will compute.
    chunked, plain = both_ways(batch, hidden, head, config, chunk_size=chunk, temperature=temperature)
    for a, b in zip(chunked[:3], plain[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for key, values in chunked[3].per_token.items():
        torch.testing.assert_close(values, plain[3].per_token[key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_chunked_fp32_against_float64_reference(
    make_batch: Callable[..., Any], config: CorrectionConfig
) -> None:
    batch = make_batch(50, 700, 16, seed=8, mask_prob=0.1)
    hidden, head = hidden_and_head(50, 700, 32, 8, torch.float64)
    h, w = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
    reference_token_policy_loss(h @ w.T, batch.records(), config, batch.loss_mask).backward()
    h32, w32 = hidden.float().requires_grad_(True), head.float().requires_grad_(True)
    record = batch.records()
    records = replace(record, advantages=record.advantages.float(), sampler_logprobs=record.sampler_logprobs.float(),
                      cand_logprobs=record.cand_logprobs.float())  # fmt: skip
    loss, _ = chunked_token_policy_loss(h32, w32, records, config, batch.loss_mask, chunk_size=7)
    loss.backward()
    torch.testing.assert_close(h32.grad.double(), h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w32.grad.double(), w.grad, rtol=1e-4, atol=1e-6)


def test_chunked_bf16_inputs(make_batch: Callable[..., Any]) -> None:
    batch = make_batch(20, 90, 8, seed=13)
    hidden, head = hidden_and_head(20, 90, 16, 13, torch.bfloat16)
    config = CorrectionConfig()
    h, w = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
    loss, _ = chunked_token_policy_loss(h, w, batch.records(), config, chunk_size=6)
    loss.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    # Reference on the logits the bf16 LM head produces, widened.
    hd, wd = hidden.double().requires_grad_(True), head.double().requires_grad_(True)
    ref = reference_token_policy_loss((hd.bfloat16() @ wd.bfloat16().T).double(), batch.records(), config)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    z = (hd @ wd.T).detach().requires_grad_(True)
    reference_token_policy_loss(z, batch.records(), config).backward()
    torch.testing.assert_close(h.grad.double(), z.grad @ head.double(), rtol=5e-2, atol=2e-3)
    torch.testing.assert_close(w.grad.double(), z.grad.T @ hidden.double(), rtol=5e-2, atol=2e-3)


def test_gradient_flows_only_where_asked(make_batch: Callable[..., Any]) -> None:
    batch = make_batch(6, 30, 4, seed=1)
    hidden, head = hidden_and_head(6, 30, 8, 1, torch.float64)
    h = hidden.clone().requires_grad_(True)
    loss, _ = chunked_token_policy_loss(h, head, batch.records(), CorrectionConfig(), chunk_size=4)
    loss.backward()
    assert h.grad is not None and h.grad.abs().max() > 0 and head.grad is None


def test_chunked_memory_stays_at_one_chunk(make_batch: Callable[..., Any]) -> None:
    """The backward never sees a [N, V] tensor: the largest buffer the profiler records is one chunk."""
    n, vocab, chunk = 256, 2000, 32
    batch = make_batch(n, vocab, 8, seed=3, dtype=torch.float32)
    hidden, head = hidden_and_head(n, vocab, 16, 3, torch.float32)
    h, w = hidden.requires_grad_(True), head.requires_grad_(True)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        loss, _ = chunked_token_policy_loss(h, w, batch.records(), CorrectionConfig(), chunk_size=chunk)
        loss.backward()
    largest = max(evt.cpu_memory_usage for evt in prof.events())
    one_chunk = chunk * vocab * 4
    assert one_chunk <= largest <= 1.5 * one_chunk  # far below the full logits (n·V·4 = 8× more)
