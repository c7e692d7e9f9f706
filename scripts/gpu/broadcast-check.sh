#!/usr/bin/env bash
# The trainer's weight broadcast on a GPU machine (issue #29 item 5): rank 0 holds the weights on the
# GPU and broadcasts them to a real `mixrl engine` process (SGLang's update_weights_from_distributed
# contract), which must then serve them as an engine loaded from the store does; prints the broadcast
# time and GB/s. NCCL with two or more GPUs (trainer on the first, engine on the second); on one GPU
# NCCL refuses two ranks on the device, so it says so and measures gloo. Needs CUDA torch and the
# project's Python packages.
# Usage, from the repository root: scripts/gpu/broadcast-check.sh [--backend nccl|gloo] [--hidden-size N]
# (records nothing; paste its lines into docs/benchmarks.md, "GPU checks").
set -euo pipefail
python=${PYTHON:-python3}
"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
"$python" -m pip install --quiet --no-deps -e . >/dev/null
"$python" scripts/gpu/broadcast_check.py "$@"
