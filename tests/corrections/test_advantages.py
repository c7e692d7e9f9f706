"""GRPO group advantages against a plain per-group float64 computation."""

from __future__ import annotations

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixrl.rl.corrections import grpo_advantages, token_advantages


@settings(max_examples=50, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.floats(-10, 10, allow_nan=False), min_size=4, max_size=4), min_size=1, max_size=6
    ),
    normalize=st.booleans(),
)
def test_group_advantages_match_plain_python(groups: list[list[float]], normalize: bool) -> None:
    flat = torch.tensor([r for g in groups for r in g], dtype=torch.float64)
    got = grpo_advantages(flat, 4, normalize_std=normalize)
    want = []
    for g in groups:
        mean = statistics.fmean(g)
        std = statistics.stdev(g)
        want += [(r - mean) / (std + 1e-6) if normalize else r - mean for r in g]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=2e-5)


def test_equal_rewards_give_zero_advantage_and_layout_is_group_after_group() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    adv = grpo_advantages(rewards, 3)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert adv[4] > 0 > adv[3] and adv[3] == adv[5]
    assert grpo_advantages(rewards, 2)[0] == 0.0 and grpo_advantages(rewards, 2)[2] > 0


@pytest.mark.parametrize("reward, size", [(0.7, 8), (1 / 3, 8), (0.1, 16), (0.1, 3)])
@pytest.mark.parametrize("normalize", [True, False])
def test_equal_fractional_rewards_give_exactly_zero(reward: float, size: int, normalize: bool) -> None:
    """Their float32 mean is off by an ulp, and dividing by a std of that size made it 3–6 % of a
    typical advantage, of one sign, on every such group."""
    rewards = torch.tensor([reward] * size + [0.0] * (size - 1) + [1.0])  # then a group that differs
    advantages = grpo_advantages(rewards, size, normalize_std=normalize)
    assert torch.equal(advantages[:size], torch.zeros(size))
    assert advantages[-1] > 0


def test_token_advantages_broadcast() -> None:
    adv = torch.tensor([0.5, -1.0, 2.0])
    out = token_advantages(adv, torch.tensor([2, 0, 3]))
    assert out.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="tokens_per_sample must match"):
        token_advantages(adv, torch.tensor([1, 2]))
