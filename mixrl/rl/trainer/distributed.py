"""Data parallelism for the torch trainer: ``torch.distributed`` process groups and FSDP2.

A trainer of ``trainer.nodes × trainer.gpusPerNode`` processes is started by ``torchrun`` (locally
by ``mixrl run``, in a cluster by the operator); each process reads its rank from torchrun's
environment (:meth:`Ranks.from_env`).  With more than one rank the model is sharded with FSDP2
(``fully_shard`` on every decoder layer and on the root, so parameters, gradients and AdamW's
state are split across ranks), and each rank computes the corrected loss on its share of the
step's trajectories (:func:`shard_rows`).

What keeps a step's meaning independent of the number of ranks:
- the loss denominator is the whole batch's token count (:func:`all_reduce_sum` of the shares), and
  gradients are *summed* across ranks (FSDP's averaging is switched off), so the gradient is the
  single-process gradient;
- every rank runs the same number of forward/backward passes (FSDP's all-gathers are collective):
  a rank with fewer micro-batches runs empty ones (:func:`agree_on_count`);
- metrics are reduced as sums and counts, never as per-rank means.

CPU uses the gloo backend and GPUs NCCL; the code is the same.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process's place in the trainer group (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes what the group writes once: published weights, metrics, buffer commits."""
        return self.rank == 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Ranks:
        """torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (absent: a single process)."""
        environ = os.environ if environ is None else environ
        try:
            ranks = cls(
                rank=int(environ.get("RANK", "0")),
                world_size=int(environ.get("WORLD_SIZE", "1")),
                local_rank=int(environ.get("LOCAL_RANK", "0")),
            )
        except ValueError as exc:
            raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK: not integers ({exc})") from None
        if ranks.world_size < 1 or not 0 <= ranks.rank < ranks.world_size:
            raise ValueError(f"RANK={ranks.rank} WORLD_SIZE={ranks.world_size}: rank outside the group")
        return ranks


def device_for(ranks: Ranks) -> torch.device:
    """This rank's GPU when there are GPUs (``LOCAL_RANK`` picks it), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", ranks.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


_collectives_on = torch.device("cpu")
"""Where this process's collectives put their tensors: NCCL reduces only GPU tensors, gloo CPU ones."""


def init_process_group(ranks: Ranks, device: torch.device) -> None:
    """Join the group torchrun set up (``MASTER_ADDR``/``MASTER_PORT``) over NCCL on GPUs and gloo
    on CPUs; nothing for one process.  Collectives put their tensors on ``device`` from now on, also
    those of a group of one made later (:func:`init_group_of_one`)."""
    global _collectives_on
    _collectives_on = device
    if not ranks.distributed or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", device_id=None)


def init_group_of_one(device: torch.device) -> None:
    """A process group of this process alone, over NCCL on a GPU and gloo on the CPU, its
    collectives' tensors on ``device`` (megatron-core needs a group even for one process)."""
    global _collectives_on
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _collectives_on = device


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_model(root: torch.nn.Module, decoder: torch.nn.Module, param_dtype: torch.dtype) -> torch.nn.Module:
    """FSDP2 over all ranks: each of ``decoder.layers`` one unit, ``root`` (which holds the decoder,
    the embeddings, the final norm and the head) another.

    ``param_dtype`` is the compute dtype (BF16 for ``precision: bf16``); the sharded master weights
    stay in their dtype (FP32) and gradients are reduced in FP32.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in decoder.get_submodule("layers").children():
        fully_shard(layer, mp_policy=policy)
    fully_shard(root, mp_policy=policy)
    assert isinstance(root, FSDPModule)
    # Each rank's loss is already divided by the whole batch's token count: sum, don't average.
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return root


def shard_rows(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """The batch's rows (trajectories) dealt to ranks so that each gets about as many tokens.

    Longest first to the rank with the fewest tokens so far (ties: the lower rank), then each
    rank's rows in batch order.  Deterministic: every rank computes the same split.
    """
    shares: list[list[int]] = [[] for _ in range(world_size)]
    tokens = [0] * world_size
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        lightest = min(range(world_size), key=lambda k: (tokens[k], k))
        shares[lightest].append(row)
        tokens[lightest] += lengths[row]
    return [sorted(rows) for rows in shares]


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """The element-wise sum over ranks (``values`` itself for one process)."""
    if not dist.is_initialized():
        return values
    reduced = values.detach().to(_collectives_on, torch.float64, copy=True)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced.to(values.device, values.dtype)


def _max_over_ranks(values: list[int]) -> list[int]:
    """The element-wise maximum over ranks (``values`` itself without a group)."""
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=_collectives_on)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def agree_on_count(count: int) -> int:
    """The largest ``count`` over ranks: how many passes every rank runs."""
    (largest,) = _max_over_ranks([count])
    return largest


def any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each flag ORed over ranks (the flags themselves for one process): a decision every rank then
    takes alike, such as stopping after the same step."""
    return tuple(bool(v) for v in _max_over_ranks([int(flag) for flag in flags]))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
