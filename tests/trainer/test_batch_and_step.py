from __future__ import annotations

import copy

import pytest
import torch

from mixrl.api.trajectory import Trajectory
from mixrl.rl.corrections import CorrectionConfig, token_policy_loss
from mixrl.rl.trainer.batch import collate
from mixrl.rl.trainer.torch_backend import OptimizerSettings, TorchPolicyTrainer, split_rows_by_tokens

from .conftest import synthetic_group


def test_collate_positions_advantages_and_staleness(model: torch.nn.Module) -> None:
    groups = [synthetic_group(model, f"p{i}", 4, pool=f"pool{i % 2}", seed=i, version=i) for i in range(3)]
    batch = collate(groups, trainer_version=5)
    # every generated token (6 per trajectory), none of the 2 observation tokens
    assert batch.num_tokens == 3 * 4 * 6
    for n in range(batch.num_tokens):
        row, position = int(batch.loss_tokens.rows[n]), int(batch.loss_tokens.positions[n])
        # the hidden state at t − 1 predicts the token stored at t
        assert int(batch.input_ids[row, position + 1]) == int(batch.loss_tokens.tokens[n])
    rewards = torch.tensor([t.reward for g in groups for t in g])
    for g in range(3):
        group_rows = torch.arange(4 * g, 4 * g + 4)
        expected = (rewards[group_rows] - rewards[group_rows].mean()) / (rewards[group_rows].std() + 1e-6)
        token_adv = batch.loss_tokens.advantages[
            (batch.loss_tokens.rows >= 4 * g) & (batch.loss_tokens.rows < 4 * g + 4)
        ].reshape(4, 6)[:, 0]
        torch.testing.assert_close(token_adv, expected, atol=1e-5, rtol=1e-5)
    assert set(batch.loss_tokens.staleness.tolist()) == {5, 4, 3}
    assert batch.pools == ["pool0", "pool1"]


def test_collate_rejects_ragged_groups(model: torch.nn.Module) -> None:
    groups = [synthetic_group(model, "a", 4, "p", 0), synthetic_group(model, "b", 3, "p", 1)]
    with pytest.raises(ValueError, match="groups must all have 4 trajectories"):
        collate(groups, trainer_version=0)


def test_micro_batches_match_one_big_batch(model: torch.nn.Module) -> None:
    # Gradient accumulation over micro-batches must give the gradient of the whole batch.
    groups = [synthetic_group(model, f"p{i}", 4, "pool", seed=10 + i, noise=0.3) for i in range(2)]
    batch = collate(groups, trainer_version=0)
    grads = []
    for micro_tokens in (10_000, 12):
        trainer = TorchPolicyTrainer(
            copy.deepcopy(model),
            CorrectionConfig(),
            OptimizerSettings(lr=0.0, micro_batch_tokens=micro_tokens),
        )
        assert len(split_rows_by_tokens(batch, micro_tokens)) == (1 if micro_tokens > 1000 else 8)
        trainer.step(batch)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_step_equals_the_objective_on_full_logits(model: torch.nn.Module) -> None:
    groups = [synthetic_group(model, "p", 4, "pool", seed=7, noise=0.5, top_k=5)]
    batch = collate(groups, trainer_version=0)
    config = CorrectionConfig(mis=(0.2, 5.0), score_centering=True, topp_replay=True)
    trainer = TorchPolicyTrainer(
        copy.deepcopy(model), config, OptimizerSettings(lr=0.0, grad_clip=None), chunk_size=7
    )
    result = trainer.step(batch)

    reference = copy.deepcopy(model).requires_grad_(True)
    logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    loss, metrics = token_policy_loss(
        logits[batch.loss_tokens.rows, batch.loss_tokens.positions],
        batch.loss_tokens,
        config,
    )
    loss.backward()
    assert result.loss == pytest.approx(float(loss.detach()), rel=1e-4, abs=1e-6)
    assert result.metrics["kl_k3"] == pytest.approx(metrics.mean["k3"], rel=1e-4, abs=1e-7)
    for (name, p), q in zip(trainer.model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-3, msg=name)


def test_on_policy_data_has_no_mismatch_and_positive_advantage_rises(model: torch.nn.Module) -> None:
    group = synthetic_group(model, "p", 2, "pool", seed=3)
    group[0].reward, group[1].reward = 1.0, 0.0
    batch = collate([group], trainer_version=0)
    trainer = TorchPolicyTrainer(copy.deepcopy(model), CorrectionConfig(), OptimizerSettings(lr=1e-4))

    def logprob_of_winner() -> float:
        with torch.no_grad():
            logits = trainer.model(input_ids=batch.input_ids[:1]).logits[0].float()
        rows = batch.loss_tokens.rows == 0
        lp = torch.log_softmax(logits[batch.loss_tokens.positions[rows]], -1)
        return float(lp.gather(1, batch.loss_tokens.tokens[rows, None]).sum())

    before = logprob_of_winner()
    result = trainer.step(batch)
    assert result.metrics["kl_k3"] < 1e-6 and result.metrics["extreme_ratio"] == 0.0
    assert logprob_of_winner() > before
    assert set(result.per_pool) == {"pool"} and result.per_pool["pool"]["tokens"] == batch.num_tokens


def test_trajectories_round_trip_through_json(model: torch.nn.Module) -> None:
    group = synthetic_group(model, "p", 2, "pool", seed=1, top_k=4)
    again = [Trajectory.model_validate_json(t.model_dump_json()) for t in group]
    assert again == group


def test_fresh_mismatch_counts_only_tokens_of_the_trainers_own_version(model: torch.nn.Module) -> None:
    """kl_k3_fresh is the k3 of staleness-0 tokens alone (the precision effect, apart from drift)."""
    fresh = synthetic_group(model, "p", 2, "a", seed=1, version=3, noise=0.2)
    stale = synthetic_group(model, "q", 2, "b", seed=2, version=2, noise=2.0)
    batch = collate([fresh, stale], trainer_version=3)
    config = CorrectionConfig(mis=(0.2, 5.0))
    result = TorchPolicyTrainer(copy.deepcopy(model), config, OptimizerSettings(lr=0.0)).step(batch)
    pools = result.per_pool
    assert pools["a"]["fresh_tokens"] == pools["a"]["tokens"]
    assert pools["a"]["kl_k3_fresh"] == pytest.approx(pools["a"]["kl_k3"], rel=1e-9)
    assert "kl_k3_fresh" not in pools["b"] and "fresh_tokens" not in pools["b"]  # every token stale
    # The run's fresh figure is pool a's: the noisier stale pool does not raise it.
    assert result.metrics["kl_k3_fresh"] == pytest.approx(pools["a"]["kl_k3"], rel=1e-9)
    assert result.metrics["kl_k3"] > result.metrics["kl_k3_fresh"]
    assert result.metrics["fresh_tokens"] == pools["a"]["tokens"]


def test_mismatch_by_staleness_bins_add_up_to_the_whole_batch(model: torch.nn.Module) -> None:
    groups = [
        synthetic_group(
            model, f"p{version}", 2, pool, seed=version, version=version, noise=0.5 * (5 - version)
        )
        for version, pool in ((5, "a"), (4, "a"), (3, "b"), (1, "b"))
    ]
    result = TorchPolicyTrainer(copy.deepcopy(model), CorrectionConfig(), OptimizerSettings(lr=0.0)).step(
        collate(groups, trainer_version=5)
    )
    run_bins = result.metrics["by_staleness"]
    assert set(run_bins) == {"0", "1", "2", "3+"}  # lags 0, 1, 2 and 4
    assert set(result.per_pool["a"]["by_staleness"]) == {"0", "1"}
    assert set(result.per_pool["b"]["by_staleness"]) == {"2", "3+"}
    for key in ("kl_k3", "kl_k1", "extreme_ratio"):
        tokens = sum(b["tokens"] for b in run_bins.values())
        pooled = sum(b[key] * b["tokens"] for b in run_bins.values()) / tokens
        assert pooled == pytest.approx(result.metrics[key], rel=1e-6, abs=1e-9)
    assert result.metrics["kl_k1_fresh"] == pytest.approx(run_bins["0"]["kl_k1"])


def test_a_collective_whose_peer_died_is_not_the_batchs_fault() -> None:
    from mixrl.rl.trainer.main import not_the_batch

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error"
        " [127.0.0.1]:6277: Connection reset by peer."
    )
    assert not_the_batch(gloo)  # the restarted trainer redoes the step on the same batch
    assert not_the_batch(OSError("disk full"))
    assert not not_the_batch(RuntimeError("shape mismatch in the loss"))  # the batch's: quarantined
    assert not not_the_batch(ValueError("Connection reset by peer"))  # only a collective's RuntimeError
