"""``weights.broadcast`` through a real ``mixrl run``: the trainer process finds the BF16 pool's
engines through the router and broadcasts each version to them (SGLang's distributed-update
contract, gloo here), while the nvfp4 pool loads the same versions from the store."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import small_run
from .test_run import mixrl_run

pytestmark = pytest.mark.slow

STEPS = 3


def test_a_run_broadcasts_each_version_to_its_bf16_engines_and_the_store_serves_the_others(
    tmp_path: Path, model_cache: Path
) -> None:
    spec = small_run(tmp_path, "bcast", steps=STEPS)
    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["weights"] = {"broadcast": True}
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        mixrl_run(spec, run_dir, model_cache), capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    logs = {path.name: path.read_text() for path in (run_dir / "logs").glob("*.log")}
    trainer = next(text for name, text in logs.items() if name.startswith("trainer"))
    sent = [
        int(v) for v, n in re.findall(r"broadcast version (\d+) to (\d+) engines", trainer) if int(n) >= 1
    ]
    assert sent == list(range(1, STEPS + 1)), trainer[-3000:]
    assert "failed (the store serves it)" not in trainer

    def versions(text: str, source: str) -> list[int]:
        return [int(v) for v in re.findall(rf"weights updated to version (\d+) from {source}", text)]

    bf16 = {name: text for name, text in logs.items() if "bf16" in name and name.startswith("engine")}
    nvfp4 = {name: text for name, text in logs.items() if "nvfp4" in name and name.startswith("engine")}
    assert bf16 and nvfp4, sorted(logs)
    for name, text in bf16.items():  # every version by the broadcast, none from the store
        assert versions(text, "broadcast") == list(range(1, STEPS + 1)), (name, text[-2000:])
        assert versions(text, "(?!broadcast)") == [], name
    for name, text in nvfp4.items():  # the store (converted to nvfp4 once), never the broadcast
        assert versions(text, "(?!broadcast)"), (name, text[-2000:])
        assert versions(text, "broadcast") == [], name
