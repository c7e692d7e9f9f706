"""The torch trainer: π recomputed on exactly the sampled ids, the corrected objective, AdamW.

The model is a ``transformers`` causal LM.  Hidden states come from the base model and the
objective computes logits chunk by chunk against the LM head (``chunked_token_policy_loss``), so
a batch never materializes [tokens × vocabulary] logits; the log-softmax and everything after it
run in FP32 whatever the compute dtype.  Master weights, gradients and AdamW's state are FP32;
the model computes in ``compute_dtype`` (BF16 on GPUs, as the seed's trainer does; FP32 on CPUs,
where a BF16 step took 3.8× an FP32 one in bench/trainer.py) on ``device``, and every published version is
BF16.  One process computes under ``torch.autocast``; with more than one rank (``torchrun``) the
model is sharded with FSDP2, whose mixed-precision policy casts the gathered weights to
``compute_dtype`` and reduces gradients in FP32, each rank taking its share of the step's
trajectories (:mod:`mixrl.rl.trainer.distributed`).  Checkpoints are sharded: each rank saves and
loads only the state it holds, on any number of ranks (:mod:`mixrl.rl.trainer.checkpoint`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from mixrl.rl.corrections import CorrectionConfig, chunked_token_policy_loss
from mixrl.rl.corrections.diagnostics import METRIC_KEYS
from mixrl.rl.trainer import checkpoint, distributed
from mixrl.rl.trainer.batch import PolicyBatch
from mixrl.rl.trainer.distributed import Ranks

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class OptimizerSettings:
    """What both backends' trainers take from the spec's optimizer and trainer: AdamW's settings,
    gradient clipping, the sampling temperature the loss divides the logits by, and the micro-batch
    size of gradient accumulation."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    """The gradient norm's bound; None: no clipping."""
    temperature: float = 1.0
    micro_batch_tokens: int = 16384


def apply_settings(param_groups: Iterable[dict[str, Any]], settings: OptimizerSettings) -> None:
    """The spec's lr, betas and weight decay on every param group, after a load (both backends).

    An optimizer's state dict carries its param groups, so a loaded checkpoint would bring back
    the settings of the run that wrote it over a spec changed since (an lr lowered before a
    restart); only the moments and step counters are the checkpoint's.  ``max_lr``, where a group
    has it (megatron-core's, the lr its schedulers start from), is the spec's lr too, as a fresh
    optimizer has it: mixrl runs no scheduler."""
    for group in param_groups:
        group["lr"] = settings.lr
        group["betas"] = settings.betas
        group["weight_decay"] = settings.weight_decay
        if "max_lr" in group:
            group["max_lr"] = settings.lr


class NonFiniteGradient(RuntimeError):
    """A step's gradient norm is NaN or infinite (an overflow in the forward, a diverging batch):
    the update is skipped, so neither the weights nor AdamW's moments take it in, and no poisoned
    version is ever published.  The loop quarantines the batch (mixrl.rl.trainer.main)."""


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int
    seconds: float
    metrics: dict[str, float]
    per_pool: dict[str, dict[str, float]] = field(default_factory=dict)


def split_rows_by_tokens(batch: PolicyBatch, micro_batch_tokens: int) -> list[list[int]]:
    """Greedy consecutive micro-batches of whole trajectories, each at most ~micro_batch_tokens
    positions as the forward computes them: its rows × its longest row (it is right-padded to it),
    not the sum of the rows' lengths, which short rows beside a long one leave far below that.
    A row longer than the budget is a micro-batch of its own."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    micro: list[list[int]] = [[]]
    width = 0
    for row, length in enumerate(lengths):
        width = max(width, length)
        if micro[-1] and (len(micro[-1]) + 1) * width > micro_batch_tokens:
            micro.append([])
            width = length
        micro[-1].append(row)
    return micro


class PolicyTrunk(torch.nn.Module):
    """The causal LM up to its head: the hidden states at the loss positions, and the head's weight.

    One module whose forward yields both, so that FSDP gathers the embeddings, the final norm and
    the (possibly tied) head together for the loss, which multiplies hidden states by the head
    chunk by chunk itself.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = decoder_of(self.model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = out.last_hidden_state[rows, positions]
        # Under autocast the hidden states come out in the compute dtype and the FP32 head does
        # not: cast it (in the graph, so its gradient reaches the FP32 weight).  FSDP's gathered
        # head already has the compute dtype, and the cast is a no-op.
        return hidden, self.model.get_output_embeddings().weight.to(hidden.dtype)


def decoder_of(model: PreTrainedModel) -> torch.nn.Module:
    decoder: torch.nn.Module = model.get_decoder()
    return decoder


class TorchPolicyTrainer:
    def __init__(
        self,
        model: PreTrainedModel,
        corrections: CorrectionConfig,
        settings: OptimizerSettings,
        *,
        chunk_size: int = 1024,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        self.ranks = ranks or Ranks()
        self.device = device or torch.device("cpu")
        self.compute_dtype = compute_dtype
        module: torch.nn.Module = model  # transformers' wrapped .to() hides nn.Module's signature
        module.to(self.device, torch.float32)  # FP32 master weights, in place
        self.model = model
        self.trunk: torch.nn.Module = PolicyTrunk(self.model)
        if self.ranks.distributed:  # sharded; FSDP casts to compute_dtype when it gathers
            self.trunk = distributed.shard_model(self.trunk, decoder_of(self.model), compute_dtype)
        self.model.train()
        self.model.requires_grad_(True)
        self.corrections = corrections
        self.settings = settings
        self.chunk_size = chunk_size
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=settings.lr,
            betas=settings.betas,
            weight_decay=settings.weight_decay,
        )

    def step(self, batch: PolicyBatch) -> StepResult:
        """One policy update on a whole batch (gradient accumulation over micro-batches).

        With several ranks each takes its share of the trajectories; the loss is divided by the
        whole batch's token count everywhere, and gradients are summed across ranks, so the update
        is the single-process one.
        """
        start = time.perf_counter()
        local = batch
        if self.ranks.distributed:
            lengths = batch.attention_mask.sum(dim=1).tolist()
            local = batch.select_rows(distributed.shard_rows(lengths, self.ranks.world_size)[self.ranks.rank])
        total_tokens = max(batch.num_tokens, 1)  # every rank holds the whole batch: no reduction needed
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        per_token: dict[str, list[torch.Tensor]] = {}
        pool_index: list[torch.Tensor] = []
        staleness: list[torch.Tensor] = []
        micro_batches = [
            micro
            for rows in split_rows_by_tokens(local, self.settings.micro_batch_tokens)
            if rows and (micro := local.select_rows(rows)).num_tokens > 0
        ]
        # FSDP's gathers are collective: every rank runs as many passes as the busiest one.
        for index in range(distributed.agree_on_count(len(micro_batches))):
            if index >= len(micro_batches):
                self._empty_pass()
                continue
            pool_index.append(micro_batches[index].loss_tokens.pool_index)  # on the CPU, for the sums
            staleness.append(micro_batches[index].loss_tokens.staleness)
            micro = micro_batches[index].to(self.device)
            tokens = micro.loss_tokens
            hidden, head = self._forward(micro.input_ids, micro.attention_mask, tokens.rows, tokens.positions)
            loss, metrics = chunked_token_policy_loss(
                hidden,
                head,
                tokens,
                self.corrections,
                chunk_size=self.chunk_size,
                temperature=self.settings.temperature,
                num_loss_tokens=total_tokens,  # the denominator is the whole batch's token count
            )
            loss.backward()
            loss_sum += loss.detach().double().cpu()
            for name, values in metrics.per_token.items():
                per_token.setdefault(name, []).append(values.detach().float().cpu())
        grad_norm = self._clip_and_norm()
        if not math.isfinite(grad_norm):
            # The norm is the whole model's (summed over the ranks), so every rank skips alike.  A NaN
            # gradient through AdamW makes every weight NaN, and the loop would publish them.
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteGradient(
                f"the gradient norm is {grad_norm}; the update is skipped, the weights are unchanged"
            )
        self.optimizer.step()
        pools = torch.cat(pool_index) if pool_index else torch.zeros(0, dtype=torch.long)
        lags = torch.cat(staleness) if staleness else torch.zeros(0, dtype=torch.long)
        return step_result(batch, loss_sum, per_token, pools, lags, grad_norm, start)

    def _forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The trunk in the compute dtype: FSDP casts the weights itself; one process autocasts."""
        lower = self.compute_dtype != torch.float32 and not self.ranks.distributed
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=lower):
            hidden, head = self.trunk(*inputs)
        return hidden, head

    def _empty_pass(self) -> None:
        """A forward and backward that changes no gradient, for a rank with no micro-batch left."""
        one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        hidden, head = self._forward(one, torch.ones_like(one), zero, zero)
        (hidden.sum() * 0.0 + head.sum() * 0.0).backward()

    def _clip_and_norm(self) -> float:
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        if not parameters:
            return 0.0
        max_norm = self.settings.grad_clip if self.settings.grad_clip is not None else math.inf
        return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))

    def state_dict_for_publication(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Weights as the samplers receive them (BF16), contiguous and untied for safetensors.

        With several ranks the shards are gathered: every rank must call this, rank 0 gets the
        weights and the others an empty dict.
        """
        return {
            name: t.detach().to("cpu", dtype).contiguous().clone()
            for name, t in self._full_state()["model"].items()
        }

    def _full_state(self, with_optimizer: bool = False) -> dict[str, Any]:
        """Unsharded model (and optimizer) state keyed by parameter name, the same on any number of
        ranks; with several ranks it is gathered to the CPU of rank 0 (empty dicts on the others)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=self.ranks.distributed)
        model, optimizer = get_state_dict(
            self.trunk, self.optimizer if with_optimizer else [], options=options
        )
        state = {"model": {name.removeprefix("model."): t for name, t in model.items()}}
        return state | ({"optimizer": optimizer} if with_optimizer else {})

    def _sharded_state(self) -> dict[str, Any]:
        """Model and AdamW state as this rank holds it, keyed by parameter name: under FSDP2 each
        tensor a DTensor (this rank's shard), in one process the whole tensor; nothing gathered."""
        model, optimizer = get_state_dict(self.trunk, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def save_checkpoint(self, run_dir: Path, step: int) -> Path:
        """A sharded checkpoint of this step, ``run_dir/checkpoint-<step>`` (collective: every rank
        writes its own shards, :mod:`mixrl.rl.trainer.checkpoint`), committed atomically."""
        state = self._sharded_state() | {"step": step}
        return checkpoint.save(run_dir, step, state, is_main=self.ranks.is_main)

    def load_checkpoint(self, path: Path) -> int:
        """Load a checkpoint written on any number of ranks (collective); returns its step.

        ``path`` is a ``checkpoint-<step>`` directory (each rank reads only the pieces of the
        shards it holds; no pickle from the files runs), or a single-file ``trainer.pt`` of the
        whole state from before sharded checkpoints (read with ``weights_only=True``).
        """
        if path.is_file():
            return self._load_single_file(path)
        state = self._sharded_state() | {"step": -1}
        checkpoint.load(path, state)
        set_state_dict(
            self.trunk, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        apply_settings(self.optimizer.param_groups, self.settings)
        step = state["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step != checkpoint.step_of(path):
            raise checkpoint.CheckpointError(f"{path}: holds step {step!r}, not the one its name gives")
        return step

    def _load_single_file(self, path: Path) -> int:
        """Every rank reads the whole file (``weights_only``) and keeps its shards."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        set_state_dict(
            self.trunk,
            self.optimizer,
            model_state_dict={f"model.{name}": t for name, t in state["model"].items()},
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
        apply_settings(self.optimizer.param_groups, self.settings)
        return int(state["step"])


# The objective's metric keys, as the trainer logs them (k1/k3 are sampler–trainer KL estimates).
LOGGED_NAMES = {"k1": "kl_k1", "k3": "kl_k3"}


STALENESS_BINS = ("0", "1", "2", "3+")
"""The staleness bins mismatch is logged by (trainer version − token version)."""
BINNED_METRICS = {"k3": "kl_k3", "k1": "kl_k1", "extreme_ratio": "extreme_ratio"}
"""The metrics logged per staleness bin.  k1 (−log r) is an unbiased estimate of KL(sampler ‖
trainer) whatever the sampling; k3 has lower variance but is unbiased only when the trainer's
distribution is normalised over the sampler's support (top-p replay on, or no top-p): without
replay it is low by the trainer's mass outside the sampler's nucleus."""


def staleness_masks(lags: torch.Tensor) -> dict[str, torch.Tensor]:
    """One token mask per :data:`STALENESS_BINS` entry (the last takes every larger lag)."""
    return {"0": lags == 0, "1": lags == 1, "2": lags == 2, "3+": lags >= 3}


def step_result(
    batch: PolicyBatch,
    loss_sum: torch.Tensor,
    per_token: dict[str, list[torch.Tensor]],
    pools: torch.Tensor,
    lags: torch.Tensor,
    grad_norm: float,
    started: float,
) -> StepResult:
    """A step's result from this rank's share of it, summed over every rank (each backend calls
    this on every rank; a rank that computed nothing gives empty tensors): ``loss_sum``, this rank's
    part of the batch's token-mean loss; ``per_token``, its tokens' metrics; ``pools`` and ``lags``,
    each token's pool index and staleness.

    Mismatch is also reported by staleness: fresh tokens (staleness 0: sampled with the weights the
    trainer scores them with) measure the sampler's precision and kernels alone; the other bins add
    the drift of stale weights, which is the same for every pool.
    """
    names, sums, counts = metric_sums(per_token, pools, len(batch.pools))
    parts = [loss_sum.view(1), sums, counts]
    for mask in staleness_masks(lags).values():
        parts += metric_sums(per_token, pools, len(batch.pools), mask=mask)[1:]
    reduced = distributed.all_reduce_sum(torch.cat([part.flatten() for part in parts]))
    chunks = reduced.split([part.numel() for part in parts])
    _, sums, counts, *binned = (chunk.view(part.shape) for chunk, part in zip(chunks, parts, strict=True))
    bins = {name: (binned[2 * i], binned[2 * i + 1]) for i, name in enumerate(STALENESS_BINS)}
    return StepResult(
        loss=float(reduced[0]),
        grad_norm=grad_norm,
        tokens=batch.num_tokens,
        seconds=time.perf_counter() - started,
        metrics=summarize(names, sums, counts, batch) | staleness_summary(names, bins),
        per_pool=summarize_per_pool(names, sums, counts, batch, bins),
    )


def metric_sums(
    per_token: dict[str, list[torch.Tensor]],
    pool_index: torch.Tensor,
    num_pools: int,
    mask: torch.Tensor | None = None,
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Per-token metrics as sums per pool ([metrics, pools], float64) and token counts per pool:
    the form that adds up across ranks.  ``mask``: only the tokens where it is True."""
    names = list(METRIC_KEYS)  # every rank the same, even one that had no token this step
    sums = torch.zeros((len(names), num_pools), dtype=torch.float64)
    keep = mask if mask is not None else torch.ones_like(pool_index, dtype=torch.bool)
    pools = pool_index[keep]
    for row, name in enumerate(names):
        if name in per_token:
            sums[row].index_add_(0, pools, torch.cat(per_token[name]).double()[keep])
    counts = torch.bincount(pools, minlength=num_pools).double()
    return names, sums, counts


def binned(names: list[str], sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
    """The binned metrics of one bin's sums (summed over the given pools' columns) and its tokens."""
    tokens = float(counts.sum())
    out = {logged: float(sums[names.index(name)].sum()) / tokens for name, logged in BINNED_METRICS.items()}
    out["tokens"] = tokens
    return out


def with_fresh(stats: dict[str, float], by_staleness: dict[str, dict[str, float]]) -> dict[str, float]:
    """``kl_k3_fresh``, ``kl_k1_fresh``, ``extreme_ratio_fresh``, ``fresh_tokens``: bin 0 by name
    (what mismatch-aware routing and the live status's ``klFresh`` read; the collapse signs are
    judged on the all-token ``kl_k3``)."""
    fresh = by_staleness.get("0")
    if fresh is not None:
        stats.update({f"{key}_fresh": value for key, value in fresh.items() if key != "tokens"})
        stats["fresh_tokens"] = fresh["tokens"]
    if by_staleness:
        stats["by_staleness"] = by_staleness  # type: ignore[assignment]  # a nested record
    return stats


def staleness_summary(
    names: list[str], bins: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, float]:
    """The run's mismatch per staleness bin (bins without tokens left out)."""
    by_staleness = {b: binned(names, s, c) for b, (s, c) in bins.items() if float(c.sum())}
    return with_fresh({}, by_staleness)


def summarize(
    names: list[str], sums: torch.Tensor, counts: torch.Tensor, batch: PolicyBatch
) -> dict[str, float]:
    total = float(counts.sum())
    out = {
        LOGGED_NAMES.get(name, name): float(sums[row].sum()) / total if total else 0.0
        for row, name in enumerate(names)
    }
    out["reward"] = float(batch.rewards.mean())
    staleness = batch.loss_tokens.staleness
    out["staleness_mean"] = float(staleness.float().mean()) if batch.num_tokens else 0.0
    out["staleness_max"] = float(staleness.max()) if batch.num_tokens else 0.0
    return out


def summarize_per_pool(
    names: list[str],
    sums: torch.Tensor,
    counts: torch.Tensor,
    batch: PolicyBatch,
    bins: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for i, pool in enumerate(batch.pools):
        row_mask = batch.trajectory_pool == i
        tokens = float(counts[i])
        stats = {
            LOGGED_NAMES.get(name, name): float(sums[row, i]) / tokens
            for row, name in enumerate(names)
            if tokens
        }
        by_staleness = {
            b: binned(names, s[:, i : i + 1], c[i : i + 1])
            for b, (s, c) in (bins or {}).items()
            if float(c[i])
        }
        with_fresh(stats, by_staleness)
        stats["tokens"] = tokens
        stats["trajectories"] = float(row_mask.sum())
        if row_mask.any():
            stats["reward"] = float(batch.rewards[row_mask].mean())
        out[pool] = stats
    return out
