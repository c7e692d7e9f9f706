#!/usr/bin/env bash
# The pinned SGLang on one GPU behind mixrl's clients (issue #13): the operator's command line for an
# FP8 pool of examples/rlrun-mixed.yaml (FP8 weights, FP8 KV cache), a tiny model published as the
# trainer publishes version 0, the rollout's client for a few episodes, one weight update under load
# with the weight-sync sidecar's sequence, and every token record checked (mask, candidates, version).
# Details: scripts/gpu/sglang_check.py; docs/engine.md, "GPU check".
#
# Usage, from the repository root:
#   scripts/gpu/sglang-check.sh --dry-run   # anywhere: print the command line, SGLang's parser judges it
#   scripts/gpu/sglang-check.sh             # on a GPU machine, in the pinned image lmsysorg/sglang:v0.5.23
#   SGLANG_PIP_INSTALL=1 scripts/gpu/sglang-check.sh   # a bare CUDA machine: pip install the pinned SGLang first
# Records nothing itself; paste its lines into docs/benchmarks.md, "GPU checks".
set -euo pipefail
cd "$(dirname "$0")/../.."
dry_run=0
for arg in "$@"; do [ "$arg" = --dry-run ] && dry_run=1; done
if [ "$dry_run" = 1 ]; then
  python=${PYTHON:-.venv/bin/python}
  exec "$python" scripts/gpu/sglang_check.py "$@"
fi
python=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "sglang-check: FAILED: no GPU (nvidia-smi finds none); run it on a GPU machine, or pass --dry-run" >&2
  exit 1
fi
if [ "${SGLANG_PIP_INSTALL:-0}" = 1 ]; then
  sglang_version=$("$python" -c "import sys; sys.path.insert(0, '.'); from mixrl.api.resolve import SGLANG_VERSION; print(SGLANG_VERSION)")
  "$python" -m pip install --quiet "sglang[srt]==$sglang_version"
fi
# mixrl itself, without touching the image's torch or SGLang
"$python" -m pip install --quiet --no-deps -e . >/dev/null
exec "$python" scripts/gpu/sglang_check.py "$@"
