from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from .conftest import ROOT


def validate(*paths: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "validate", *map(str, paths)], capture_output=True, text=True
    )


def test_examples_are_valid() -> None:
    result = validate(ROOT / "examples")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("valid RLRun") == len(list((ROOT / "examples").glob("*.yaml")))


def test_one_line_per_problem_across_documents(tmp_path: Path) -> None:
    good = yaml.safe_load((ROOT / "examples" / "rlrun-homogeneous.yaml").read_text())
    bad = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
    bad["spec"]["samplerPools"][2]["weightPrecision"] = "nvfp4"
    bad["spec"]["samplerPools"][6]["weightPrecision"] = "nvfp4"
    path = tmp_path / "rlrun.yaml"
    path.write_text(yaml.safe_dump_all([good, bad]))
    result = validate(path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"{path}: valid RLRun 'qwen3-moe-coding-bf16'",
        f"{path}#1: spec.samplerPools[2].weightPrecision: nvfp4 needs FP4 tensor cores, which H200 lacks",
        f"{path}#1: spec.samplerPools[6].weightPrecision: nvfp4 needs FP4 tensor cores, which A100 lacks",
    ]


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    missing = validate(tmp_path / "nope.yaml")
    assert missing.returncode == 2 and "nope.yaml: no such file" in missing.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    result = validate(broken)
    assert result.returncode == 2 and "broken.yaml: not YAML at line" in result.stderr


def test_typos_do_not_pass(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "rlrun-homogeneous.yaml").read_text())
    doc["spec"]["algorithm"]["promptPerUpdate"] = 64
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = validate(path)
    assert result.returncode == 1
    assert (
        result.stdout.strip()
        == f"{path}: spec.algorithm.promptPerUpdate: unknown field (check the spelling; unknown fields are rejected)"
    )


def test_wrong_kind_and_api_version(tmp_path: Path) -> None:
    path = tmp_path / "kind.yaml"
    path.write_text("apiVersion: mixrl.dev/v1alpha1\nkind: Deployment\nmetadata: {name: x}\n")
    result = validate(path)
    assert (
        result.returncode == 1
        and "kind: expected one of RLRun, SamplerPool, got 'Deployment'" in result.stdout
    )


def test_an_empty_directory_fails(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a manifest")
    result = validate(tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [f"{tmp_path}: no *.yaml or *.yml files"]


def test_the_same_name_twice_fails_naming_both_files(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
    first, second, other_ns = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    first.write_text(yaml.safe_dump(doc))
    # the second file: an unrelated run, then the same name and namespace again
    renamed = {**doc, "metadata": {**doc["metadata"], "name": "other"}}
    second.write_text(yaml.safe_dump_all([renamed, doc]))
    other_ns.write_text(yaml.safe_dump({**doc, "metadata": {**doc["metadata"], "namespace": "rl2"}}))
    result = validate(first, second, other_ns)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == [
        f"{first}: valid RLRun 'qwen3-moe-coding'",
        f"{second}: valid RLRun 'other'",
        f"{second}#1: metadata.name: RLRun 'qwen3-moe-coding' (namespace 'rl') is also defined by {first}",
        f"{other_ns}: valid RLRun 'qwen3-moe-coding'",  # another namespace: another object
    ]


def test_the_same_name_without_namespace(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    path = tmp_path / "twice.yaml"
    path.write_text(yaml.safe_dump_all([doc, doc]))
    result = validate("-q", path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"{path}#1: metadata.name: RLRun 'quickstart' (no namespace) is also defined by {path}"
    ]


def test_a_document_of_garbage_prints_at_most_twenty_problems(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"].update({f"junk{i}": i for i in range(100)})
    path = tmp_path / "junk.yaml"
    path.write_text(yaml.safe_dump(doc))
    lines = validate(path).stdout.splitlines()
    assert len(lines) == 21 and lines[-1] == f"{path}: ... and 80 more problems"


def test_an_unknown_environment_or_tool_is_rejected_before_any_pod_starts(tmp_path: Path) -> None:
    """The rollout worker cannot play them: ``mixrl validate`` (and the operator) refuse the spec."""
    doc = yaml.safe_load((ROOT / "examples" / "rlrun-homogeneous.yaml").read_text())
    cases = {
        "swe": (
            {"environment": "swebench"},
            "spec.rollout.environment: unknown environment 'swebench'; built in: filetree, coding, coding-plain"
            " (or your own as package.module:ClassName)",
        ),
        "bash": (
            {"tools": ["ls", "bash", "submit"]},
            "spec.rollout.tools: ['bash'] not offered by filetree (it has ls, cat, submit)",
        ),
        "nosubmit": (
            {"tools": ["ls", "cat"]},
            "spec.rollout.tools: without submit no episode can earn a reward",
        ),
    }
    for name, (rollout, line) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**doc, "spec": {**doc["spec"], "rollout": rollout}}))
        result = validate(path)
        assert (result.returncode, result.stdout.splitlines()) == (1, [f"{path}: {line}"])


def test_the_built_in_environments_offer_exactly_the_tools_the_rollout_implements() -> None:
    from mixrl.api.models import ENVIRONMENT_TOOLS
    from mixrl.rl.environments import coding, filetree
    from mixrl.rl.environments.coding.environment import TOOLS as CODING_TOOLS
    from mixrl.rl.environments.registry import BUILT_IN, environment_class

    coding_tools = tuple(tool.name for tool in CODING_TOOLS)
    assert {
        "filetree": filetree.TOOLS,
        "coding": coding_tools,
        "coding-plain": coding_tools,
    } == ENVIRONMENT_TOOLS
    assert environment_class("coding") is coding.CodingEnvironment
    assert environment_class("coding-plain") is coding.PlainCodingEnvironment
    assert BUILT_IN.keys() == ENVIRONMENT_TOOLS.keys()


def test_a_spec_with_sandbox_pods_needs_no_bubblewrap_where_it_is_validated(tmp_path: Path) -> None:
    """Its commands run in sandbox pods: a machine without bubblewrap (PATH without bwrap here) can
    validate it, and still refuses the same spec with the local sandbox."""
    doc = yaml.safe_load((ROOT / "examples" / "rlrun-coding.yaml").read_text())
    local = tmp_path / "local.yaml"
    local.write_text(yaml.safe_dump({**doc, "metadata": {"name": "coding-local"}}))
    doc["spec"]["rollout"]["sandbox"] = {}
    pods = tmp_path / "pods.yaml"
    pods.write_text(yaml.safe_dump(doc))
    no_bwrap = tmp_path / "bin"
    no_bwrap.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "validate", str(pods), str(local)],
        capture_output=True, text=True, env={**os.environ, "PATH": str(no_bwrap)}, check=False,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    assert lines[0] == f"{pods}: valid RLRun 'coding'", result.stdout + result.stderr
    assert lines[1].startswith(f"{local}: ") and "bubblewrap ('bwrap') is not installed" in lines[1]
