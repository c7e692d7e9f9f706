"""The trainer on a GPU (issue #12's GPU check; run by scripts/gpu/trainer-check.sh).

Checks, on the tiny Qwen3 config mixrl builds locally (nothing downloaded):
1. the trainer places the model and batches on ``cuda`` and computes in BF16 with FP32 masters;
2. one BF16 step on the GPU agrees with the FP32 step on the CPU to BF16's precision;
3. ``torchrun`` with one rank per GPU over NCCL makes the same update (as many ranks as GPUs).
Prints one line per check and exits 1 on the first that fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mixrl.rl.corrections import CorrectionConfig
from mixrl.rl.tiny_models import load_model
from mixrl.rl.trainer import distributed
from mixrl.rl.trainer.batch import collate
from mixrl.rl.trainer.torch_backend import OptimizerSettings, TorchPolicyTrainer

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
from tests.trainer.conftest import synthetic_group  # noqa: E402  (the tests' synthetic groups)


def one_step(model_dir: str, groups: list, device: torch.device, dtype: torch.dtype) -> tuple[dict, float]:
    torch.manual_seed(0)
    trainer = TorchPolicyTrainer(
        load_model(model_dir),
        CorrectionConfig(),
        OptimizerSettings(lr=1e-3, micro_batch_tokens=64),
        compute_dtype=dtype,
        device=device,
    )
    assert all(p.device.type == device.type and p.dtype == torch.float32 for p in trainer.model.parameters())
    result = trainer.step(collate(groups, trainer_version=0))
    return trainer.state_dict_for_publication(torch.float32), result.loss


def main() -> int:
    if not torch.cuda.is_available():
        print("trainer-check: no CUDA device")
        return 1
    model_dir = sys.argv[1]
    model = load_model(model_dir)
    groups = [synthetic_group(model, f"p{i}", 4, pool="a", seed=i, noise=0.3) for i in range(4)]
    device = distributed.device_for(distributed.Ranks())
    print(f"trainer-check: device {device} ({torch.cuda.get_device_name(device)})")
    gpu, gpu_loss = one_step(model_dir, groups, device, torch.bfloat16)
    cpu, cpu_loss = one_step(model_dir, groups, torch.device("cpu"), torch.float32)
    worst = max(float((gpu[n] - cpu[n]).abs().max()) for n in cpu)
    print(
        f"trainer-check: BF16 on GPU vs FP32 on CPU: loss {gpu_loss:.6f} vs {cpu_loss:.6f}, max |Δw| {worst:.2e}"
    )
    if worst > 5e-3 or abs(gpu_loss - cpu_loss) > 5e-2 * max(abs(cpu_loss), 1e-3):
        return 1
    print(f"trainer-check: peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**20:.1f} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        groups_json = Path(tmp) / "groups.json"
        groups_json.write_text(json.dumps([[t.model_dump(mode="json") for t in g] for g in groups]))
        worker = HERE.parents[2] / "tests" / "trainer" / "fsdp_worker.py"
        ranks = torch.cuda.device_count()
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   str(worker), model_dir, str(groups_json), tmp, "1"]  # fmt: skip
        done = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "COMPUTE_DTYPE": "bfloat16"}
        )
        print(f"trainer-check: torchrun with {ranks} NCCL rank(s): exit {done.returncode}")
        if done.returncode != 0:
            print(done.stderr[-3000:])
            return 1
    print("trainer-check: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
