"""The Dockerfiles under images/ (no container engine runs here, so they are read, not built)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mixrl.api.resolve import MIXRL_IMAGE_PREFIX, SGLANG_IMAGE
from mixrl.operator.objects import Images
from mixrl.operator.podspec import RUN_AS_USER

IMAGES = Path(__file__).resolve().parents[2] / "images"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_every_image_of_the_design_has_a_dockerfile() -> None:
    assert {p.parent.name for p in DOCKERFILES} == {
        "operator",
        "components",
        "trainer-torch",
        "trainer-megatron",
        "engine-torch",
        "sglang",
    }
    # The names the operator and resolve() put into pod specs are the ones documented for these files.
    readme = (IMAGES / "README.md").read_text()
    for name in (
        Images().components.split(":")[0],
        f"{MIXRL_IMAGE_PREFIX}-engine",
        f"{MIXRL_IMAGE_PREFIX}-operator",
    ):
        assert f"`{name}`" in readme
    for backend in ("torch", "megatron"):
        assert f"`{MIXRL_IMAGE_PREFIX}-trainer-{backend}`" in readme
    assert SGLANG_IMAGE.split(":")[0] in (IMAGES / "sglang" / "Dockerfile").read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_is_multi_stage_pinned_and_non_root(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in steps if word == "ARG" and "=" in rest
    }
    froms = [rest for word, rest in steps if word == "FROM"]
    assert len(froms) >= 2 and " AS build" in froms[0], "a build stage, then the runtime stage"
    for image in froms:
        reference = image.split(" AS ")[0].strip()
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], reference)
        assert ":" in resolved and not resolved.endswith(":latest"), f"unpinned base {resolved}"
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1] == f"{RUN_AS_USER}:{RUN_AS_USER}", "runs as the uid the pods require"
    final_stage = steps[max(i for i, (word, _) in enumerate(steps) if word == "FROM") :]
    assert any(word == "COPY" and "--from=build" in rest for word, rest in final_stage)
    assert any(word == "RUN" and "useradd --uid 1000" in rest for word, rest in final_stage)
    entry = [rest for word, rest in steps if word == "ENTRYPOINT"]
    expected = (
        '["python3", "-m", "sglang.launch_server"]' if dockerfile.parent.name == "sglang" else '["mixrl"]'
    )
    assert entry == [expected]
    assert (dockerfile.parent / "Dockerfile.dockerignore").read_text().count(".venv") >= 1
