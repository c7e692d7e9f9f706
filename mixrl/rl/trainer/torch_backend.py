"""The torch trainer: π recomputed on exactly the sampled ids, the corrected objective, AdamW.

The model is a ``transformers`` causal LM.  Hidden states come from the base model and the
objective computes logits chunk by chunk against the LM head (``chunked_token_policy_loss``), so
a batch never materializes [tokens × vocabulary] logits.  On CPU the trainer computes in float32
(bfloat16 matmuls are slow there) and publishes bfloat16 weights, as a BF16 trainer would; on GPU
set ``compute_dtype=torch.bfloat16``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixrl.rl.corrections import CorrectionConfig, chunked_token_policy_loss
from mixrl.rl.trainer.batch import PolicyBatch


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int
    seconds: float
    metrics: dict[str, float]
    per_pool: dict[str, dict[str, float]] = field(default_factory=dict)


def split_rows_by_tokens(batch: PolicyBatch, micro_batch_tokens: int) -> list[list[int]]:
    """Greedy consecutive micro-batches of whole trajectories, each at most ~micro_batch_tokens."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    micro: list[list[int]] = [[]]
    used = 0
    for row, length in enumerate(lengths):
        if micro[-1] and used + length > micro_batch_tokens:
            micro.append([])
            used = 0
        micro[-1].append(row)
        used += length
    return micro


class TorchPolicyTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        corrections: CorrectionConfig,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        temperature: float = 1.0,
        micro_batch_tokens: int = 16384,
        chunk_size: int = 1024,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model.to(compute_dtype)
        self.model.train()
        self.model.requires_grad_(True)
        self.corrections = corrections
        self.temperature = temperature
        self.grad_clip = grad_clip
        self.micro_batch_tokens = micro_batch_tokens
        self.chunk_size = chunk_size
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
        )

    def _hidden_and_head(self, micro: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor]:
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        out = base(input_ids=micro.input_ids, attention_mask=micro.attention_mask, use_cache=False)
        hidden = out.last_hidden_state[micro.loss_tokens.rows, micro.loss_tokens.positions]
        return hidden, self.model.get_output_embeddings().weight

    def step(self, batch: PolicyBatch) -> StepResult:
        """One policy update on a whole batch (gradient accumulation over micro-batches)."""
        start = time.perf_counter()
        total_tokens = max(batch.num_tokens, 1)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        per_token: dict[str, list[torch.Tensor]] = {}
        pool_index: list[torch.Tensor] = []
        for rows in split_rows_by_tokens(batch, self.micro_batch_tokens):
            micro = batch.select_rows(rows)
            if micro.num_tokens == 0:
                continue
            hidden, head = self._hidden_and_head(micro)
            tokens = micro.loss_tokens
            loss, metrics = chunked_token_policy_loss(
                hidden,
                head,
                tokens.tokens,
                tokens.advantages,
                tokens.sampler_logprobs,
                tokens.cand_ids,
                tokens.cand_logprobs,
                tokens.support_size,
                self.corrections,
                chunk_size=self.chunk_size,
                temperature=self.temperature,
                num_loss_tokens=total_tokens,  # the denominator is the whole batch's token count
            )
            loss.backward()
            loss_sum += float(loss.detach())
            for name, values in metrics.per_token.items():
                per_token.setdefault(name, []).append(values.detach().float())
            pool_index.append(tokens.pool_index)
        grad_norm = self._clip_and_norm()
        self.optimizer.step()
        token_metrics = {name: torch.cat(values) for name, values in per_token.items()}
        pools = torch.cat(pool_index) if pool_index else torch.zeros(0, dtype=torch.long)
        return StepResult(
            loss=loss_sum,
            grad_norm=grad_norm,
            tokens=batch.num_tokens,
            seconds=time.perf_counter() - start,
            metrics=summarize(token_metrics, batch),
            per_pool=summarize_per_pool(token_metrics, pools, batch),
        )

    def _clip_and_norm(self) -> float:
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        if not parameters:
            return 0.0
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))

    def state_dict_for_publication(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Weights as the samplers receive them (BF16), contiguous and untied for safetensors."""
        return {
            name: t.detach().to(dtype).contiguous().clone() for name, t in self.model.state_dict().items()
        }

    def save_checkpoint(self, path: Path, step: int, extra: dict[str, Any] | None = None) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(
            {
                "step": step,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                **(extra or {}),
            },
            tmp,
        )
        tmp.replace(path)  # atomic: a crash leaves the previous checkpoint intact

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        return state


# The objective's metric keys, as the trainer logs them (k1/k3 are sampler–trainer KL estimates).
LOGGED_NAMES = {"k1": "kl_k1", "k3": "kl_k3"}


def summarize(per_token: dict[str, torch.Tensor], batch: PolicyBatch) -> dict[str, float]:
    out = {
        LOGGED_NAMES.get(name, name): float(values.mean()) if values.numel() else 0.0
        for name, values in per_token.items()
    }
    out["reward"] = float(batch.rewards.mean())
    staleness = batch.loss_tokens.staleness
    out["staleness_mean"] = float(staleness.float().mean()) if batch.num_tokens else 0.0
    out["staleness_max"] = float(staleness.max()) if batch.num_tokens else 0.0
    return out


def summarize_per_pool(
    per_token: dict[str, torch.Tensor], pool_index: torch.Tensor, batch: PolicyBatch
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for i, pool in enumerate(batch.pools):
        token_mask = pool_index == i
        row_mask = batch.trajectory_pool == i
        stats = {
            LOGGED_NAMES.get(name, name): float(values[token_mask].mean())
            for name, values in per_token.items()
            if token_mask.any()
        }
        stats["tokens"] = float(token_mask.sum())
        stats["trajectories"] = float(row_mask.sum())
        if row_mask.any():
            stats["reward"] = float(batch.rewards[row_mask].mean())
        out[pool] = stats
    return out
