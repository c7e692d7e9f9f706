"""``mixrl trainer``'s fatal errors are one line on stderr and an exit code, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.rl.trainer import main as trainer_main
from mixrl.rl.weights import WeightStore, WeightStoreError

from ..api.conftest import ROOT


def quickstart_argv(tmp_path: Path, model_dir: Path) -> list[str]:
    """``mixrl trainer``'s command line for the quickstart with its store under ``tmp_path`` (the
    buffer's address reaches nothing: these trainers end before they ask it)."""
    run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    run = run.model_copy(update={"weights": run.weights.model_copy(update={"store": str(tmp_path / "w")})})
    config = tmp_path / "run.json"
    config.write_text(run.model_dump_json())
    argv = ["--config", str(config), "--buffer", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "run")]
    return [*argv, "--model-path", str(model_dir), "--insecure-no-auth"]


def test_a_weight_store_refusal_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    refusal = f"{tmp_path}/w/v00000000: already exists; published entries are immutable"

    def refuse(*args: object, **kwargs: object) -> str:
        raise WeightStoreError(refusal)

    monkeypatch.setattr(WeightStore, "publish", refuse)
    assert trainer_main.main(quickstart_argv(tmp_path, tiny_model_dir)) == 1
    err = capsys.readouterr().err  # transformers' loading progress bars aside
    assert err.splitlines()[-1] == f"mixrl trainer: weight store: {refusal}" and "Traceback" not in err


def test_out_of_memory_outside_a_step_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a traceback (only a step's out of memory was one line).  Publishing version 0 here;
    loading the model or saving a checkpoint alike."""

    def out_of_memory(*args: object, **kwargs: object) -> str:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(WeightStore, "publish", out_of_memory)
    assert trainer_main.main(quickstart_argv(tmp_path, tiny_model_dir)) == 1
    err = capsys.readouterr().err
    assert (
        err.splitlines()[-1] == "mixrl trainer: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    assert "Traceback" not in err


@pytest.mark.parametrize("model", ["missing", "empty"])
def test_a_model_path_that_holds_no_model_is_one_line(
    tmp_path: Path, model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: transformers' traceback, ending in "Repo id must be in the form 'repo_name'..." for a
    directory that does not exist (it took the path for a Hugging Face repository id)."""
    run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    run = run.model_copy(update={"weights": run.weights.model_copy(update={"store": str(tmp_path / "w")})})
    config = tmp_path / "run.json"
    config.write_text(run.model_dump_json())
    model_path = tmp_path / model
    if model == "empty":
        model_path.mkdir()
    argv = ["--config", str(config), "--buffer", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "run")]
    argv += ["--model-path", str(model_path), "--insecure-no-auth"]
    assert trainer_main.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith(f"mixrl trainer: --model-path: {model_path}: ")
    assert ("no such directory" in line) == (model == "missing")


@pytest.mark.parametrize("where", ["weights.store", "--run-dir"])
def test_a_store_or_run_directory_that_cannot_be_made_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A path the trainer cannot create (under a file here; a volume it may not write to in a pod)
    was an OSError's traceback."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    store = blocked / "weights" if where == "weights.store" else tmp_path / "w"
    run_dir = blocked / "run" if where == "--run-dir" else tmp_path / "run"
    run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    run = run.model_copy(update={"weights": run.weights.model_copy(update={"store": str(store)})})
    config = tmp_path / "run.json"
    config.write_text(run.model_dump_json())
    argv = ["--config", str(config), "--buffer", "http://127.0.0.1:9", "--run-dir", str(run_dir)]
    argv += ["--model-path", str(tiny_model_dir), "--insecure-no-auth"]
    assert trainer_main.main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("mixrl trainer: ") and "Not a directory" in last and str(blocked) in last
