"""The fast objective against the dense float64 reference, on random shapes and values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixrl.rl.corrections import (
    METRIC_KEYS,
    CorrectionConfig,
    LossTokens,
    chunked_token_policy_loss,
    reference_token_policy_loss,
    token_policy_loss,
)

CONFIGS = [
    CorrectionConfig(),
    CorrectionConfig(topp_replay=False),
    CorrectionConfig(score_centering=False),
    CorrectionConfig(mis=(0.5, 2.0)),
    CorrectionConfig(mis=None, tis=2.0),
    CorrectionConfig(mis=None, tis=0.7, topp_replay=False),
    CorrectionConfig(mis=None),
    CorrectionConfig.grpo(),
    CorrectionConfig(mis=None, score_centering=False, topp_replay=True),
]


def loss_and_grad(fn: Callable[..., Any], batch: Any, config: CorrectionConfig) -> tuple[torch.Tensor, ...]:
    z = batch.logits.clone().requires_grad_(True)
    out = fn(z, batch.records(), config, batch.loss_mask)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), z.grad


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 6),
    vocab=st.integers(2, 40),
    k_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
    config=st.sampled_from(CONFIGS),
    mask_prob=st.sampled_from([0.0, 0.4]),
    logit_scale=st.sampled_from([0.1, 2.0, 8.0]),
    mismatch=st.sampled_from([0.0, 0.5, 3.0]),
)
def test_loss_and_logit_gradient_match_reference(
    make_batch: Callable[..., Any],
    n: int,
    vocab: int,
    k_frac: float,
    seed: int,
    config: CorrectionConfig,
    mask_prob: float,
    logit_scale: float,
    mismatch: float,
) -> None:
    k = round(k_frac * vocab)
    batch = make_batch(
        n, vocab, k, seed=seed, mask_prob=mask_prob, logit_scale=logit_scale, mismatch=mismatch
    )
    loss, grad = loss_and_grad(token_policy_loss, batch, config)
    ref_loss, ref_grad = loss_and_grad(reference_token_policy_loss, batch, config)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("config", CONFIGS[:5], ids=str)
def test_fp32_path_matches_float64_reference(
    make_batch: Callable[..., Any], config: CorrectionConfig
) -> None:
    batch = make_batch(16, 300, 20, seed=3, mask_prob=0.2)
    ref_loss, ref_grad = loss_and_grad(reference_token_policy_loss, batch, config)
    b32 = batch.with_(
        logits=batch.logits.float(),
        advantages=batch.advantages.float(),
        sampler_logprobs=batch.sampler_logprobs.float(),
        cand_logprobs=batch.cand_logprobs.float(),
    )
    loss, grad = loss_and_grad(token_policy_loss, b32, config)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)


def test_bf16_logits_compute_in_fp32(make_batch: Callable[..., Any]) -> None:
    batch = make_batch(12, 64, 8, seed=5)
    config = CorrectionConfig()
    b16 = batch.with_(logits=batch.logits.bfloat16())
    loss, grad = loss_and_grad(token_policy_loss, b16, config)
    assert grad.dtype == torch.bfloat16
    # The same bf16-rounded logits, widened first: the bf16 call must equal it to fp32 accuracy.
    exact = batch.with_(logits=b16.logits.double())
    ref_loss, ref_grad = loss_and_grad(reference_token_policy_loss, exact, config)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-2, atol=1e-4)  # grad rounded to bf16


def test_masked_tokens_are_ignored_and_not_counted(make_batch: Callable[..., Any]) -> None:
    batch = make_batch(10, 50, 6, seed=11, mask_prob=0.5)
    mask = batch.loss_mask
    assert 0 < int(mask.sum()) < 10
    config = CorrectionConfig()
    loss, grad = loss_and_grad(token_policy_loss, batch, config)
    keep = mask.bool()
    # Garbage in the masked rows (what tool tokens may carry) changes nothing.
    noisy = batch.with_(
        sampler_logprobs=torch.where(keep, batch.sampler_logprobs, torch.nan),
        support_size=torch.where(keep, batch.support_size, 999),
    )
    loss2, grad2 = loss_and_grad(token_policy_loss, noisy, config)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    assert torch.equal(grad[~keep], torch.zeros_like(grad[~keep]))
    # Dropping the masked rows gives the same loss: they are not counted in the denominator.
    sub = batch.with_(
        logits=batch.logits[keep],
        **{f: getattr(batch, f)[keep] for f in ("tokens", "advantages", "sampler_logprobs", "support_size")},
        cand_ids=batch.cand_ids[keep],
        cand_logprobs=batch.cand_logprobs[keep],
        loss_mask=None,
    )
    loss3, grad3 = loss_and_grad(token_policy_loss, sub, config)
    torch.testing.assert_close(loss, loss3, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad[keep], grad3, rtol=1e-12, atol=0)


def test_all_masked_batch_has_zero_loss_and_gradient(make_batch: Callable[..., Any]) -> None:
    batch = make_batch(4, 20, 3, seed=2)
    batch = batch.with_(loss_mask=torch.zeros(4, dtype=torch.long))
    loss, grad = loss_and_grad(token_policy_loss, batch, CorrectionConfig())
    assert float(loss) == 0.0 and torch.equal(grad, torch.zeros_like(grad))


def test_num_loss_tokens_rescales_the_loss(make_batch: Callable[..., Any]) -> None:
    batch = make_batch(8, 30, 5, seed=4)
    config = CorrectionConfig()
    own, _ = token_policy_loss(batch.logits, batch.records(), config)
    accumulated, _ = token_policy_loss(batch.logits, batch.records(), config, num_loss_tokens=32)
    torch.testing.assert_close(accumulated, own * 8 / 32, rtol=1e-12, atol=0)


def test_no_candidates_at_all(make_batch: Callable[..., Any]) -> None:
    batch = make_batch(5, 17, 0, seed=9)
    for config in CONFIGS:
        loss, grad = loss_and_grad(token_policy_loss, batch, config)
        ref_loss, ref_grad = loss_and_grad(reference_token_policy_loss, batch, config)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_metrics_per_token_and_per_group(make_batch: Callable[..., Any]) -> None:
    batch = make_batch(40, 25, 6, seed=21, mask_prob=0.25, mismatch=2.0)
    config = CorrectionConfig(mis=(0.5, 2.0))
    _, metrics = token_policy_loss(batch.logits, batch.records(), config, batch.loss_mask)
    assert set(metrics.per_token) == set(METRIC_KEYS) == set(metrics.mean)
    keep = batch.loss_mask.bool()
    assert torch.equal(metrics.mask, keep)

    # Direct float64 computation, token by token.
    log_p = batch.logits.log_softmax(-1)
    for i in range(40):
        if not keep[i]:
            assert all(float(v[i]) == 0.0 for v in metrics.per_token.values())
            continue
        s, a = int(batch.support_size[i]), int(batch.tokens[i])
        log_pi, log_mu = log_p[i, a], batch.sampler_logprobs[i]
        if s:
            log_mu = log_mu - batch.cand_logprobs[i, :s].logsumexp(0)
            log_pi = batch.logits[i, a] - batch.logits[i, batch.cand_ids[i, :s]].logsumexp(0)
        lr = float(log_pi - log_mu)
        r = torch.tensor(lr).exp().item()
        want = {
            "log_ratio": lr,
            "abs_log_ratio": abs(lr),
            "k1": -lr,
            "k3": r - 1 - lr,
            "extreme_ratio": float(r < 0.2 or r > 5),
            "mis_masked": float(not 0.5 <= r <= 2.0),
            "weight": r if 0.5 <= r <= 2.0 else 0.0,
            "entropy": float(-(log_p[i].exp() * log_p[i]).sum()),
        }
        for key, value in want.items():
            assert metrics.per_token[key][i].item() == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert metrics.per_token["mis_masked"][keep].sum() > 0  # the mismatch is large enough to mask some
    assert metrics.per_token["extreme_ratio"][keep].sum() > 0
    for key in METRIC_KEYS:
        assert metrics.mean[key] == pytest.approx(
            float(metrics.per_token[key][keep].mean()), rel=1e-6, abs=1e-7
        )

    pools = torch.arange(40) % 3
    means, counts = metrics.group_means(pools, 3)
    for g in range(3):
        sel = keep & (pools == g)
        assert counts[g] == int(sel.sum())
        for key in METRIC_KEYS:
            torch.testing.assert_close(
                means[key][g], metrics.per_token[key][sel].mean(), rtol=1e-6, atol=1e-7
            )


def test_metrics_have_no_mis_mask_without_mis(make_batch: Callable[..., Any]) -> None:
    batch = make_batch(30, 25, 6, seed=21, mismatch=3.0)
    _, metrics = token_policy_loss(batch.logits, batch.records(), CorrectionConfig(mis=None, tis=2.0))
    assert metrics.mean["mis_masked"] == 0.0
    assert metrics.mean["extreme_ratio"] > 0.0


def _confident(n: int, vocab: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, LossTokens]:
    """A confident head (the sampled token p ≈ 0.9999) whose tail holds almost nothing (P_out ≈ 1e-13),
    recorded by a sampler whose top log-prob is off by a rounding (2e-6 nats): score centering's κ
    for the outside mass is then about 1e7."""
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(n, vocab, generator=generator, dtype=torch.float64) * 2 - 38
    z[:, :k] = torch.linspace(0, -12, k, dtype=torch.float64)
    recorded = torch.log_softmax(z, -1)[:, :k].clone()
    recorded[:, 0] -= 2e-6
    records = LossTokens(
        tokens=torch.zeros(n, dtype=torch.long),
        advantages=torch.ones(n, dtype=dtype),
        sampler_logprobs=recorded[:, 0].to(dtype),
        cand_ids=torch.arange(k).repeat(n, 1),
        cand_logprobs=recorded.to(dtype),
        support_size=torch.zeros(n, dtype=torch.long),
    )
    return z, records


def test_score_centering_alone_keeps_the_candidates_gradient_in_float32() -> None:
    """κ grows without bound under score centering alone; the candidates' gradient was a dense −κp
    and a sparse +κp that cancelled in fp32 (relative error 0.057 against float64)."""
    config = CorrectionConfig(mis=None)
    z, records64 = _confident(64, 1000, 20, torch.float64)
    reference = z.clone().requires_grad_(True)
    reference_token_policy_loss(reference, records64, config).backward()
    assert reference.grad is not None
    _, records = _confident(64, 1000, 20, torch.float32)
    fast = z.float().requires_grad_(True)
    token_policy_loss(fast, records, config)[0].backward()
    assert fast.grad is not None
    error = (fast.grad.double() - reference.grad).norm() / reference.grad.norm()
    assert error < 1e-5, float(error)
    hidden = z.float().clone().requires_grad_(True)
    chunked_token_policy_loss(hidden, torch.eye(1000), records, config, chunk_size=16)[0].backward()
    assert hidden.grad is not None
    assert (hidden.grad.double() - reference.grad).norm() / reference.grad.norm() < 1e-5


@pytest.mark.parametrize("config", [CorrectionConfig(), CorrectionConfig(mis=None), CorrectionConfig.grpo()])
def test_minus_infinity_logits_are_probability_zero_not_nan(config: CorrectionConfig) -> None:
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(2, 12, generator=generator, dtype=torch.float64)
    z[:, -2:] = float("-inf")  # masked columns (a padded vocabulary)
    recorded, ids = torch.log_softmax(z[:, :-2] + 0.3, -1).topk(3, -1)
    records = LossTokens(
        tokens=ids[:, 0],
        advantages=torch.tensor([1.0, -0.5], dtype=torch.float64),
        sampler_logprobs=recorded[:, 0],
        cand_ids=ids,
        cand_logprobs=recorded,
        support_size=torch.zeros(2, dtype=torch.long),
    )
    reference = reference_token_policy_loss(z.clone(), records, config)
    loss, metrics = token_policy_loss(z.clone(), records, config)
    assert torch.isclose(loss, reference), (float(loss), float(reference))
    assert bool(torch.isfinite(metrics.per_token["entropy"]).all())


def test_logits_of_any_strides_are_taken() -> None:
    z, records = _confident(4, 30, 5, torch.float64)
    transposed = z.t().contiguous().t()  # column-major: the same values
    assert not transposed.is_contiguous()
    config = CorrectionConfig()
    assert torch.equal(
        token_policy_loss(transposed, records, config)[0], token_policy_loss(z, records, config)[0]
    )
