"""``mixrl trainer``'s fatal errors are one line on stderr and an exit code, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.rl.trainer import main as trainer_main
from mixrl.rl.weights import WeightStore, WeightStoreError

from ..api.conftest import ROOT


def test_a_weight_store_refusal_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    run = run.model_copy(update={"weights": run.weights.model_copy(update={"store": str(tmp_path / "w")})})
    config = tmp_path / "run.json"
    config.write_text(run.model_dump_json())
    refusal = f"{tmp_path}/w/v00000000: already exists; published entries are immutable"

    def refuse(*args: object, **kwargs: object) -> str:
        raise WeightStoreError(refusal)

    monkeypatch.setattr(WeightStore, "publish", refuse)
    argv = ["--config", str(config), "--buffer", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "run")]
    argv += ["--model-path", str(tiny_model_dir), "--insecure-no-auth"]
    assert trainer_main.main(argv) == 1
    err = capsys.readouterr().err  # transformers' loading progress bars aside
    assert err.splitlines()[-1] == f"mixrl trainer: weight store: {refusal}" and "Traceback" not in err
