"""spec.health: one line per bad value, `pause` refused as not implemented, the CRD the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.errors import InvalidSpec
from mixrl.api.loader import load_rlrun
from mixrl.api.models import CollapseSpec

ROOT = Path(__file__).resolve().parents[2]


def with_health(tmp_path: Path, health: dict[str, Any]) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["health"] = health
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def problems(tmp_path: Path, health: dict[str, Any]) -> list[str]:
    with pytest.raises(InvalidSpec) as caught:
        load_rlrun(with_health(tmp_path, health))
    return [str(problem) for problem in caught.value.problems]


def test_the_defaults_and_a_valid_block(tmp_path: Path) -> None:
    assert load_rlrun(ROOT / "examples" / "quickstart.yaml").spec.health.collapse == CollapseSpec()
    spec = load_rlrun(
        with_health(tmp_path, {"collapse": {"klGrowth": 4, "rewardWindow": 20}, "action": "none"})
    )
    assert spec.spec.health.collapse.kl_growth == 4.0 and spec.spec.health.collapse.reward_window == 20


def test_one_line_per_bad_value(tmp_path: Path) -> None:
    bad = {"klGrowth": 1.0, "rewardDrop": 1.5, "formatErrorShare": -0.1, "window": 0, "baselineSteps": True}
    lines = problems(tmp_path, {"collapse": bad})
    assert len(lines) == len(bad)
    for field in bad:
        assert any(line.startswith(f"spec.health.collapse.{field}: ") for line in lines), (field, lines)
    assert all("\n" not in line for line in lines)


def test_pause_is_refused_as_not_implemented(tmp_path: Path) -> None:
    assert problems(tmp_path, {"action": "pause"}) == [
        "spec.health.action: pause is not implemented yet (only none: raised signs are reported, not acted on)"
    ]
    (line,) = problems(tmp_path, {"action": "stop"})
    assert line.startswith("spec.health.action: ") and "'none'" in line


def test_the_crd_refuses_what_python_refuses() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "rlruns.mixrl.dev.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    health = spec["properties"]["health"]["properties"]
    assert health["action"]["enum"] == ["none"]
    collapse = health["collapse"]["properties"]
    assert collapse["klGrowth"]["minimum"] == 1 and collapse["klGrowth"]["exclusiveMinimum"] is True
    assert collapse["rewardDrop"]["maximum"] == 1
