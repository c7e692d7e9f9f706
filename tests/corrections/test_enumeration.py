"""Exact expectations under μ, by enumerating every token of a small vocabulary (docs/corrections.md).

For one position we call the objective once per possible sampled token a (with its recorded
log q(a)) and weight each gradient by μ(a).  The closed forms below are written from the design's
statements (E_μ[w ∇log π], ∇_z log π(b) = e_b − π), independently of the implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from mixrl.rl.corrections import CorrectionConfig, LossTokens, token_policy_loss

VOCAB = 7
K = 4  # K < V: under whole-vocabulary sampling three tokens are unrecorded
SUPPORT = 3
TIS_CAP = 1.5
MIS_RANGE = (0.2, 5.0)


@dataclass(frozen=True)
class Position:
    z: Tensor  # [V] trainer logits
    log_q: Tensor  # [V] the sampler's full distribution
    cand_ids: Tensor  # [K] top-K of q, descending
    support: int  # |S|, 0 = whole vocabulary

    @property
    def cand_logprobs(self) -> Tensor:
        return self.log_q[self.cand_ids]

    @property
    def support_ids(self) -> Tensor:
        return self.cand_ids[: self.support] if self.support else torch.arange(VOCAB)

    def mu(self) -> Tensor:
        """Behaviour distribution over the vocabulary: q, or q renormalized on S."""
        q = self.log_q.exp()
        if not self.support:
            return q
        mu = torch.zeros(VOCAB, dtype=torch.float64)
        mu[self.support_ids] = q[self.support_ids] / q[self.support_ids].sum()
        return mu

    def pi(self, replay: bool) -> Tensor:
        """Trainer distribution: p, or p renormalized on S under mask replay."""
        if replay and self.support:
            masked = torch.full((VOCAB,), float("-inf"), dtype=torch.float64)
            masked[self.support_ids] = self.z[self.support_ids]
            return masked.softmax(0)
        return self.z.softmax(0)


def make_position(seed: int, support: int) -> Position:
    """A position whose sampler disagrees with the trainer enough that some ratios leave [0.2, 5].

    Under whole-vocabulary sampling the sampler's unrecorded tail is made proportional to p
    (q(b) = p(b)(1 − Q_C)/(1 − P_C)), the case in which the design's μ for unrecorded tokens is exact.
    """
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5
    log_q = torch.log_softmax(z + 2.0 * torch.randn(VOCAB, generator=g, dtype=torch.float64), 0)
    cand_ids = log_q.topk(K).indices
    if not support:
        p, q = z.softmax(0), log_q.exp()
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[cand_ids] = False
        q = torch.where(outside, p * (1 - q[cand_ids].sum()) / p[outside].sum(), q)
        log_q = q.log()
        cand_ids = cand_ids[log_q[cand_ids].argsort(descending=True)]
    return Position(z, log_q, cand_ids, support)


def mixed_position(support: int) -> Position:
    """The first seed whose enumerated ratios fall both inside and outside every tested range."""
    for seed in range(1000):
        pos = make_position(seed, support)
        for replay in (False, True):
            r = pos.pi(replay)[pos.support_ids] / pos.mu()[pos.support_ids]
            inside = (r >= MIS_RANGE[0]) & (r <= MIS_RANGE[1])
            if not (inside.any() and (~inside).any() and (r > TIS_CAP).any() and (r < TIS_CAP).any()):
                break
        else:
            return pos
    raise AssertionError("no seed gives mixed ratios")


def grad_for_token(pos: Position, a: int, advantage: float, config: CorrectionConfig) -> Tensor:
    z = pos.z.clone()[None].requires_grad_(True)
    record = LossTokens(
        tokens=torch.tensor([a]),
        advantages=torch.tensor([advantage], dtype=torch.float64),
        sampler_logprobs=pos.log_q[a : a + 1],
        cand_ids=pos.cand_ids[None],
        cand_logprobs=pos.cand_logprobs[None],
        support_size=torch.tensor([pos.support]),
    )
    loss, _ = token_policy_loss(z, record, config)
    loss.backward()
    assert z.grad is not None
    return z.grad[0]


def enumerated_expectation(pos: Position, advantages: Tensor, config: CorrectionConfig) -> Tensor:
    """Σ_a μ(a) ∇_z loss(a): the expected gradient of the loss, one call per token."""
    mu = pos.mu()
    total = torch.zeros(VOCAB, dtype=torch.float64)
    for a in pos.support_ids.tolist():
        total += mu[a] * grad_for_token(pos, a, float(advantages[a]), config)
    return total


def weight(r: Tensor, config: CorrectionConfig) -> Tensor:
    if config.mis is not None:
        return torch.where((r >= config.mis[0]) & (r <= config.mis[1]), r, 0.0)
    if config.tis is not None:
        return r.clamp(max=config.tis)
    return torch.ones_like(r)


def closed_form(pos: Position, advantages: Tensor, config: CorrectionConfig) -> Tensor:
    """−E_{a~μ}[A(a) (w(a) ∇log π(a) − SC)], SC's gradient = E_{b~μ}[w(b) ∇log π(b)]."""
    mu, pi = pos.mu(), pos.pi(config.topp_replay)
    support = pos.support_ids
    grad_log_pi = torch.eye(VOCAB, dtype=torch.float64) - pi[None]  # row b: ∇_z log π(b)
    w = torch.zeros(VOCAB, dtype=torch.float64)
    w[support] = weight(pi[support] / mu[support], config)
    expected_update = ((mu * advantages * w)[:, None] * grad_log_pi).sum(0)
    if config.score_centering:
        centering = ((mu * w)[:, None] * grad_log_pi).sum(0)
        expected_update = expected_update - (mu * advantages).sum() * centering
    return -expected_update


CONFIGS = {
    "grpo": dict(mis=None, score_centering=False),
    "tis": dict(mis=None, tis=TIS_CAP, score_centering=False),
    "mis": dict(mis=MIS_RANGE, score_centering=False),
    "sc": dict(mis=None, score_centering=True),
    "sc+mis": dict(mis=MIS_RANGE, score_centering=True),
    "sc+tis": dict(mis=None, tis=TIS_CAP, score_centering=True),
}


@pytest.mark.parametrize("support", [0, SUPPORT], ids=["whole-vocab-K<V", "top-p"])
@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_expected_gradient_matches_closed_form(name: str, replay: bool, support: int) -> None:
    config = CorrectionConfig(**CONFIGS[name], topp_replay=replay)
    pos = mixed_position(support)
    advantages = torch.linspace(-1.0, 2.0, VOCAB, dtype=torch.float64)  # A depends on the token
    enumerated = enumerated_expectation(pos, advantages, config)
    expected = closed_form(pos, advantages, config)
    assert expected.abs().max() > 1e-3  # the comparison is not between two zeros
    torch.testing.assert_close(enumerated, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("support", [0, SUPPORT], ids=["whole-vocab-K<V", "top-p"])
@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
@pytest.mark.parametrize("name", ["sc", "sc+mis", "sc+tis"])
def test_centering_has_zero_expected_update_for_constant_advantage(
    name: str, replay: bool, support: int
) -> None:
    config = CorrectionConfig(**CONFIGS[name], topp_replay=replay)
    pos = mixed_position(support)
    constant = torch.full((VOCAB,), 1.7, dtype=torch.float64)
    assert enumerated_expectation(pos, constant, config).abs().max() < 1e-6
    # The same weights without centering do move the logits: the zero above is centering's doing.
    uncentered = CorrectionConfig(**{**CONFIGS[name], "score_centering": False}, topp_replay=replay)
    assert enumerated_expectation(pos, constant, uncentered).abs().max() > 1e-3


@pytest.mark.parametrize("support", [0, SUPPORT], ids=["whole-vocab-K<V", "top-p"])
@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
def test_mis_expected_update_is_on_policy_gradient_on_kept_tokens(replay: bool, support: int) -> None:
    config = CorrectionConfig(mis=MIS_RANGE, score_centering=False, topp_replay=replay)
    pos = mixed_position(support)
    advantages = torch.linspace(-1.0, 2.0, VOCAB, dtype=torch.float64)
    pi, mu = pos.pi(replay), pos.mu()
    on_policy = torch.zeros(VOCAB, dtype=torch.float64)
    for a in pos.support_ids.tolist():
        r = pi[a] / mu[a]
        if MIS_RANGE[0] <= r <= MIS_RANGE[1]:
            on_policy += pi[a] * advantages[a] * (torch.eye(VOCAB, dtype=torch.float64)[a] - pi)
    torch.testing.assert_close(
        enumerated_expectation(pos, advantages, config), -on_policy, rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_replay_leaves_logits_outside_the_support_untouched(name: str) -> None:
    pos = mixed_position(SUPPORT)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[pos.support_ids] = False
    moved_inside, moved_without_replay = 0.0, 0.0
    for a in pos.support_ids.tolist():
        grad = grad_for_token(pos, a, 0.8, CorrectionConfig(**CONFIGS[name], topp_replay=True))
        assert torch.equal(grad[outside], torch.zeros(int(outside.sum()), dtype=torch.float64))
        moved_inside = max(moved_inside, float(grad[pos.support_ids].abs().max()))
        free = grad_for_token(pos, a, 0.8, CorrectionConfig(**CONFIGS[name], topp_replay=False))
        moved_without_replay = max(moved_without_replay, float(free[outside].abs().max()))
    assert moved_inside > 1e-3
    if name != "sc":  # SC alone has w = 1 and Σc = 1, so (w − Σc)π = 0 moves nothing outside S anyway
        assert moved_without_replay > 1e-3  # without replay the same calls do move them
