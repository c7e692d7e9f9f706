"""``mixrl evaluate`` (the BF16 evaluator) without processes: what ends it is one line on stderr and
exit code 1, never a traceback (an engine that never comes up, an engine that refuses the version,
an evaluation with tokens of other versions, a held-out episode failing its last try, the buffer),
and a SIGTERM while it waits for its engine stops it at once.  The whole evaluator runs in
tests/local/test_evaluator.py."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from mixrl.api.trajectory import TokenRecord, Trajectory
from mixrl.rl.buffer.client import BufferError
from mixrl.rl.engine.client import EngineError
from mixrl.rl.environments.registry import load_environment
from mixrl.rl.rollout import evaluator as evaluator_module
from mixrl.rl.rollout.agent import ScoringFailed
from mixrl.rl.rollout.evaluator import Evaluator, ForeignVersions, VersionNotLoaded, main
from mixrl.rl.rollout.worker import Loaded, WorkerSettings
from mixrl.rl.weights import WeightStore

from ..servers import free_port
from .conftest import TOKENIZER
from .test_evaluation_protocol import resolved


def loaded_evaluator() -> Loaded:
    run = resolved(sampler="bf16", everySteps=2)
    settings = WorkerSettings.from_run(run)
    return Loaded(
        run, settings, load_environment(settings.environment, settings.environment_args), TOKENIZER, None
    )


def evaluator_on(store: Path, engine: Any = None, sampler: Any = None) -> Evaluator:
    evaluator = Evaluator(loaded_evaluator(), engine, sampler, None)  # type: ignore[arg-type]
    evaluator.store = WeightStore(str(store))
    return evaluator


class RefusingEngine:
    """An engine that answers an update as SGLang answers one it tried and could not do."""

    async def update_weights_from_disk(self, path: str, version: int, **_: object) -> dict[str, Any]:
        return {"success": False, "message": "size mismatch for lm_head.weight"}

    async def get_weight_version(self) -> int:
        return 0


async def test_an_engine_that_refuses_the_version_is_a_named_error(tmp_path: Path) -> None:
    evaluator = evaluator_on(tmp_path, RefusingEngine())
    evaluator.store.publish(2, {"w": torch.zeros(2)})
    with pytest.raises(VersionNotLoaded, match=r"^the evaluator's engine refused version 2: size mismatch"):
        await evaluator.load(2)


async def test_tokens_of_another_version_are_a_named_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def run_episode(*_: object, **__: object) -> Trajectory:
        trajectory = Trajectory(run="test", prompt_id="t/eval", sample_index=0, pool="", prompt_ids=[1])
        trajectory.append_generated(TokenRecord(token_id=5, logprob=-0.1, weight_version=3))
        return trajectory

    monkeypatch.setattr(evaluator_module, "run_episode", run_episode)
    sampler = argparse.Namespace(generator=lambda _session: None, sampling=None)
    evaluator = evaluator_on(tmp_path, sampler=sampler)
    with pytest.raises(ForeignVersions, match=r"^step 2: tokens of versions \[3\] in its evaluation"):
        await evaluator.episode(2, evaluator.heldout[0], 0)


def in_task_group(exc: Exception) -> ExceptionGroup[Exception]:
    """``exc`` as an episode raises it through evaluate()'s task group."""
    return ExceptionGroup("unhandled errors in a TaskGroup", [exc])


@pytest.mark.parametrize(
    ("raised", "line"),
    [
        (
            EngineError("http://127.0.0.1:2 not healthy after 300 s"),
            "mixrl evaluate: engine: http://127.0.0.1:2 not healthy after 300 s",
        ),
        (
            VersionNotLoaded("the evaluator's engine refused version 2: size mismatch"),
            "mixrl evaluate: engine: the evaluator's engine refused version 2: size mismatch",
        ),
        (
            in_task_group(ForeignVersions("step 2: tokens of versions [3] in its evaluation")),
            "mixrl evaluate: evaluation: step 2: tokens of versions [3] in its evaluation",
        ),
        (
            in_task_group(ScoringFailed("FileTreeEnvironment: scoring task 'ft-1': KeyError: 'x'", "ft-1")),
            "mixrl evaluate: held-out evaluation: FileTreeEnvironment: scoring task 'ft-1': KeyError: 'x'",
        ),
        (
            BufferError("POST /evaluations: 401: no token"),
            "mixrl evaluate: buffer: POST /evaluations: 401: no token",
        ),
    ],
)
def test_mixrl_evaluate_ends_in_one_line(
    raised: Exception, line: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def serve(*_: object) -> int:
        raise raised

    loaded = argparse.Namespace(run=argparse.Namespace(evaluation_sampling=object()))
    monkeypatch.setattr(evaluator_module, "start", lambda *_: (argparse.Namespace(), loaded))
    monkeypatch.setattr(evaluator_module, "serve", serve)
    assert main([]) == 1
    assert capsys.readouterr().err == line + "\n"


async def test_a_sigterm_while_waiting_for_the_engine_stops_the_evaluator_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def stop_on_signals(event: asyncio.Event) -> Any:
        event.set()  # a SIGTERM as soon as the handlers are in place
        return lambda: None

    monkeypatch.setattr(evaluator_module, "stop_on_signals", stop_on_signals)
    nowhere = f"http://127.0.0.1:{free_port()}"  # an engine that never comes up
    args = argparse.Namespace(engine=nowhere, buffer=nowhere)
    assert await asyncio.wait_for(evaluator_module.serve(args, loaded_evaluator()), 10) == 0
