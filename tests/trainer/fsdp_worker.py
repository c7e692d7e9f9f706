"""One rank of a data-parallel trainer, started by torchrun from test_fsdp.py.

Arguments: MODEL_DIR GROUPS_JSON OUT_DIR STEPS [CHECKPOINT_TO_LOAD] [CHECKPOINT_TO_SAVE]; the compute
dtype is ``$COMPUTE_DTYPE`` (``float32`` unless set, as on CPUs; ``bfloat16`` as on GPUs).  Runs STEPS
policy steps on the same batch (after loading the checkpoint, if given) and writes what rank 0
sees: the step results (every rank's, to compare) and the published weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from mixrl.api.trajectory import Trajectory
from mixrl.rl.corrections import CorrectionConfig
from mixrl.rl.models import load_model
from mixrl.rl.trainer import distributed
from mixrl.rl.trainer.batch import collate
from mixrl.rl.trainer.torch_backend import TorchPolicyTrainer


def main(model_dir: str, groups_json: str, out_dir: str, steps: int, load: str = "", save: str = "") -> None:
    ranks = distributed.Ranks.from_env()
    distributed.init_process_group(ranks, torch.device("cpu"))
    torch.manual_seed(0)
    compute_dtype = getattr(torch, os.environ.get("COMPUTE_DTYPE", "float32"))
    trainer = TorchPolicyTrainer(
        load_model(model_dir),
        CorrectionConfig(),
        lr=1e-3,
        micro_batch_tokens=24,
        compute_dtype=compute_dtype,
        ranks=ranks,
    )
    if load:
        trainer.load_checkpoint(Path(load))
    raw = json.loads(Path(groups_json).read_text())
    groups = [[Trajectory.model_validate(t) for t in group] for group in raw]
    results = []
    for _ in range(steps):
        result = trainer.step(collate(groups, trainer_version=0))
        results.append({"loss": result.loss, "grad_norm": result.grad_norm, "metrics": result.metrics,
                        "per_pool": result.per_pool})  # fmt: skip
    if save:
        trainer.save_checkpoint(Path(save), step=steps)
    weights = trainer.state_dict_for_publication(torch.float32)
    out = Path(out_dir)
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(results))
    if ranks.is_main:
        save_file(weights, str(out / "weights.safetensors"))
    else:
        assert weights == {}, "only rank 0 receives the gathered weights"
    distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:])
