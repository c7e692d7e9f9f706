"""scripts/gpu/kernels-check.sh's helper on a machine without a GPU: its CPU half runs (the W8A8 and
BF16-kernel emulations it compares the GPU with), and without --dry-run it stops with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ..fakes import script_module

HELPER = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "kernels_check.py"


def test_the_dry_run_emulates_and_a_missing_gpu_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    module = script_module("kernels_check", HELPER)
    assert module.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("kernels-check: dry run: fp8 W8A8 emulated, quantization error")
    assert float(lines[-1].rsplit(" ", 1)[1]) > 0  # the emulated BF16 kernels differ from the trainer
    if not torch.cuda.is_available():
        assert module.main([]) == 2
        assert "no CUDA device" in capsys.readouterr().err
