"""One rank of ``MegatronPolicyTrainer`` (CUDA, NCCL), started by torchrun from test_megatron.py.

usage: megatron_trainer_worker.py MODEL_DIR GROUPS_JSON OUT_DIR STEPS TP PP

Runs STEPS policy steps on the same batch with tensor parallelism TP and pipeline parallelism PP
(data parallelism the rest of the ranks), saves a distributed checkpoint, loads it into a second
trainer, and writes what rank 0 sees: every step's result, the published weights after the last
step, and those of the trainer that loaded the checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from mixrl.api.models import Parallelism
from mixrl.api.trajectory import Trajectory
from mixrl.rl.corrections import CorrectionConfig
from mixrl.rl.trainer import distributed
from mixrl.rl.trainer.batch import collate
from mixrl.rl.trainer.megatron_backend import MegatronPolicyTrainer
from mixrl.rl.trainer.torch_backend import OptimizerSettings


def main(argv: list[str]) -> None:
    model_dir, groups_json, out = argv[0], Path(argv[1]), Path(argv[2])
    steps, tp, pp = int(argv[3]), int(argv[4]), int(argv[5])
    ranks = distributed.Ranks.from_env()
    distributed.init_process_group(ranks, distributed.device_for(ranks))
    parallelism = Parallelism(tp=tp, pp=pp)
    trainer = MegatronPolicyTrainer(
        model_dir, CorrectionConfig(), parallelism, OptimizerSettings(lr=1e-3, micro_batch_tokens=24)
    )
    groups = [[Trajectory.model_validate(t) for t in g] for g in json.loads(groups_json.read_text())]
    results = []
    for _ in range(steps):
        result = trainer.step(collate(groups, trainer_version=0))
        results.append({"loss": result.loss, "grad_norm": result.grad_norm, "metrics": result.metrics})
    weights = trainer.state_dict_for_publication(torch.float32)
    step = trainer.load_checkpoint(trainer.save_checkpoint(out, steps))
    reloaded = trainer.state_dict_for_publication(torch.float32)
    if ranks.is_main:
        (out / "results.json").write_text(json.dumps({"steps": results, "loaded_step": step}))
        save_file(weights, str(out / "weights.safetensors"))
        save_file(reloaded, str(out / "reloaded.safetensors"))
    distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
