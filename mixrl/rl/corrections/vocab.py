"""The tensor-parallel seam: every reduction over the vocabulary goes through :class:`VocabShard`.

Under tensor parallelism (Megatron's vocab-parallel output layer) each rank holds the logits of a
contiguous slice ``[start, start + size)`` of the vocabulary.  The objective touches the vocabulary
only through three operations — a row max, row sums, and the gather of a few given ids' logits —
and each becomes an all-reduce across ``group`` when one is given.  Without a group the shard is the
whole vocabulary and nothing is communicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary and the process group that holds the other slices."""

    start: int
    size: int
    group: dist.ProcessGroup | None = None

    def all_max(self, x: Tensor) -> Tensor:
        """Element-wise max across the shards (in place when distributed)."""
        if self.group is not None:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_sum(self, x: Tensor) -> Tensor:
        """Element-wise sum across the shards (in place when distributed)."""
        if self.group is not None:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def local_positions(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Column of each global id in this shard, and whether the shard holds it.

        Ids the shard does not hold (including the padding id -1) get column 0 and ``False``.
        """
        pos = ids - self.start
        here = (pos >= 0) & (pos < self.size)
        return torch.where(here, pos, torch.zeros_like(pos)), here

    def local_gather(self, z: Tensor, ids: Tensor) -> Tensor:
        """``z[row, id]`` for the ids this shard holds, 0 for the others.

        Summing this across the shards (:meth:`all_sum`) yields every id's value exactly, because
        exactly one shard contributes a non-zero term.
        """
        pos, here = self.local_positions(ids)
        return torch.where(here, z.gather(1, pos), torch.zeros((), dtype=z.dtype, device=z.device))

    def flat_positions(self, ids: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """Flat offsets into a contiguous ``[rows, size]`` block of the entries ``ids`` names.

        Returns the offsets of the entries this shard holds and ``keep`` allows, and the boolean
        selector of those entries (to pick their values out of a same-shaped tensor).
        """
        pos, here = self.local_positions(ids)
        rows = torch.arange(ids.shape[0], device=ids.device).view(-1, *([1] * (ids.dim() - 1)))
        selected = here & keep
        return (rows * self.size + pos)[selected], selected


def global_vocab_size(shard: VocabShard, device: torch.device) -> int:
    """Size of the whole vocabulary: the shards' sizes summed across the group."""
    if shard.group is None:
        return shard.start + shard.size
    total = torch.tensor([shard.size], dtype=torch.int64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=shard.group)
    return int(total.item())
