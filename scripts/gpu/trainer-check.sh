#!/usr/bin/env bash
# The trainer on a GPU machine (issue #12): BF16 compute on CUDA with FP32 masters, agreement with
# the CPU's FP32 step, torchrun with one rank per GPU against the one-process GPU step (over NCCL
# with two or more GPUs; one GPU runs one rank, with no process group), and megatron-core's
# GPTModel on CUDA. Needs CUDA torch and the project's Python packages.
# Usage, from the repository root: scripts/gpu/trainer-check.sh   (records nothing; paste its lines
# into docs/benchmarks.md, "GPU checks").
set -euo pipefail
python=${PYTHON:-python3}
"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
"$python" -m pip install --quiet --no-deps -e . >/dev/null
# pytest first: trainer_check.py takes its batch from tests/trainer/conftest.py, which imports it.
# megatron-core for the Megatron-core checks at the end (tests/trainer/test_megatron.py): on a GPU
# the CUDA-only ones run too (GPTModel.forward against the Hugging Face logits, and a backward; two
# steps of the megatron backend against the torch backend's BF16 steps, with tp 1, tp 2 and pp 2 as
# the GPUs allow, and its checkpoint reloaded). MIXRL_WHEELS: a directory of wheels (megatron-core,
# pytest and its plugins) for a machine without a package index.
if ! "$python" -c "import megatron.core, pytest, pytest_timeout, pytest_asyncio" 2>/dev/null; then
  "$python" -m pip install --quiet ${MIXRL_WHEELS:+--no-index --find-links "$MIXRL_WHEELS"} \
    "megatron-core>=0.16,<0.17" pytest pytest-timeout pytest-asyncio
fi
model_dir=$(mktemp -d)
"$python" -c "import sys; from mixrl.rl.tiny_models import create_tiny_checkpoint; create_tiny_checkpoint(sys.argv[1], 'qwen3', vocab_size=48, seed=3)  # the tests' vocabulary (tests/trainer/conftest.py VOCAB)" "$model_dir/model"
model_dir=$model_dir/model
"$python" scripts/gpu/trainer_check.py "$model_dir"

# Every file with a CUDA-only test (the `cuda` marker; tests/conftest.py's CUDA_TEST_FILES lists them
# and fails collection for a cuda test elsewhere), whole: their CPU tests run too. On a GPU machine
# only a test that wants more GPUs than there are skips (and says so: -rs).
cuda_files=$("$python" -c "import ast; tree = ast.parse(open('tests/conftest.py').read()); print(' '.join(next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign) and getattr(node.targets[0], 'id', None) == 'CUDA_TEST_FILES')))")
# shellcheck disable=SC2086  # the file list is meant to split
"$python" -m pytest -q -rs -p no:cacheprovider $cuda_files
echo "trainer-check: the CUDA-only tests ($cuda_files) passed"
