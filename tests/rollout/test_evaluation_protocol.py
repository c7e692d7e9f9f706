"""``evaluation.sampler: bf16`` without processes: which steps are evaluated, which versions the
trainer keeps for the evaluator, the evaluator's engine and command line, the worker's part, and
the operator's refusal.  The whole evaluator runs in tests/local/test_evaluator.py."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest
import torch
import yaml

from mixrl.api.errors import InvalidSpec
from mixrl.api.evaluation import evaluated_steps, evaluation_steps, protected_versions
from mixrl.api.launch import Where, component_command
from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import EVALUATOR_POOL, ResolvedRun, resolve
from mixrl.operator.controller.reconcile import resolve_run
from mixrl.rl.rollout.worker import WorkerSettings
from mixrl.rl.weights import WeightStore

ROOT = Path(__file__).resolve().parents[2]


def quickstart(**evaluation: object) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["evaluation"].update(evaluation)
    return doc


def resolved(**evaluation: object) -> ResolvedRun:
    run = parse_document(quickstart(**evaluation))
    assert isinstance(run, RLRun)
    return resolve(run)


def test_evaluation_steps_start_at_zero_and_end_at_the_last_step() -> None:
    assert list(evaluation_steps(20, 50)) == [0, 20, 40, 50]
    assert list(evaluation_steps(10, 30)) == [0, 10, 20, 30]  # the last step once, not twice
    assert list(islice(evaluation_steps(5, None), 4)) == [0, 5, 10, 15]


def test_the_trainer_keeps_only_the_versions_still_to_be_evaluated() -> None:
    run = resolved(everySteps=2, sampler="bf16")
    total = run.trainer.spec.total_steps
    evaluated = evaluated_steps(
        [{"step": 0, "protocol": "bf16"}, {"step": 2}, {"step": 4, "protocol": "pools"}]
    )
    assert evaluated == {0}  # only the BF16 evaluator's own count
    assert protected_versions(run, range(7), evaluated) == {2, 4, 6}
    assert total not in range(7) and protected_versions(run, [total - 1, total], set()) == {total}
    assert protected_versions(resolved(everySteps=2), range(7), set()) == set()


def test_pruning_spares_protected_versions(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path))
    for version in range(6):
        store.publish(version, {"w": torch.full((2,), float(version))})
    assert store.prune(2, protect={1, 3}) == [0, 2]
    assert store.versions() == [1, 3, 4, 5]


def test_the_evaluator_has_its_own_bf16_engine_and_full_vocabulary_sampling() -> None:
    run = resolved(sampler="bf16")
    pool, sampling = run.evaluation_pool, run.evaluation_sampling
    assert pool is not None and sampling is not None
    assert (pool.name, pool.engine, pool.weight_precision, pool.kv_cache_dtype) == (
        EVALUATOR_POOL,
        "torch",
        "bf16",
        "bf16",
    )
    assert pool.name not in {p.name for p in run.pools}  # the router never sees it
    assert (sampling.top_p, sampling.top_k, sampling.return_sampling_mask) == (1.0, -1, False)
    assert sampling.temperature == run.sampling.temperature
    assert run.sampling.top_p < 1.0  # the quickstart trains with top-p: the evaluation does not
    plain = resolved()
    assert plain.evaluation_pool is None and plain.evaluation_sampling is None


def test_the_launch_table_starts_the_evaluator_against_its_engine() -> None:
    run = resolved(sampler="bf16")
    where = Where(
        program=("mixrl",),
        host="127.0.0.1",
        config="/run/resolved.json",
        auth_token_file="/run/token",
        buffer_dir="/run/buffer",
        trainer_run_dir="/run",
        buffer_url="http://127.0.0.1:1",
        evaluator_engine_url="http://127.0.0.1:2",
        engine_model_path="/run/weights/v00000000",
        port_dir="/run/ports",
    )
    command = component_command(run, "evaluator", where)
    assert command[:2] == ["mixrl", "evaluate"]
    assert command[command.index("--engine") + 1] == "http://127.0.0.1:2"
    assert command[command.index("--buffer") + 1] == "http://127.0.0.1:1"
    assert command[command.index("--auth-token-file") + 1] == "/run/token"
    engine = component_command(run, "engine", where, run.evaluation_pool)
    assert engine[engine.index("--weight-precision") + 1] == "bf16"
    assert engine[engine.index("--pool") + 1] == EVALUATOR_POOL
    with pytest.raises(ValueError, match="evaluator engine's URL"):
        component_command(run, "evaluator", Where(**{**where.__dict__, "evaluator_engine_url": None}))


def test_the_rollout_worker_evaluates_only_on_the_pools_protocol() -> None:
    assert WorkerSettings.from_run(resolved()).evaluates
    assert not WorkerSettings.from_run(resolved(sampler="bf16")).evaluates


def test_only_worker_0_evaluates_on_the_pools() -> None:
    """With several workers one held-out evaluation per step, not one per worker."""
    doc = quickstart()
    doc["spec"]["rollout"]["workers"] = 3
    run = parse_document(doc)
    assert isinstance(run, RLRun)
    evaluates = [WorkerSettings.from_run(resolve(run), i).evaluates for i in range(3)]
    assert evaluates == [True, False, False]


def test_a_pool_cannot_take_the_evaluators_name() -> None:
    doc = quickstart()
    doc["spec"]["samplerPools"][0]["name"] = EVALUATOR_POOL
    with pytest.raises(InvalidSpec, match="reserved"):
        parse_document(doc)


def test_the_operator_refuses_the_bf16_evaluator_in_one_line() -> None:
    doc = quickstart(sampler="bf16")
    body = {
        "apiVersion": doc["apiVersion"],
        "kind": "RLRun",
        "metadata": doc["metadata"],
        "spec": doc["spec"],
    }
    with pytest.raises(InvalidSpec) as refused:
        resolve_run(body)
    assert refused.value.first_line.startswith("spec.evaluation.sampler: bf16 (the BF16 evaluator) runs with")
    resolve_run({**body, "spec": quickstart()["spec"]})  # the pools protocol is accepted
