"""scripts/gpu/broadcast-check.sh on a machine without a GPU: the helper imports and parses its
flags, chooses NCCL only where two GPUs allow it (one line otherwise), and the shell script stops
with one clear line (tests/engine/test_weight_broadcast.py runs the same check on the CPU)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ..fakes import script_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "broadcast-check.sh"
HELPER = ROOT / "scripts" / "gpu" / "broadcast_check.py"


def helper() -> ModuleType:
    return script_module("broadcast_check", HELPER)


def test_the_helper_parses_imports_and_reads_its_flags() -> None:
    ast.parse(HELPER.read_text())
    args = helper().parse_args(["--backend", "nccl", "--hidden-size", "64", "--repeats", "1"])
    assert (args.backend, args.hidden_size, args.repeats, args.bucket_mib) == ("nccl", 64, 1, 256)


def test_nccl_needs_two_gpus_and_says_so_in_one_line() -> None:
    choose = helper().choose_backend
    assert choose("auto", 2) == ("nccl", None)
    backend, note = choose("auto", 1)
    assert backend == "gloo" and note is not None and "Duplicate GPU detected" in note and "\n" not in note
    assert choose("gloo", 8) == ("gloo", None)
    with pytest.raises(SystemExit, match=r"^broadcast-check: nccl needs two GPUs.*this machine has 1$"):
        choose("nccl", 1)


def test_the_shell_script_stops_with_one_line_without_a_gpu() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == "AssertionError: no CUDA device"
