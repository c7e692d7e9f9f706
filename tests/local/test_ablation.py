"""``mixrl ablate``: the arms and fleets as RLRun documents (pure), the table from run directories,
and a fast study end to end (two arms, one fleet, one seed, a few steps) through the real runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.loader import parse_document
from mixrl.api.resolve import resolve
from mixrl.local.ablation import (
    ARMS,
    FLEETS,
    KERNELS,
    arm_document,
    manifest_mismatch,
    routing_lines,
    study_command,
    study_table,
)

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())


@pytest.mark.parametrize("arm", list(ARMS))
@pytest.mark.parametrize("fleet", FLEETS)
def test_every_arm_and_fleet_is_a_valid_run_that_differs_only_where_it_should(arm: str, fleet: str) -> None:
    doc = arm_document(QUICKSTART, ARMS[arm], fleet, seed=2)
    resolved = resolve(parse_document(doc))
    algorithm = parse_document(doc).spec.algorithm
    spec = ARMS[arm]
    assert (algorithm.corrections.mis is not None) == spec.mis
    assert algorithm.corrections.score_centering == spec.score_centering
    if spec.top_p:
        assert (algorithm.top_p.p, algorithm.top_p.k, algorithm.top_p.mask_replay) == (0.95, 32, spec.replay)
    else:  # the whole vocabulary: neither a nucleus nor a top-k cut
        assert (algorithm.top_p.p, algorithm.top_p.k) == (1.0, -1)
    precisions = [pool.weight_precision for pool in resolved.pools]
    assert precisions == (["bf16"] * 4 if fleet == "bf16" else ["nvfp4", "mxfp4", "fp8", "bf16"])
    routing = resolved.health.routing
    assert (routing is not None) == (fleet == "mixed-health")
    if routing is not None:  # the router is started with --buffer to read the mismatch
        assert routing.kl_threshold == 0.003
    assert all(pool.engine_args[-2:] == ("--random-seed", "2") for pool in resolved.pools)
    # serving kernels by default: BF16 activations and split-KV attention in every torch pool
    assert all(pool.engine_args[-6:-2] == tuple(KERNELS["serving"]) for pool in resolved.pools)
    as_trainer = resolve(
        parse_document(arm_document(QUICKSTART, ARMS[arm], fleet, seed=2, kernels="trainer"))
    )
    assert all("--dtype" not in pool.engine_args for pool in as_trainer.pools)
    assert QUICKSTART["spec"]["algorithm"]["topP"]["p"] == 0.95  # the input is left as it was
    # Everything else is the study's RLRun: tasks, model, trainer, evaluation, the latter by the
    # BF16 evaluator unless the study asks for the pools.
    for key in ("model", "trainer", "rollout"):
        assert doc["spec"][key] == QUICKSTART["spec"][key]
    assert doc["spec"]["evaluation"] == {**QUICKSTART["spec"]["evaluation"], "sampler": "bf16"}
    assert resolved.evaluation_pool is not None
    on_pools = arm_document(QUICKSTART, ARMS[arm], fleet, seed=2, evaluation="pools")
    assert resolve(parse_document(on_pools)).evaluation_pool is None


def figures(final: float, kl: float, signs: list[str]) -> dict[str, Any]:
    return {
        "final_pass1": final, "best_pass1": final + 0.1, "fresh_kl_k3": kl, "fresh_kl_k1": kl,
        "format_error_endings": 0.1, "signs": signs, "pool_shares": {},
    }  # fmt: skip


def test_the_table_gives_means_spreads_collapses_and_the_fleet_ratio() -> None:
    runs = {
        "sc-mis-topp-mixed-s0": figures(0.8, 0.004, []),
        "sc-mis-topp-mixed-s1": figures(0.6, 0.006, ["kl_growing(run)"]),
        "sc-mis-topp-bf16-s0": figures(0.9, 0.001, []),
        "sc-mis-topp-bf16-s1": figures(0.9, 0.001, []),
    }
    lines, rows = study_table(runs, ["sc-mis-topp"], ["mixed", "bf16"], seeds=2)
    mixed = rows["sc-mis-topp/mixed"]
    assert mixed["final_pass1"][0] == pytest.approx(0.7) and mixed["final_pass1"][2] == 2
    assert mixed["final_pass1"][1] == pytest.approx(0.1414, rel=1e-3)  # standard deviation over seeds
    assert mixed["collapsed"] == 1 and mixed["fresh_kl_ratio_to_bf16"] == pytest.approx(5.0)
    assert "| SC+MIS+top-p replay | mixed | 2 | 0.700 ± 0.141 | 0.800 ± 0.141 | 1/2 |" in lines[2]
    assert "| SC+MIS+top-p replay | k3 | 5.0× |" in lines


def test_the_routing_table_is_per_fleet_and_pool_and_absent_for_a_dense_model() -> None:
    runs = {
        "grpo-mixed-s0": {**figures(0.5, 0.01, []), "pool_routing": {"nvfp4": 0.2, "bf16": 0.01}},
        "grpo-mixed-s1": {**figures(0.5, 0.01, []), "pool_routing": {"nvfp4": 0.3, "bf16": 0.03}},
        "grpo-mixed-health-s0": {**figures(0.5, 0.01, []), "pool_routing": {"nvfp4": 0.9}},
        "grpo-bf16-s0": {**figures(0.5, 0.01, []), "pool_routing": {"bf16-0": 0.02}},
    }
    lines = routing_lines(runs)
    assert "| mixed | nvfp4 | 25.0% | 2 |" in lines and "| mixed | bf16 | 2.0% | 2 |" in lines
    assert "| mixed-health | nvfp4 | 90.0% | 1 |" in lines and "| bf16 | bf16-0 | 2.0% | 1 |" in lines
    assert routing_lines({"grpo-mixed-s0": figures(0.5, 0.01, [])}) == []  # dense: no routing measured


@pytest.mark.slow  # whole mixrl runs (every component a process): also serial (tests/conftest.py)
def test_a_fast_study_runs_resumes_and_writes_its_table(tmp_path: Path) -> None:
    fast = tmp_path / "fast.yaml"
    run = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    run["spec"]["samplerPools"] = run["spec"]["samplerPools"][:2]
    run["spec"]["algorithm"].update(promptsPerUpdate=4, samplesPerPrompt=4)
    run["spec"]["evaluation"] = {"everySteps": 2, "passK": [1], "samplesPerTask": 1, "tasks": 8}
    fast.write_text(yaml.safe_dump(run))
    out = tmp_path / "study"
    command = [sys.executable, "-m", "mixrl.cli", "ablate", str(fast), "--arms", "grpo,sc-mis-topp",
               "--fleets", "mixed", "--seeds", "1", "--steps", "2", "--out", str(out)]  # fmt: skip
    first = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "[2/2]" in first.stdout and "ETA" in first.stdout
    study = json.loads((out / "ablation.json").read_text())
    assert set(study["runs"]) == {"grpo-mixed-s0", "sc-mis-topp-mixed-s0"}
    assert all(run["steps"] == 2 and run["final_pass1"] is not None for run in study["runs"].values())
    table = (out / "ablation.md").read_text()
    assert "| GRPO | mixed | 1 |" in table and "| SC+MIS+top-p replay | mixed | 1 |" in table
    assert (out / "ablation.png").stat().st_size > 5000
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)  # resumes: nothing left
    assert again.returncode == 0 and again.stdout.count("done before") == 2, again.stdout


def test_bad_arguments_get_one_line() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mixrl.cli",
            "ablate",
            str(ROOT / "examples" / "quickstart.yaml"),
            "--arms",
            "ppo",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "mixrl ablate: --arms: 'ppo' is not one of grpo, grpo-mis, sc, grpo-topp, sc-mis, sc-mis-topp"
    )


def test_the_recorded_command_names_every_flag_that_changes_the_runs() -> None:
    # --evaluation included: without it, re-running a `--evaluation pools` study's recorded command
    # would evaluate with the BF16 default.
    command = study_command(Path("fast.yaml"), ["grpo", "sc-mis-topp"], ["mixed"], 3, 40, "pools", "trainer")
    assert command == (
        "mixrl ablate fast.yaml --arms grpo,sc-mis-topp --fleets mixed --seeds 3 --steps 40 "
        "--evaluation pools --kernels trainer"
    )


def test_a_manifest_is_checked_against_the_run_it_would_now_be(tmp_path: Path) -> None:
    manifest = tmp_path / "grpo-mixed-s0.yaml"
    wanted = arm_document(QUICKSTART, ARMS["grpo"], "mixed", 0)
    assert manifest_mismatch(manifest, wanted) is None  # nothing ran there yet
    # As YAML data: the same document in another key order is the same run.
    manifest.write_text(yaml.safe_dump(wanted, sort_keys=True))
    assert manifest_mismatch(manifest, wanted) is None
    for other in (
        arm_document(QUICKSTART, ARMS["grpo"], "mixed", 0, evaluation="pools"),
        arm_document(QUICKSTART, ARMS["grpo"], "mixed", 0, kernels="trainer"),
    ):
        manifest.write_text(yaml.safe_dump(other, sort_keys=False))
        assert "another RLRun or other flags" in (manifest_mismatch(manifest, wanted) or "")
    manifest.write_text("spec: [unclosed\n")
    assert "not valid YAML" in (manifest_mismatch(manifest, wanted) or "")


def _ablate_quickstart(out: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mixrl.cli", "ablate", str(ROOT / "examples" / "quickstart.yaml"),
               "--arms", "grpo", "--fleets", "mixed", "--seeds", "1", "--steps", "2", "--out", str(out)]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_a_rerun_with_other_settings_is_refused_before_anything_starts(tmp_path: Path) -> None:
    # A run left by a `--evaluation pools` study; this one asks for the BF16 default.
    runs = tmp_path / "study" / "runs"
    runs.mkdir(parents=True)
    made = arm_document(QUICKSTART, ARMS["grpo"], "mixed", 0, evaluation="pools")
    (runs / "grpo-mixed-s0.yaml").write_text(yaml.safe_dump(made, sort_keys=False))
    (runs / "grpo-mixed-s0").mkdir()
    (runs / "grpo-mixed-s0" / "summary.json").write_text(json.dumps({"steps": 2}))
    result = _ablate_quickstart(tmp_path / "study")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.strip() == (
        f"mixrl ablate: {runs / 'grpo-mixed-s0.yaml'}: that run was made from another RLRun or other flags "
        f"(--evaluation/--kernels); use another --out, or delete {runs / 'grpo-mixed-s0'}* to redo it"
    )
    assert result.stdout == ""  # nothing started, nothing skipped as "done before"
    assert not (runs / "grpo-mixed-s0.log").exists() and not (tmp_path / "study" / "ablation.md").exists()
    assert yaml.safe_load((runs / "grpo-mixed-s0.yaml").read_text()) == made  # left as it was


def test_a_rerun_with_the_same_settings_still_skips_its_finished_run(tmp_path: Path) -> None:
    runs = tmp_path / "study" / "runs"
    runs.mkdir(parents=True)
    made = arm_document(QUICKSTART, ARMS["grpo"], "mixed", 0)  # what run_job wrote for these flags
    (runs / "grpo-mixed-s0.yaml").write_text(yaml.safe_dump(made, sort_keys=False))
    (runs / "grpo-mixed-s0").mkdir()
    (runs / "grpo-mixed-s0" / "summary.json").write_text(json.dumps({"steps": 2}))
    result = _ablate_quickstart(tmp_path / "study")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "grpo-mixed-s0: done before" in result.stdout
    table = (tmp_path / "study" / "ablation.md").read_text()
    assert "--evaluation bf16 --kernels serving`" in table  # the recorded command, as run
