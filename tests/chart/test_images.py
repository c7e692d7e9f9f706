"""The Dockerfiles under images/ (no container engine runs here, so they are read, not built)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from mixrl.api.resolve import MIXRL_IMAGE_PREFIX, SGLANG_IMAGE
from mixrl.operator.builders.objects import Images
from mixrl.operator.builders.podspec import RUN_AS_USER

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


# ----------------------------------------------------------------------------- pinned dependencies

CONSTRAINTS = IMAGES / "constraints.txt"
PYPROJECT = IMAGES.parent / "pyproject.toml"


def constraint_pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, equals, version = line.partition("==")
            assert equals and version and " " not in line, f"not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def pip_installs(dockerfile: Path) -> list[list[str]]:
    """The arguments of every ``pip install`` the Dockerfile runs, ARG values filled in."""
    steps = instructions(dockerfile)
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in steps if word == "ARG" and "=" in rest
    }
    out = []
    for word, rest in steps:
        if word != "RUN":
            continue
        for command in rest.split("&&"):
            tokens = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), command))
            if tokens[:2] == ["pip", "install"]:
                out.append(tokens[2:])
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_every_runtime_install_is_pinned(dockerfile: Path) -> None:
    """No open version range: each requirement is ``==``, or a name images/constraints.txt pins
    (installed with ``--constraint``); a local wheel brings its dependencies under the same rule."""
    pins = constraint_pins()
    for install in pip_installs(dockerfile):
        constrained = "/tmp/constraints.txt" in install
        if constrained:
            copied = [rest for word, rest in instructions(dockerfile) if word == "COPY"]
            assert "images/constraints.txt /tmp/constraints.txt" in copied
        values = {
            install[i + 1] for i, token in enumerate(install) if token in ("--constraint", "--index-url")
        }
        for token in install:
            if token.startswith("-") or token in values:
                continue
            if token.startswith("/wheels/"):  # mixrl's wheel: its dependencies are resolved too
                assert constrained or "--no-deps" in install, f"{dockerfile.parent.name}: {install}"
                continue
            requirement = Requirement(token)
            name = canonicalize_name(requirement.name)
            exact = [s.version for s in requirement.specifier if s.operator == "=="]
            if exact:
                assert len(requirement.specifier) == 1, token
                assert name not in pins or pins[name] == exact[0], (
                    f"{token} but constraints.txt says {pins[name]}"
                )
            else:
                assert not requirement.specifier, f"{dockerfile.parent.name}: open range {token}"
                assert constrained and name in pins, f"{dockerfile.parent.name}: {token} is not pinned"


def test_the_constraints_pin_every_runtime_dependency_within_pyproject() -> None:
    import tomllib

    project = tomllib.loads(PYPROJECT.read_text())["project"]
    pins = constraint_pins()
    for text in project["dependencies"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "torch":  # TORCH_SPEC, or the CUDA base image's own
            assert name not in pins
            continue
        assert name in pins, f"{name} is not pinned in images/constraints.txt"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {text}"
    megatron = Requirement(next(r for r in project["optional-dependencies"]["megatron"] if "megatron" in r))
    installs = pip_installs(IMAGES / "trainer-megatron" / "Dockerfile")
    (pinned,) = [Requirement(t) for install in installs for t in install if t.startswith("megatron-core")]
    (spec,) = pinned.specifier
    assert spec.operator == "==" and megatron.specifier.contains(spec.version), str(pinned)


def test_the_operator_image_installs_every_package_the_operator_imports() -> None:
    """The operator's image installs mixrl with --no-deps and names its packages itself: each one
    that ``mixrl operator`` imports at start must be among them (prometheus_client was not, and the
    chart's operator pod crash-looped on the real node)."""
    import importlib.metadata
    import subprocess
    import sys

    started = (
        "mixrl.operator.main",
        "mixrl.operator.autoscaling.loop",
        "mixrl.operator.controller.handlers",
        "mixrl.operator.controller.observer",
        "mixrl.operator.controller.runtime",
    )
    # A fresh interpreter, so what the rest of the suite imported does not count.
    probe = (
        f"import sys, {', '.join(started)}; print(' '.join(sorted({{n.split('.')[0] for n in sys.modules}})))"
    )
    modules = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    distributions = importlib.metadata.packages_distributions()
    needed = {canonicalize_name(d) for m in modules for d in distributions.get(m, []) if m != "mixrl"}
    needed -= {"mixrl", "kubernetes-validate"}  # the kubernetes client tries it and does without
    installed = {
        canonicalize_name(Requirement(token).name)
        for install in pip_installs(IMAGES / "operator" / "Dockerfile")
        for previous, token in zip(["", *install], install, strict=False)
        if not token.startswith(("-", "/")) and previous not in ("--constraint", "--index-url")
    }
    # What those packages pull in themselves comes with them; only mixrl's own requirements are named.
    import tomllib

    direct = {
        canonicalize_name(Requirement(r).name)
        for r in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    }
    assert (needed & direct) - installed == set(), (
        f"images/operator/Dockerfile lacks {sorted((needed & direct) - installed)}"
    )
