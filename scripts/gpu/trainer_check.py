"""The trainer on a GPU (issue #12's GPU check; run by scripts/gpu/trainer-check.sh).

Checks, on the tiny Qwen3 config mixrl builds locally (nothing downloaded):
1. the trainer places the model and batches on ``cuda`` and computes in BF16 with FP32 masters;
2. one BF16 step on the GPU agrees with the FP32 step on the CPU to BF16's precision;
3. ``torchrun`` with one rank per GPU, each rank's trainer on its GPU (tests/trainer/fsdp_worker.py
   ``--device cuda``), makes the update of check 2's one-process BF16 step on the GPU.  With two or
   more GPUs the ranks are joined over NCCL (FSDP2); with one GPU there is one rank, which forms no
   process group, so NCCL is not exercised (the printed line says which).
Prints one line per check and exits 1 on the first that fails.

"Agrees" (checks 2 and 3): the loss within 5% (or 1e-3) and the update within ``UPDATE_ERROR``.
The update is compared as a whole, ||Δw − Δw_ref|| / ||Δw_ref|| over all weights (Δw: the step's
change from the initial weights), not weight by weight: AdamW's first step moves every weight by
±lr, so an elementwise tolerance of BF16's size (tests/trainer/test_fsdp.py's 2e-3 at lr 1e-3)
also holds for weights that never moved.  On the CPU (this script's batch, BF16 compute) two gloo
ranks differ from one process by 0.17 and BF16 from FP32 by 0.14; the update of half the batch
differs from the whole batch's by 0.8-1.0, and no update by exactly 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from mixrl.rl.corrections import CorrectionConfig
from mixrl.rl.tiny_models import load_model
from mixrl.rl.trainer import distributed
from mixrl.rl.trainer.batch import collate
from mixrl.rl.trainer.torch_backend import OptimizerSettings, TorchPolicyTrainer

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
from tests.trainer.conftest import synthetic_group  # noqa: E402  (the tests' synthetic groups)

UPDATE_ERROR = 0.5
"""The largest ||Δw − Δw_ref|| / ||Δw_ref|| accepted (the module's docstring says why)."""


def one_step(
    model_dir: str, groups: list, device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], float, float]:
    """The published FP32 weights, the loss and the gradient norm after one step (the settings of
    tests/trainer/fsdp_worker.py, which check 3's ranks run)."""
    torch.manual_seed(0)
    trainer = TorchPolicyTrainer(
        load_model(model_dir),
        CorrectionConfig(),
        OptimizerSettings(lr=1e-3, micro_batch_tokens=24),
        compute_dtype=dtype,
        device=device,
    )
    assert all(p.device.type == device.type and p.dtype == torch.float32 for p in trainer.model.parameters())
    result = trainer.step(collate(groups, trainer_version=0))
    return trainer.state_dict_for_publication(torch.float32), result.loss, result.grad_norm


def update_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], initial: dict) -> float:
    """||Δw_got − Δw_want|| / ||Δw_want||, Δw the change from ``initial`` over all weights (inf
    when the weights differ in names or hold a non-finite value)."""
    if got.keys() != want.keys() or not all(bool(torch.isfinite(t).all()) for t in got.values()):
        return float("inf")
    apart = sum(float((got[n] - want[n]).double().pow(2).sum()) for n in want)
    moved = sum(float((want[n] - initial[n].float()).double().pow(2).sum()) for n in want)
    return (apart / moved) ** 0.5 if moved > 0 else float("inf")


def loss_agrees(got: float, want: float) -> bool:
    return abs(got - want) <= max(5e-2 * abs(want), 1e-3)  # tests/trainer/test_fsdp.py's BF16 tolerance


def main() -> int:
    if not torch.cuda.is_available():
        print("trainer-check: no CUDA device")
        return 1
    model_dir = sys.argv[1]
    model = load_model(model_dir)
    initial = model.state_dict()
    groups = [synthetic_group(model, f"p{i}", 4, pool="a", seed=i, noise=0.3) for i in range(4)]
    device = distributed.device_for(distributed.Ranks())
    print(f"trainer-check: device {device} ({torch.cuda.get_device_name(device)})")
    gpu, gpu_loss, gpu_norm = one_step(model_dir, groups, device, torch.bfloat16)
    cpu, cpu_loss, _ = one_step(model_dir, groups, torch.device("cpu"), torch.float32)
    worst = max(float((gpu[n] - cpu[n]).abs().max()) for n in cpu)
    error = update_error(gpu, cpu, initial)
    print(
        f"trainer-check: BF16 on GPU vs FP32 on CPU: loss {gpu_loss:.6f} vs {cpu_loss:.6f},"
        f" update error {error:.3f} (at most {UPDATE_ERROR}), max |Δw| {worst:.2e}"
    )
    if error > UPDATE_ERROR or not loss_agrees(gpu_loss, cpu_loss):
        return 1
    print(f"trainer-check: peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**20:.1f} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        groups_json = Path(tmp) / "groups.json"
        groups_json.write_text(json.dumps([[t.model_dump(mode="json") for t in g] for g in groups]))
        worker = HERE.parents[2] / "tests" / "trainer" / "fsdp_worker.py"
        ranks = torch.cuda.device_count()
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   str(worker), model_dir, str(groups_json), tmp, "1", "--device", "cuda"]  # fmt: skip
        done = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "COMPUTE_DTYPE": "bfloat16"}
        )
        how = "FSDP2 over NCCL" if ranks > 1 else "one rank: no process group, NCCL not exercised"
        if done.returncode != 0:
            print(
                f"trainer-check: torchrun with {ranks} rank(s) on the GPU(s) ({how}): exit {done.returncode}"
            )
            print(done.stderr[-3000:])
            return 1
        weights = load_file(str(Path(tmp) / "weights.safetensors"))
        (step,) = json.loads((Path(tmp) / "rank0.json").read_text())
    error = update_error(weights, gpu, initial)
    norm_agrees = abs(step["grad_norm"] - gpu_norm) <= 5e-2 * abs(gpu_norm)
    print(
        f"trainer-check: torchrun with {ranks} rank(s) on the GPU(s) ({how}) vs one process on the GPU:"
        f" loss {step['loss']:.6f} vs {gpu_loss:.6f}, grad norm {step['grad_norm']:.4f} vs {gpu_norm:.4f},"
        f" update error {error:.3f} (at most {UPDATE_ERROR})"
    )
    if error > UPDATE_ERROR or not loss_agrees(step["loss"], gpu_loss) or not norm_agrees:
        return 1
    print("trainer-check: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
