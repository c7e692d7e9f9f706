"""The data-parallel pieces that need no other process: ranks from torchrun's environment, the deal
of a batch's rows to ranks, and a group of one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixrl.rl.trainer.distributed import (
    Ranks,
    agree_on_count,
    any_rank,
    destroy_process_group,
    init_group_of_one,
    shard_rows,
)


def test_ranks_come_from_torchruns_environment() -> None:
    assert Ranks.from_env({}) == Ranks(0, 1, 0)
    ranks = Ranks.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert ranks == Ranks(3, 4, 1) and ranks.distributed and not ranks.is_main
    with pytest.raises(ValueError, match="rank outside the group"):
        Ranks.from_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="not integers"):
        Ranks.from_env({"RANK": "zero"})


@settings(max_examples=100)  # hypothesis' default, named: a pure function, ~1 ms a case
@given(st.lists(st.integers(0, 500), max_size=40), st.integers(1, 8))
def test_every_row_goes_to_one_rank_and_shares_are_balanced(lengths: list[int], world: int) -> None:
    shares = shard_rows(lengths, world)
    assert len(shares) == world
    assert sorted(r for share in shares for r in share) == list(range(len(lengths)))
    assert all(share == sorted(share) for share in shares)
    tokens = [sum(lengths[r] for r in share) for share in shares]
    # Longest-first to the lightest rank: no rank exceeds another by more than the longest row.
    assert max(tokens) - min(tokens) <= max(lengths, default=0)
    assert shard_rows(lengths, world) == shares  # every rank computes the same deal


def test_a_single_rank_takes_the_whole_batch_in_order() -> None:
    assert shard_rows([5, 1, 9], 1) == [[0, 1, 2]]
    assert shard_rows([5, 1, 9, 4], 2) == [[1, 2], [0, 3]]  # 9+1 and 5+4 tokens


def test_a_group_of_one_agrees_with_itself() -> None:
    """megatron-core's group of one process (gloo here, NCCL on a GPU): the collectives the loop and
    the checkpoints use answer this process's own values."""
    init_group_of_one(torch.device("cpu"))
    try:
        assert any_rank(True, False) == (True, False)
        assert agree_on_count(3) == 3
    finally:
        destroy_process_group()
    assert any_rank(False, True) == (False, True)  # no group: the values themselves
