"""One rank of the Megatron-core checks on CPU (run by test_megatron.py through torchrun, 2 ranks, gloo).

usage: megatron_worker.py MODEL_DIR OUT_DIR DEVICE EP [PP]   (DEVICE: cpu, gloo; or cuda, NCCL)

With PP > 1 the ranks are pipeline stages instead, and only the weights' round trip runs.

Expert parallelism EP (MoE models), tensor parallelism the rest of the ranks. On cuda the worker also runs ``GPTModel.forward`` and a
backward, which megatron-core cannot run on a CPU.

Real: megatron-core's ``parallel_state`` groups (tensor parallel 2) over gloo, its ``GPTModel`` built
on the CPU with the local layer spec, its vocabulary-parallel output layer; the Hugging Face model
from transformers. Each rank writes ``OUT_DIR/rank{R}.pt`` with what the parent asserts.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mixrl.rl.corrections import CorrectionConfig, LossTokens, token_policy_loss
from mixrl.rl.tiny_models import load_model
from mixrl.rl.trainer.megatron_convert import (
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

with warnings.catch_warnings():
    # Import-time notices that Apex/Transformer Engine are absent and the local fallbacks are used.
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig


def build_gpt_model(hf_config: Any) -> GPTModel:
    config = TransformerConfig(
        **transformer_config_kwargs(hf_config),
        tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=mpu.get_expert_model_parallel_world_size(),
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(**local_layer_spec_kwargs(hf_config))
    return GPTModel(config, spec, **gpt_model_kwargs(hf_config))


def megatron_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def all_gather_objects(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def round_trip(model: GPTModel, hf_state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, Any]:
    """Load this rank's shard of the converted weights into the real GPTModel, read them back,
    gather the shards and convert back to Hugging Face names."""
    place = (mpu.get_expert_model_parallel_rank(), mpu.get_tensor_model_parallel_rank())
    tp_size, ep_size = mpu.get_tensor_model_parallel_world_size(), mpu.get_expert_model_parallel_world_size()
    shard = parallel_shard(hf_to_megatron(hf_state, hf_config), place[1], tp_size, place[0], ep_size)
    missing, unexpected = model.load_state_dict(shard, strict=False)
    shards = dict(all_gather_objects((place, megatron_state(model)), dist.group.WORLD))
    back = megatron_to_hf(parallel_unshard(shards), hf_config)
    return {
        "place": place,
        "missing": [k for k in missing if not k.endswith("_extra_state")],
        "unexpected": list(unexpected),
        "hf_back": back if dist.get_rank() == 0 else None,
    }


def layer_outputs(model: GPTModel, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Megatron's own pieces of layer 0 on this rank, run on the CPU: the fused QKV projection split
    into query, key and value heads (q/k norms applied), and a dense MLP's output (megatron-core 0.16's
    MoE router moves its weight to ``torch.cuda.current_device()``: MoE blocks run on CUDA only).

    ``x`` is [seq, batch, hidden]. The heads are this rank's (tensor parallelism splits them); the MLP
    output is whole (its row-parallel ``linear_fc2`` all-reduces)."""
    layer = model.decoder.layers[0]
    q, k, v = layer.self_attention.get_query_key_value_tensors(x, None)
    outputs = {"q": q, "k": k, "v": v}
    if not hasattr(layer.mlp, "router"):  # the MoE router moves its weight to CUDA in its forward
        outputs["mlp"], _ = layer.mlp(x)
    return outputs


def model_logits(model: GPTModel, ids: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary shard of ``GPTModel.forward``'s logits, [batch, seq, V/tp] (CUDA only:
    megatron-core 0.16 allocates the rotary table and the attention's matmul buffer on
    ``torch.cuda.current_device()``)."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return model(ids, positions, attention_mask=None)


def sampler_records(full_logits: torch.Tensor, seed: int, k: int = 5) -> LossTokens:
    """A sampler q near the trainer (noise on the logits), its top-k record and tokens drawn from q."""
    g = torch.Generator().manual_seed(seed)
    n, vocab = full_logits.shape
    log_q = torch.log_softmax(full_logits + 0.5 * torch.randn(n, vocab, generator=g), dim=-1)
    tokens = torch.multinomial(log_q.exp(), 1, generator=g).squeeze(1)
    cand_logprobs, cand_ids = log_q.topk(k, dim=-1)
    support = torch.zeros(n, dtype=torch.long)
    return LossTokens(tokens=tokens, advantages=torch.randn(n, generator=g),
                      sampler_logprobs=log_q.gather(1, tokens[:, None]).squeeze(1), cand_ids=cand_ids,
                      cand_logprobs=cand_logprobs, support_size=support)  # fmt: skip


def sharded_loss(model: GPTModel, hidden: torch.Tensor, records: LossTokens) -> dict[str, Any]:
    """The corrected loss on the output layer's vocabulary-parallel logits, and its gradients."""
    tp_rank = mpu.get_tensor_model_parallel_rank()
    hidden = hidden.clone().requires_grad_(True)
    model.output_layer.weight.grad = None
    shard, _ = model.output_layer(hidden[:, None, :])  # [N, 1, V/tp]
    shard = shard[:, 0, :]
    loss, metrics = token_policy_loss(
        shard, records, CorrectionConfig(), None,
        vocab_group=mpu.get_tensor_model_parallel_group(), vocab_start=tp_rank * shard.shape[-1],
    )  # fmt: skip
    loss.backward()
    return {
        "loss": loss.detach(),
        "metrics": {key: value.detach() for key, value in metrics.per_token.items()},
        "grad_hidden": hidden.grad,
        "grad_head_shard": model.output_layer.weight.grad.detach().clone(),
    }


def pipeline_round_trip(model_dir: Path, out_dir: Path, pp: int) -> None:
    """Pipeline parallelism ``pp`` over all ranks: each builds its stage's ``GPTModel`` (its layers,
    the embedding on the first stage, the final norm and output layer on the last), loads its part
    of the converted weights, and the gathered parts convert back."""
    mpu.initialize_model_parallel(pipeline_model_parallel_size=pp)
    rank = dist.get_rank()
    hf = load_model(model_dir)
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    stage = mpu.get_pipeline_model_parallel_rank()
    config = TransformerConfig(
        **transformer_config_kwargs(hf.config),
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(**local_layer_spec_kwargs(hf.config))
    model = GPTModel(
        config, spec, pre_process=stage == 0, post_process=stage == pp - 1, **gpt_model_kwargs(hf.config)
    )
    part = pipeline_shard(hf_to_megatron(hf_state, hf.config), hf.config, stage, pp)
    missing, unexpected = model.load_state_dict(part, strict=False)
    parts = dict(all_gather_objects((stage, megatron_state(model)), dist.group.WORLD))
    back = megatron_to_hf(pipeline_unshard(parts, hf.config), hf.config)
    result = {
        "place": (stage,),
        "missing": [k for k in missing if not k.endswith("_extra_state")],
        "unexpected": list(unexpected),
        "layers": len(model.decoder.layers),
        "hf_back": back if rank == 0 else None,
    }
    torch.save(result, out_dir / f"rank{rank}.pt")


def main(argv: list[str]) -> int:
    model_dir, out_dir, device, ep = Path(argv[0]), Path(argv[1]), torch.device(argv[2]), int(argv[3])
    pp = int(argv[4]) if len(argv) > 4 else 1
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if pp > 1:
        try:
            pipeline_round_trip(model_dir, out_dir, pp)
        finally:
            mpu.destroy_model_parallel()
            dist.destroy_process_group()
        return 0
    try:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=dist.get_world_size() // ep, expert_model_parallel_size=ep
        )
        rank = dist.get_rank()
        hf = load_model(model_dir)
        hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        torch.manual_seed(1234 + rank)  # different random initializations: loading must overwrite them
        model = build_gpt_model(hf.config)
        result: dict[str, Any] = {"tp_rank": mpu.get_tensor_model_parallel_rank()}
        result.update(round_trip(model, hf_state, hf.config))

        ids = torch.randint(1, hf.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
        if device.type == "cuda":
            model_parallel_cuda_manual_seed(0)  # the attention's dropout forks Megatron's CUDA RNG tracker
            model.cuda()
            with torch.no_grad():
                result["logits_shard"] = model_logits(model, ids.cuda()).cpu()
            # A backward through the whole GPTModel: every parameter gets a gradient.
            model.zero_grad(set_to_none=True)
            model_logits(model, ids.cuda()).float().pow(2).mean().backward()
            result["params_without_grad"] = [n for n, p in model.named_parameters() if p.grad is None]
            model.cpu()

        with torch.no_grad():
            x = torch.randn(7, 2, hf.config.hidden_size, generator=torch.Generator().manual_seed(6))
            result["layer0"] = layer_outputs(model, x)
            out = hf(input_ids=ids, output_hidden_states=True)
        hidden = out.hidden_states[-1].reshape(-1, hf.config.hidden_size)  # after the final norm
        records = sampler_records(out.logits.reshape(-1, hf.config.vocab_size), seed=11)
        result["hidden"], result["records"] = hidden, vars(records)  # plain tensors for torch.load
        if model.share_embeddings_and_output_weights:  # the output layer takes the embedding's shard
            with torch.no_grad():
                shared = model.shared_embedding_or_output_weight()
                result["logits_from_shared"] = model.output_layer(hidden[:, None, :], weight=shared)[0][:, 0]
        elif mpu.get_tensor_model_parallel_world_size() > 1:
            result.update(sharded_loss(model, hidden, records))
        torch.save(result, out_dir / f"rank{rank}.pt")
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
