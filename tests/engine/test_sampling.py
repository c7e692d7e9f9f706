"""The sampling step against float64 references: log-probs, candidates, support S, and the draw itself."""

from __future__ import annotations

import math

import pytest
import torch

from mixrl.rl.engine.protocol import renormalized_logprob
from mixrl.rl.engine.sampling import RowSampling, sample_rows, sort_descending

from . import reference

V = 64


def _logits(seed: int, batch: int = 4, spread: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, V, generator=torch.Generator().manual_seed(seed)) * spread


@pytest.mark.parametrize(
    "row",
    [
        RowSampling(temperature=1.0, num_candidates=5),
        RowSampling(temperature=0.7, top_p=0.8, num_candidates=3, cover_support=True),
        RowSampling(temperature=1.3, top_k=7, num_candidates=2, cover_support=True),
        RowSampling(temperature=1.0, top_p=0.9, top_k=12, min_p=0.05, num_candidates=0, cover_support=True),
        RowSampling(temperature=0.0, num_candidates=4),
    ],
    ids=["full", "top_p", "top_k", "all_rules", "greedy"],
)
def test_step_matches_float64_reference(row: RowSampling) -> None:
    logits = _logits(0)
    uniforms = torch.tensor([0.05, 0.35, 0.65, 0.95])
    out = sample_rows(logits, [row] * 4, uniforms, weight_version=7)
    temperature = 1.0 if row.greedy else row.temperature
    top_k = 1 if row.greedy else row.top_k
    for b in range(4):
        lp = reference.log_softmax(logits[b].double().tolist(), temperature)
        ranked = reference.order(lp)
        support = reference.support(lp, top_k, row.top_p, row.min_p)
        truncated = len(support) < V
        record = out[b]
        assert record.weight_version == 7
        assert record.support_size == (len(support) if truncated else 0)
        # reported log-prob of the sampled token is the untruncated log q
        assert record.logprob == pytest.approx(lp[record.token_id], abs=1e-5)
        # candidates: the leading tokens in descending order, with their log q; at least |S| when
        # covering the support or truncating
        k = max(row.num_candidates, len(support) if row.cover_support or truncated else 0)
        assert record.cand_ids == ranked[:k]
        assert record.cand_logprobs == pytest.approx([lp[i] for i in ranked[:k]], abs=1e-5)
        assert record.cand_logprobs == sorted(record.cand_logprobs, reverse=True)
        # the draw: inverse CDF of q renormalized on S at u
        mass = [math.exp(lp[i]) for i in support]
        target = uniforms[b].item() * sum(mass)
        cumulative, expected = 0.0, support[-1]
        for token, p in zip(support, mass, strict=True):
            cumulative += p
            if cumulative > target:
                expected = token
                break
        assert record.token_id == expected
        assert renormalized_logprob(record) == pytest.approx(lp[expected] - math.log(sum(mass)), abs=1e-5)


def test_draws_follow_renormalized_distribution_exactly() -> None:
    """With u on an even grid, each token's share of draws is its renormalized probability (±1/N)."""
    logits = _logits(3, batch=1)
    row = RowSampling(temperature=0.9, top_p=0.85)
    n = 4000
    grid = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    out = sample_rows(logits.expand(n, V), [row] * n, grid.float(), weight_version=0)
    lp = reference.log_softmax(logits[0].double().tolist(), 0.9)
    support = reference.support(lp, -1, 0.85, 0.0)
    total = sum(math.exp(lp[i]) for i in support)
    counts = torch.bincount(torch.tensor([r.token_id for r in out]), minlength=V)
    assert set(torch.nonzero(counts).flatten().tolist()) == set(support)
    for token in support:
        assert counts[token].item() / n == pytest.approx(math.exp(lp[token]) / total, abs=2.0 / n)


def test_rows_are_independent_of_each_other() -> None:
    """Mixing rules in one batch gives each row what it gets alone."""
    logits = _logits(5)
    rows = [
        RowSampling(temperature=0.0, num_candidates=2),
        RowSampling(top_p=0.5, cover_support=True),
        RowSampling(top_k=3, num_candidates=6),
        RowSampling(temperature=2.0),
    ]
    uniforms = torch.tensor([0.1, 0.2, 0.3, 0.4])
    together = sample_rows(logits, rows, uniforms, weight_version=0)
    for b, row in enumerate(rows):
        (alone,) = sample_rows(logits[b : b + 1], [row], uniforms[b : b + 1], weight_version=0)
        assert together[b].token_id == alone.token_id
        assert together[b].cand_ids == alone.cand_ids
        assert together[b].support_size == alone.support_size


def test_support_cap_acts_as_top_k_when_recording_the_support() -> None:
    logits = torch.zeros(1, V)  # uniform: top-p 0.99 alone keeps 64 tokens
    row = RowSampling(top_p=0.99, cover_support=True, support_cap=10)
    (record,) = sample_rows(logits, [row], torch.tensor([0.999]), weight_version=0)
    assert record.support_size == 10
    assert record.token_id in record.cand_ids[:10]
    assert renormalized_logprob(record) == pytest.approx(math.log(1 / 10), abs=1e-6)


def test_greedy_decoding_truncates_to_the_top_token() -> None:
    """Temperature 0 samples from S = {argmax}: |S| = 1, so the corrections see μ(a) = 1."""
    logits = _logits(3, batch=5)
    records = sample_rows(logits, [RowSampling(temperature=0.0)] * 5, torch.zeros(5), weight_version=0)
    for row, record in zip(logits, records, strict=True):
        assert record.token_id == int(row.argmax())
        assert (record.support_size, record.cand_ids) == (1, [record.token_id])
        assert renormalized_logprob(record) == 0.0


@pytest.mark.parametrize("vocab", [2, 64, 2048, 151_936])
def test_the_fast_sort_is_torchs_stable_descending_sort(vocab: int) -> None:
    """Ties (lower id first), -0.0 beside 0.0, -inf, and a row with a NaN (torch's own sort)."""
    g = torch.Generator().manual_seed(vocab)
    values = torch.log_softmax(torch.randn(6, vocab, generator=g) * 4, dim=-1)
    values[1] = torch.randint(-3, 1, (vocab,), generator=g).float()  # ties everywhere, 0.0 among them
    values[2, ::2] = -0.0
    values[2, 1::2] = 0.0
    values[3, : vocab // 2] = float("-inf")
    values[4] = values[4].round(decimals=1)  # many ties among distinct values
    for rows in (values[:5], values):
        if rows.shape[0] == 6:
            rows[5, 0] = float("nan")
        fast, order = sort_descending(rows)
        ref, ref_order = torch.sort(rows, dim=-1, descending=True, stable=True)
        assert torch.equal(order, ref_order)
        assert torch.equal(fast.nan_to_num(), ref.nan_to_num())


def test_rows_that_do_not_truncate_draw_as_the_truncating_path_would() -> None:
    """The whole-vocabulary shortcut (every row untruncated) gives what the general path gives."""
    logits = _logits(3, batch=6)
    uniforms = torch.tensor([0.0, 0.1, 0.37, 0.5, 0.83, 0.999])
    full = RowSampling(temperature=0.9, num_candidates=3)
    # top_k = V truncates nothing either, but a truncating row in the batch takes the general path
    cut = RowSampling(temperature=0.9, top_k=V, top_p=0.999_999, num_candidates=3)
    alone = sample_rows(logits, [full] * 6, uniforms, weight_version=0)
    mixed = sample_rows(logits, [full] * 5 + [cut], uniforms, weight_version=0)
    assert [r.token_id for r in alone[:5]] == [r.token_id for r in mixed[:5]]
    assert [r.logprob for r in alone[:5]] == [r.logprob for r in mixed[:5]]
    assert all(r.support_size == 0 for r in alone)
