#!/usr/bin/env bash
# The emulated precisions against real GPU kernels (issue #32): a real FP8 GEMM with row-wise scales
# against the W8A8 emulation, and the tiny model's BF16 distributions on the GPU against the
# emulated serving kernels. Needs CUDA torch and the project's Python packages (nothing downloaded).
# Usage, from the repository root: scripts/gpu/kernels-check.sh   (paste its lines into
# docs/benchmarks.md, "GPU checks"); scripts/gpu/kernels-check.sh --dry-run runs the CPU half.
set -euo pipefail
python=${PYTHON:-python3}
"$python" -m pip install --quiet --no-deps -e . >/dev/null
"$python" scripts/gpu/kernels_check.py "$@"
