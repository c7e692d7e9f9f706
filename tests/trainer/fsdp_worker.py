"""One rank of a data-parallel trainer, started by torchrun from test_fsdp.py and test_checkpoint.py.

Arguments: MODEL_DIR GROUPS_JSON OUT_DIR STEPS, then optionally ``--load CHECKPOINT`` (resume from it
first), ``--resume RUN_DIR`` (from its newest checkpoint, as the trainer does), ``--save RUN_DIR``
(a sharded checkpoint there after the last step, or every ``--save-every`` steps),
``--kill-in-save STEP`` (rank 0 SIGKILLs itself inside the save of that step, once DCP has written
every shard and the metadata: a crash mid-save) and ``--dir-per-rank`` (each rank's run directory
is ``RUN_DIR/rank<r>``, as on nodes that do not share a volume).  The compute dtype is
``$COMPUTE_DTYPE`` (``float32`` unless set, as on CPUs; ``bfloat16`` as on GPUs).  ``--device cuda``
puts each rank's trainer on its GPU (``LOCAL_RANK``) and joins the ranks over NCCL, as
scripts/gpu/trainer_check.py runs it; otherwise (``--device cpu``, the tests) the trainer is on the
CPU and the ranks use gloo.  Runs STEPS policy
steps on the same batch and writes what rank 0 sees: the step results (every rank's, to compare),
the published weights and the whole AdamW state, gathered.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from mixrl.api.trajectory import Trajectory
from mixrl.rl.corrections import CorrectionConfig
from mixrl.rl.tiny_models import load_model
from mixrl.rl.trainer import checkpoint, distributed
from mixrl.rl.trainer.batch import collate
from mixrl.rl.trainer.torch_backend import OptimizerSettings, TorchPolicyTrainer


def optimizer_tensors(trainer: TorchPolicyTrainer) -> dict[str, torch.Tensor]:
    """AdamW's whole state, ``<parameter>/<exp_avg|exp_avg_sq|step>`` (gathered: rank 0 gets it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=trainer.ranks.distributed)
    _, optimizer = get_state_dict(trainer.trunk, trainer.optimizer, options=options)
    state: dict[str, dict[str, Any]] = optimizer.get("state", {})
    return {
        f"{name}/{key}": value.detach().to("cpu", torch.float32).contiguous().clone()
        for name, values in state.items()
        for key, value in values.items()
    }


def kill_rank0_in_save(step: int, saving: list[int]) -> None:
    """Rank 0 dies once DCP has committed its metadata for ``step``, before mixrl renames it."""
    finish = FileSystemWriter.finish

    def dying_finish(self: FileSystemWriter, *args: Any, **kwargs: Any) -> None:
        finish(self, *args, **kwargs)
        if saving[0] == step:
            os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.finish = dying_finish  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("groups_json")
    parser.add_argument("out_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--load", default="")
    parser.add_argument("--save", default="")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--kill-in-save", type=int, default=0)
    parser.add_argument("--resume", default="")
    parser.add_argument("--dir-per-rank", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    ranks = distributed.Ranks.from_env()
    device = distributed.device_for(ranks) if args.device == "cuda" else torch.device("cpu")
    if device.type != args.device:
        raise SystemExit(f"fsdp_worker: --device {args.device}, but torch sees no CUDA device")
    distributed.init_process_group(ranks, device)  # NCCL on a GPU, gloo on the CPU (as the trainer)
    torch.manual_seed(0)
    compute_dtype = getattr(torch, os.environ.get("COMPUTE_DTYPE", "float32"))
    trainer = TorchPolicyTrainer(
        load_model(args.model_dir),
        CorrectionConfig(),
        OptimizerSettings(lr=1e-3, micro_batch_tokens=24),
        compute_dtype=compute_dtype,
        device=device,
        ranks=ranks,
    )
    mine = f"rank{ranks.rank}" if args.dir_per_rank else ""
    if args.resume and (found := checkpoint.latest_on_every_rank(Path(args.resume, mine))):
        args.load = str(found)
    step = trainer.load_checkpoint(Path(args.load)) if args.load else 0
    saving = [0]
    if args.kill_in_save and ranks.is_main:
        kill_rank0_in_save(args.kill_in_save, saving)
    raw = json.loads(Path(args.groups_json).read_text())
    groups = [[Trajectory.model_validate(t) for t in group] for group in raw]
    results = []
    for index in range(args.steps):
        result = trainer.step(collate(groups, trainer_version=0))
        results.append({"loss": result.loss, "grad_norm": result.grad_norm, "metrics": result.metrics,
                        "per_pool": result.per_pool})  # fmt: skip
        step += 1
        last = index == args.steps - 1
        if args.save and (last or (args.save_every and step % args.save_every == 0)):
            saving[0] = step
            trainer.save_checkpoint(Path(args.save, mine), step=step)
    weights = trainer.state_dict_for_publication(torch.float32)
    optimizer = optimizer_tensors(trainer)
    out = Path(args.out_dir)
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(results))
    if ranks.is_main:
        save_file(weights, str(out / "weights.safetensors"))
        save_file(optimizer, str(out / "optimizer.safetensors"))
        (out / "step.json").write_text(json.dumps(step))
    else:
        assert weights == {}, "only rank 0 receives the gathered weights"
    # Rank 1 tearing its gloo pairs down while rank 0 still writes what it gathered aborted a rank
    # now and then ("terminate called without an active exception", 1 run in 24 under load).
    distributed.barrier()
    distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
