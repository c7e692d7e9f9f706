"""scripts/gpu/sglang-check.sh on a machine without a GPU: the dry run prints the operator's FP8
command line and SGLang's own parser (the test-only environment) accepts it; the real run stops
with one clear line; the token-record checks it applies on the GPU refuse what they should."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from mixrl.api.resolve import SGLANG_VERSION
from mixrl.api.trajectory import TokenRecord
from mixrl.rl.engine.protocol import GenerateResult

from ..fakes import script_module
from .conftest import SGLangParser

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "sglang-check.sh"
HELPER = ROOT / "scripts" / "gpu" / "sglang_check.py"


def helper() -> ModuleType:
    return script_module("sglang_check", HELPER)


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable, **env},
        cwd=ROOT,
    )


def test_dry_run_prints_the_fp8_pools_line_and_sglangs_parser_accepts_it(sglang_parser: SGLangParser) -> None:
    done = run(["--dry-run", "--sglang-env", str(sglang_parser.env_dir)])
    assert done.returncode == 0, done.stdout + done.stderr
    line, verdict = done.stdout.strip().splitlines()[-2:]
    assert (
        verdict
        == f"sglang-check: dry run: SGLang {SGLANG_VERSION}'s parser accepts the h200-fp8 command line"
    )
    argv = shlex.split(line)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--quantization"] == "fp8" and flags["--kv-cache-dtype"] == "fp8_e4m3"
    assert flags["--host"] == "127.0.0.1" and "--skip-tokenizer-init" in argv


def test_dry_run_names_a_missing_parser_environment(tmp_path: Path) -> None:
    done = run(["--dry-run", "--sglang-env", str(tmp_path / "none")])
    assert done.returncode == 1
    assert f"parser environment is absent at {tmp_path / 'none'}" in done.stdout.splitlines()[-1]


def test_without_a_gpu_it_stops_with_one_line(tmp_path: Path) -> None:
    # a stand-in nvidia-smi that finds no device (what the real one does on a machine without one)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    (fake / "nvidia-smi").chmod(0o755)
    done = run([], PATH=f"{fake}:{os.environ['PATH']}")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "sglang-check: FAILED: no GPU (nvidia-smi finds none); run it on a GPU machine, or pass --dry-run"
    ]
    # the helper itself, past the shell's test, refuses a machine without CUDA in one line too
    alone = subprocess.run(
        [sys.executable, str(HELPER)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert alone.returncode == 1
    assert alone.stdout.strip().splitlines() == [
        "sglang-check: FAILED: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine"
    ]


def record(token: int, version: int, support: int = 2) -> TokenRecord:
    return TokenRecord(
        token_id=token,
        logprob=-0.5,
        cand_ids=[token, token + 1, token + 2],
        cand_logprobs=[-0.5, -1.0, -2.0],
        support_size=support,
        weight_version=version,
    )


def test_the_record_checks_refuse_what_they_should() -> None:
    module = helper()
    check, failed = module.check_records, module.CheckFailed
    good = [[GenerateResult([record(5, 0), record(6, 1)], "length"), GenerateResult([record(7, 1)], "stop")]]
    assert check(good, {0, 1}, after_update=False) == 3
    with pytest.raises(failed, match="no sampling support"):
        check([[GenerateResult([record(5, 0, support=0)], "length")]], {0}, after_update=False)
    with pytest.raises(failed, match="version went back from 1 to 0"):
        check(
            [[GenerateResult([record(5, 1)], "length"), GenerateResult([record(6, 0)], "length")]],
            {0, 1},
            False,
        )
    with pytest.raises(failed, match="drawn after the update but labelled 0"):
        check([[GenerateResult([record(5, 0)], "length")]], {0, 1}, after_update=True)
    with pytest.raises(failed, match="weight version 2"):
        check([[GenerateResult([record(5, 2)], "length")]], {0, 1}, after_update=False)
