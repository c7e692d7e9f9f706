"""From trajectories to the tensors the objective needs (pure: no I/O, no model).

Layout: every trajectory is one row of ``input_ids`` = prompt + all later tokens, right-padded.
A generated token at sequence position t is predicted from the hidden state at t − 1, so
``positions`` holds (row, t − 1) for each loss token.  Per-token tensors are flat over the batch,
in row-major order: a :class:`BatchTokens`, the record ``token_policy_loss`` takes plus where each
token sits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from mixrl.api.trajectory import Trajectory
from mixrl.rl.corrections import LossTokens, grpo_advantages


@dataclass(frozen=True)
class BatchTokens(LossTokens):
    """The batch's loss tokens, row-major: their record (what the objective takes, as it is) and
    where each sits in the batch."""

    rows: torch.Tensor
    """[N] the row (trajectory) of each generated token."""
    positions: torch.Tensor
    """[N] the position whose hidden state predicts it (t − 1)."""
    pool_index: torch.Tensor
    """[N] index into :attr:`PolicyBatch.pools`."""
    staleness: torch.Tensor
    """[N] long: trainer version − the token's weight version."""


@dataclass
class PolicyBatch:
    input_ids: torch.Tensor  # [B, T] long, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, T] long
    loss_tokens: BatchTokens
    pools: list[str]
    rewards: torch.Tensor  # [B] float32, per trajectory
    trajectory_pool: torch.Tensor  # [B] pool index per trajectory

    @property
    def num_tokens(self) -> int:
        return int(self.loss_tokens.tokens.numel())

    def to(self, device: torch.device) -> PolicyBatch:
        """The tensors the forward and the loss read, on ``device`` (the rest stays where it is)."""
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            loss_tokens=self.loss_tokens.to(device),
        )

    def select_rows(self, rows: Sequence[int]) -> PolicyBatch:
        """A micro-batch: the given trajectories, with their tokens, re-indexed from row 0."""
        index = torch.tensor(list(rows), dtype=torch.long)
        remap = torch.full((self.input_ids.shape[0],), -1, dtype=torch.long)
        remap[index] = torch.arange(len(index))
        kept = self.loss_tokens.take(remap[self.loss_tokens.rows] >= 0)
        lengths = self.attention_mask[index].sum(dim=1)
        width = int(lengths.max()) if len(index) else 0
        return PolicyBatch(
            input_ids=self.input_ids[index, :width],
            attention_mask=self.attention_mask[index, :width],
            loss_tokens=replace(kept, rows=remap[kept.rows]),
            pools=self.pools,
            rewards=self.rewards[index],
            trajectory_pool=self.trajectory_pool[index],
        )


def collate(
    groups: Sequence[Sequence[Trajectory]],
    *,
    trainer_version: int,
    pad_id: int = 0,
    normalize_std: bool = True,
) -> PolicyBatch:
    """Groups of trajectories (one group per prompt, equal sizes) -> one PolicyBatch."""
    if not groups:
        raise ValueError("collate: no groups")
    group_size = len(groups[0])
    if any(len(g) != group_size for g in groups):
        raise ValueError(f"collate: groups must all have {group_size} trajectories")
    trajectories = [t for group in groups for t in group]
    if any(t.reward is None for t in trajectories):
        raise ValueError("collate: every trajectory needs a reward")
    rewards = torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32)  # type: ignore[arg-type]
    advantages_per_row = grpo_advantages(rewards, group_size, normalize_std=normalize_std)

    pools = sorted({t.pool for t in trajectories})
    pool_of = {name: i for i, name in enumerate(pools)}
    k = max((len(c) for t in trajectories for c in t.cand_ids), default=0)
    width = max(len(t.prompt_ids) + len(t.tokens) for t in trajectories)

    input_ids = torch.full((len(trajectories), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(trajectories), width), dtype=torch.long)
    rows, positions, tokens, advantages, logprobs, support, pool_index, staleness = ([] for _ in range(8))
    cand_ids: list[list[int]] = []
    cand_logprobs: list[list[float]] = []
    for row, trajectory in enumerate(trajectories):
        sequence = trajectory.prompt_ids + trajectory.tokens
        input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, : len(sequence)] = 1
        offset = len(trajectory.prompt_ids)
        for i, mask in enumerate(trajectory.loss_mask):
            if not mask:
                continue
            rows.append(row)
            positions.append(offset + i - 1)
            tokens.append(trajectory.tokens[i])
            advantages.append(float(advantages_per_row[row]))
            logprobs.append(trajectory.logprobs[i])
            support.append(trajectory.support_size[i])
            pool_index.append(pool_of[trajectory.pool])
            staleness.append(trainer_version - trajectory.weight_version[i])
            pad = k - len(trajectory.cand_ids[i])
            cand_ids.append(trajectory.cand_ids[i] + [-1] * pad)
            cand_logprobs.append(trajectory.cand_logprobs[i] + [float("-inf")] * pad)
    if positions and min(positions) < 0:
        raise ValueError("collate: a generated token has no preceding context (empty prompt)")
    return PolicyBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_tokens=BatchTokens(
            rows=torch.tensor(rows, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            tokens=torch.tensor(tokens, dtype=torch.long),
            advantages=torch.tensor(advantages, dtype=torch.float32),
            sampler_logprobs=torch.tensor(logprobs, dtype=torch.float32),
            cand_ids=torch.tensor(cand_ids, dtype=torch.long).reshape(len(tokens), k),
            cand_logprobs=torch.tensor(cand_logprobs, dtype=torch.float32).reshape(len(tokens), k),
            support_size=torch.tensor(support, dtype=torch.long),
            pool_index=torch.tensor(pool_index, dtype=torch.long),
            staleness=torch.tensor(staleness, dtype=torch.long),
        ),
        pools=pools,
        rewards=rewards,
        trajectory_pool=torch.tensor([pool_of[t.pool] for t in trajectories], dtype=torch.long),
    )
