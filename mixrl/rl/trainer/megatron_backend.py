"""``backend: megatron``: the policy trainer on megatron-core: tensor, pipeline and expert
parallelism from ``trainer.parallelism``, Megatron's distributed optimizer, BF16.

The model is megatron-core's ``GPTModel`` with the local layer spec, holding the Hugging Face Qwen3
weights through :mod:`mixrl.rl.trainer.megatron_convert` (each rank its pipeline stage, tensor
slice and experts).  Parameters compute in BF16; the distributed optimizer keeps FP32 master
weights and AdamW state, sharded over the data-parallel ranks; gradients are reduced in FP32.  The
corrected objective is the torch backend's own code (``token_policy_loss``), fed the output
layer's vocabulary-parallel logits: every reduction over the vocabulary is an all-reduce over the
tensor-parallel group, and the log-softmax runs in FP32.  Each loss is the sum over its tokens;
Megatron's ``calculate_per_token_loss`` divides the gradients by the whole step's token count,
summed over the data-parallel ranks, so the update is the torch backend's token mean.

CUDA only.  megatron-core 0.16 runs ``GPTModel.forward``, its DDP buffers and its pipeline
schedules on the current CUDA device; on a CPU the construction fails with one line
(:data:`NEEDS_CUDA`, :class:`BackendUnavailable`).  What runs without a GPU is tested on the CPU (tests/trainer/test_megatron.py:
the weights' conversion for every kind of parallelism, Megatron's modules against the Hugging Face
layers, the objective on vocabulary shards); so are this class's update and checkpoint load, around
megatron-core's own ``ChainedOptimizer`` holding CPU stand-ins (tests/trainer/test_megatron_optimizer_step.py:
a non-finite gradient skips the update, a load keeps the spec's optimizer settings).  The class
itself is run by ``scripts/gpu/trainer-check.sh`` and by the CUDA-only test of tests/trainer/test_megatron.py.

Not supported yet, and refused by validation: context parallelism (cp > 1).
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mixrl.api.models import Parallelism
from mixrl.rl.corrections import CorrectionConfig, token_policy_loss
from mixrl.rl.tiny_models import load_model
from mixrl.rl.trainer import checkpoint, distributed
from mixrl.rl.trainer.batch import PolicyBatch
from mixrl.rl.trainer.megatron_convert import (
    check_supported,
    gpt_model_kwargs,
    hf_to_megatron,
    local_layer_spec_kwargs,
    megatron_to_hf,
    parallel_shard,
    parallel_unshard,
    pipeline_shard,
    pipeline_unshard,
    transformer_config_kwargs,
)
from mixrl.rl.trainer.torch_backend import (
    NonFiniteGradient,
    OptimizerSettings,
    StepResult,
    apply_settings,
    split_rows_by_tokens,
    step_result,
)

NEEDS_CUDA = (
    "spec.trainer.backend: megatron trains on CUDA GPUs only (megatron-core 0.16 runs GPTModel.forward, "
    "its DDP buffers and its pipeline schedules on the current CUDA device); use backend torch here"
)


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this machine (one line: why, and what to use instead)."""


def _megatron() -> dict[str, Any]:
    """megatron-core's pieces, imported on first use (they print notices about absent fusions)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import dist_checkpointing
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig
    return {
        "dist_checkpointing": dist_checkpointing,
        "mpu": mpu,
        "DistributedDataParallel": DistributedDataParallel,
        "DistributedDataParallelConfig": DistributedDataParallelConfig,
        "finalize_model_grads": finalize_model_grads,
        "get_gpt_layer_local_spec": get_gpt_layer_local_spec,
        "GPTModel": GPTModel,
        "OptimizerConfig": OptimizerConfig,
        "get_megatron_optimizer": get_megatron_optimizer,
        "clip_grad_by_total_norm_fp32": clip_grad_by_total_norm_fp32,
        "get_forward_backward_func": get_forward_backward_func,
        "model_parallel_cuda_manual_seed": model_parallel_cuda_manual_seed,
        "TransformerConfig": TransformerConfig,
    }


class MegatronPolicyTrainer:
    """The torch backend's interface (step, publication, checkpoints) on megatron-core."""

    def __init__(
        self,
        model_path: str,
        corrections: CorrectionConfig,
        parallelism: Parallelism,
        settings: OptimizerSettings,
        *,
        seed: int = 0,
    ) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable(NEEDS_CUDA)
        if not dist.is_initialized():  # one process, started without torchrun: a group of one
            distributed.init_group_of_one(torch.device("cuda", 0))
        mc = _megatron()
        self.mc = mc
        self.mpu = mpu = mc["mpu"]
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=parallelism.tp,
            pipeline_model_parallel_size=parallelism.pp,
            expert_model_parallel_size=parallelism.ep,
        )
        mc["model_parallel_cuda_manual_seed"](seed)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.corrections = corrections
        self.settings = settings

        hf = load_model(model_path)
        self.hf_config = hf_config = hf.config
        check_supported(hf_config)
        tp, pp, ep = parallelism.tp, parallelism.pp, parallelism.ep
        if hf.config.vocab_size % tp:
            raise ValueError(
                f"spec.trainer.parallelism.tp: the vocabulary ({hf.config.vocab_size}) does not split "
                f"into {tp} tensor-parallel shards"
            )
        whole = hf_to_megatron({k: v.detach() for k, v in hf.state_dict().items()}, hf.config)
        del hf
        self.place = (mpu.get_pipeline_model_parallel_rank(), mpu.get_expert_model_parallel_rank(),
                      mpu.get_tensor_model_parallel_rank())  # fmt: skip
        stage, expert_rank, tp_rank = self.place
        part = parallel_shard(pipeline_shard(whole, hf_config, stage, pp), tp_rank, tp, expert_rank, ep)
        del whole

        config = mc["TransformerConfig"](
            **transformer_config_kwargs(hf_config),
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            bf16=True,
            params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
            # Each loss is a sum; Megatron divides the gradients by the step's tokens over all ranks.
            calculate_per_token_loss=True,
            # Trajectories differ in length: the pipeline sends each micro-batch's shape with it.
            variable_seq_lengths=True,
        )
        spec = mc["get_gpt_layer_local_spec"](**local_layer_spec_kwargs(hf_config))
        model = mc["GPTModel"](
            config,
            spec,
            pre_process=mpu.is_pipeline_first_stage(),
            post_process=mpu.is_pipeline_last_stage(),
            **gpt_model_kwargs(hf_config),
        ).cuda()
        missing, unexpected = model.load_state_dict(part, strict=False)
        missing = [name for name in missing if not name.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"megatron weights: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
        ddp = mc["DistributedDataParallelConfig"](
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False
        )
        self.model = mc["DistributedDataParallel"](config, ddp, model)
        self.optimizer = mc["get_megatron_optimizer"](
            mc["OptimizerConfig"](
                optimizer="adam",
                lr=settings.lr,
                weight_decay=settings.weight_decay,
                adam_beta1=settings.betas[0],
                adam_beta2=settings.betas[1],
                bf16=True,
                params_dtype=torch.bfloat16,
                use_distributed_optimizer=True,
                clip_grad=settings.grad_clip
                if settings.grad_clip is not None
                else 0.0,  # 0 turns clipping off
            ),
            [self.model],
        )
        config.finalize_model_grads_func = mc["finalize_model_grads"]
        self.config = config

    # ------------------------------------------------------------------ one update
    def _micro_batches(self, batch: PolicyBatch) -> list[PolicyBatch]:
        """This data-parallel rank's share of the trajectories, in micro-batches; at least one (a
        rank without trajectories runs one micro-batch without loss tokens: the schedule and the
        gradient reduction are collective)."""
        dp_size, dp_rank = self.mpu.get_data_parallel_world_size(), self.mpu.get_data_parallel_rank()
        lengths = batch.attention_mask.sum(dim=1).tolist()
        rows = distributed.shard_rows(lengths, dp_size)[dp_rank] if dp_size > 1 else list(range(len(lengths)))
        local = batch.select_rows(rows) if rows else None
        micro = []
        if local is not None:
            micro = [
                m
                for part in split_rows_by_tokens(local, self.settings.micro_batch_tokens)
                if part and (m := local.select_rows(part)).num_tokens > 0
            ]
        if not micro:
            one = batch.select_rows([0])
            none = torch.zeros(one.num_tokens, dtype=torch.bool)
            micro = [replace(one, loss_tokens=one.loss_tokens.take(none))]
        return micro

    def _forward_step(self, records: list[tuple[Any, ...]], data: Iterator[PolicyBatch], model: Any) -> Any:
        micro = next(data).to(self.device)
        positions = torch.arange(micro.input_ids.shape[1], device=self.device).expand_as(micro.input_ids)
        output = model(micro.input_ids, positions, attention_mask=None)  # causal; padding comes last
        return output, functools.partial(self._loss, records, micro)

    def _loss(self, records: list[tuple[Any, ...]], micro: PolicyBatch, logits: torch.Tensor) -> Any:
        """The corrected loss summed over the micro-batch's tokens, on this rank's vocabulary shard
        of the logits ([batch, seq, V/tp]); with the token count Megatron divides by."""
        tokens = micro.loss_tokens
        count = torch.tensor(tokens.tokens.numel(), dtype=torch.int, device=logits.device)
        if not tokens.tokens.numel():
            return logits.sum() * 0.0, count, {}
        shard = logits[tokens.rows, tokens.positions].float() / self.settings.temperature
        loss, metrics = token_policy_loss(
            shard,
            tokens,
            self.corrections,
            num_loss_tokens=1.0,
            vocab_group=self.mpu.get_tensor_model_parallel_group(),
            vocab_start=self.place[2] * shard.shape[-1],
        )
        per_token = {name: value.detach().float().cpu() for name, value in metrics.per_token.items()}
        records.append(
            (loss.detach().double().cpu(), per_token, tokens.pool_index.cpu(), tokens.staleness.cpu())
        )
        return loss, count, {}

    def step(self, batch: PolicyBatch) -> StepResult:
        start = time.perf_counter()
        micro = self._micro_batches(batch)
        records: list[tuple[Any, ...]] = []
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.mc["get_forward_backward_func"]()(
            forward_step_func=functools.partial(self._forward_step, records),
            data_iterator=iter(micro),
            model=[self.model],
            num_microbatches=len(micro),
            seq_length=max(m.input_ids.shape[1] for m in micro),
            micro_batch_size=max(m.input_ids.shape[0] for m in micro),
            forward_only=False,
        )
        grad_norm = self._update()
        return self._result(batch, records, grad_norm, start)

    def _update(self) -> float:
        """The optimizer's step as megatron-core's ``ChainedOptimizer.step`` takes it (the reduced
        gradients into the FP32 main gradients, their norm, clipping by it, the update), with a check
        between the norm and the update; returns the norm (before clipping).

        In BF16 (no loss scaler) megatron-core looks for no inf or NaN and applies any gradient:
        a non-finite one made every weight NaN, and the loop published them.  As in the torch
        backend, such a step raises :class:`NonFiniteGradient` before anything is updated (the
        gradients cleared, the weights and the moments as they were), and the loop quarantines the
        batch.  The norm is reduced over every rank that holds a shard, so every rank skips alike.
        """
        optimizer = self.optimizer
        found_inf = optimizer.prepare_grads()  # True only from a loss-scaled (FP16) optimizer
        grad_norm = float(optimizer.get_grad_norm() or 0.0)
        if found_inf or not math.isfinite(grad_norm):
            self.model.zero_grad_buffer()
            optimizer.zero_grad()
            raise NonFiniteGradient(
                f"the gradient norm is {grad_norm}; the update is skipped, the weights are unchanged"
            )
        for part in optimizer.chained_optimizers:  # get_megatron_optimizer's: one per kind of parameter
            if getattr(part, "is_stub_optimizer", False) or part.config.clip_grad <= 0.0:
                continue
            parameters = part.get_parameters()
            if parameters:
                self.mc["clip_grad_by_total_norm_fp32"](
                    parameters,
                    max_norm=part.config.clip_grad,
                    total_norm=grad_norm,
                    use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
        optimizer.step_with_ready_grads()
        return grad_norm

    def _result(
        self, batch: PolicyBatch, records: list[tuple[Any, ...]], grad_norm: float, start: float
    ) -> StepResult:
        """The step's metrics, as the torch backend logs them.  Only the last pipeline stage computed
        them, and its tensor-parallel ranks all the same: rank 0 of each tensor-parallel group on the
        last stage contributes, and the sum over every rank gives each the whole batch's figures."""
        mine = records if self.mpu.is_pipeline_last_stage() and self.place[2] == 0 else []
        per_token: dict[str, list[torch.Tensor]] = {}
        for _, metrics, _, _ in mine:
            for name, values in metrics.items():
                per_token.setdefault(name, []).append(values)
        empty = torch.zeros(0, dtype=torch.long)
        pools = torch.cat([r[2] for r in mine]) if mine else empty
        lags = torch.cat([r[3] for r in mine]) if mine else empty
        # Each loss is a sum over its tokens: this rank's part of the token mean.
        loss = sum((r[0] for r in mine), torch.zeros((), dtype=torch.float64)) / max(batch.num_tokens, 1)
        return step_result(batch, loss, per_token, pools, lags, grad_norm, start)

    # ------------------------------------------------------------------ weights out
    @property
    def model_config(self) -> dict[str, Any]:
        return self.hf_config.to_dict()

    def state_dict_for_publication(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """The whole model in Hugging Face names (BF16), gathered once to rank 0 (the others get an
        empty dict): every (stage, expert rank, tensor rank) part once, from the ranks of expert
        data-parallel rank 0 (expert parallelism carves the expert ranks out of the data-parallel
        ranks, so data-parallel rank 0 alone would miss the other experts)."""
        part = None
        if self.mpu.get_expert_data_parallel_rank() == 0:
            state = self.model.module.state_dict()
            part = (
                self.place,
                {k: v.detach().to("cpu", dtype) for k, v in state.items() if not k.endswith("_extra_state")},
            )
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(part, gathered, dst=0)
        if gathered is None:
            return {}
        stages: dict[int, dict[tuple[int, int], dict[str, torch.Tensor]]] = {}
        for item in gathered:
            if item is not None:
                (stage, expert_rank, tp_rank), state = item
                stages.setdefault(stage, {})[(expert_rank, tp_rank)] = state
        whole = pipeline_unshard({s: parallel_unshard(p) for s, p in stages.items()}, self.hf_config)
        return {k: v.contiguous().clone() for k, v in megatron_to_hf(whole, self.hf_config).items()}

    # ------------------------------------------------------------------ checkpoints
    def _sharded_state(self, loading: bool = False) -> dict[str, Any]:
        model = self.model.module.sharded_state_dict()
        return {"model": model, "optimizer": self.optimizer.sharded_state_dict(model, is_loading=loading)}

    def save_checkpoint(self, run_dir: Path, step: int) -> Path:
        """Megatron's distributed checkpoint of the model and the distributed optimizer (each rank
        writes its shards; loadable on another parallel layout), named and committed as the torch
        backend's (:mod:`mixrl.rl.trainer.checkpoint`): written into ``checkpoint.tmp-<step>/``,
        renamed to ``checkpoint-<step>/`` by rank 0 once complete, older checkpoints removed."""
        main = dist.get_rank() == 0
        pending = checkpoint.begin(run_dir, step, is_main=main)
        self.mc["dist_checkpointing"].save({**self._sharded_state(), "step": step}, str(pending))
        distributed.barrier()
        return checkpoint.commit(run_dir, pending, is_main=main)

    def load_checkpoint(self, path: Path) -> int:
        """Load a checkpoint of this backend, written on any parallel layout; returns its step.
        Megatron's loader reads DCP's ``.metadata`` with ``pickle`` (the torch backend's restricted
        reader does not cover Megatron's strategies yet): load only checkpoints of this run."""
        state = {**self._sharded_state(loading=True), "step": -1}
        loaded = self.mc["dist_checkpointing"].load(state, str(path))
        self.model.module.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        # The distributed optimizer's state dict carries its param groups, as AdamW's does.
        apply_settings(self.optimizer.param_groups, self.settings)
        step = loaded["step"]
        if not isinstance(step, int) or step != checkpoint.step_of(path):
            raise checkpoint.CheckpointError(f"{path}: holds step {step!r}, not the one its name gives")
        return step
