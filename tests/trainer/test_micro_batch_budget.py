"""``trainer.microBatchTokens`` bounds what one forward computes: rows × the longest row, since a
micro-batch is right-padded to its longest trajectory.  The split counted the rows' own lengths, so
many short trajectories beside one long one made a micro-batch many times the budget (an
out-of-memory error, which is not the batch's fault: the restarted trainer redid the same step on
the same batch, and ran out of memory again, for good)."""

from __future__ import annotations

import copy

import torch

from mixrl.rl.corrections import CorrectionConfig
from mixrl.rl.trainer.batch import collate
from mixrl.rl.trainer.torch_backend import OptimizerSettings, TorchPolicyTrainer, split_rows_by_tokens

from .conftest import synthetic_group

BUDGET = 320


def test_no_micro_batch_computes_more_than_the_budget_and_the_gradient_is_the_same(
    model: torch.nn.Module,
) -> None:
    short = synthetic_group(model, "short", 6, "pool", seed=1)  # 11 tokens each
    long = synthetic_group(model, "long", 6, "pool", seed=2)
    long[5].append_observation([7] * 180)  # one trajectory of 191 tokens, after five short ones
    batch = collate([short, long], trainer_version=0)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    assert sum(lengths) <= BUDGET  # the old split: all twelve rows in one pass, 12 × 191 positions
    micro = split_rows_by_tokens(batch, BUDGET)
    assert sorted(row for rows in micro for row in rows) == list(range(len(lengths)))
    for rows in micro:
        assert len(rows) * max(lengths[row] for row in rows) <= BUDGET, (rows, lengths)
    grads = []
    for budget in (BUDGET, 100_000):
        trainer = TorchPolicyTrainer(
            copy.deepcopy(model), CorrectionConfig(), OptimizerSettings(lr=0.0, micro_batch_tokens=budget)
        )
        trainer.step(batch)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)
