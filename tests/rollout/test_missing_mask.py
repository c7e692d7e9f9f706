"""A truncating rule's support must arrive: the rollout fails loudly when it does not.

The run samples with top-p 0.95, top-k 8, so every ``/generate`` body sets ``return_sampling_mask``.
sglang-router 0.3.2 re-serialises bodies without that field (tests/router_sglang), and SGLang then
answers without ``output_token_sampling_mask``; read as it stands, every token would look sampled
from the full distribution (support 0) and the corrections would be wrong without a sign.

Stand-in: a FakeEngine replica playing the scripted policy (tests/rollout/conftest.py) behind a
``dropping`` proxy step written as code, which removes ``return_sampling_mask`` from the body before
the policy answers, as that router does.  Real: the router client, the rollout worker, and
``mixrl rollout`` as a process against the real buffer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mixrl.rl.engine.protocol import SamplingMaskMissing
from mixrl.rl.rollout.router_client import RouterClient
from mixrl.rl.rollout.worker import RolloutWorker

from ..fakes import FakeEngine
from .conftest import TOKENIZER, Engines, StartBuffer, StartRouter, scripted_reply
from .test_agent import TASK
from .test_worker import FILETREE, SETTINGS, rollout_flags, run_rollout, worker_behind_router


def dropping(body: dict[str, Any]) -> dict[str, Any]:
    """The scripted policy's answer to the body as sglang-router 0.3.2 forwards it."""
    return scripted_reply()({k: v for k, v in body.items() if k != "return_sampling_mask"})


async def test_the_support_arrives_or_the_turn_fails_naming_the_field(
    start_buffer: StartBuffer,
) -> None:
    """Directly against one replica (the client also talks to engines): the same episode, with the
    field carried and with it dropped."""
    assert SETTINGS.sampling.rule.top_p < 1 and SETTINGS.sampling.return_sampling_mask
    buffer = await start_buffer(prompts_per_update=1, samples_per_prompt=1)
    carried = await FakeEngine("carried", reply=scripted_reply()).start()
    dropped = await FakeEngine("dropped", reply=dropping).start()
    try:
        async with RouterClient(carried.url, SETTINGS.sampling, TOKENIZER.stop_token_ids) as client:
            worker = RolloutWorker(SETTINGS, FILETREE, TOKENIZER, client, buffer.client)
            trajectory = await worker.play(TASK, 0, "p0")
        generated = [i for i, m in enumerate(trajectory.loss_mask) if m]
        assert generated and all(trajectory.support_size[i] == 1 for i in generated)
        async with RouterClient(dropped.url, SETTINGS.sampling, TOKENIZER.stop_token_ids) as client:
            worker = RolloutWorker(SETTINGS, FILETREE, TOKENIZER, client, buffer.client)
            with pytest.raises(SamplingMaskMissing, match=r"^output_token_sampling_mask: absent"):
                await worker.play(TASK, 0, "p0")
        assert len(dropped.generate_bodies) == 1  # the first turn, not retried
    finally:
        await carried.kill()
        await dropped.kill()


async def test_the_worker_stops_instead_of_dropping_groups(
    engines: Engines, start_router: StartRouter, start_buffer: StartBuffer
) -> None:
    engine = await engines("a", reply=dropping)
    async with worker_behind_router(engine, start_router, start_buffer, say=lambda _: None) as (
        worker,
        buffer,
    ):
        # the step-0 evaluation meets it first, and the worker ends on it
        stopping = asyncio.Event()
        with pytest.raises(BaseException) as raised:
            await asyncio.wait_for(worker.run(stopping), 30)
        assert _leaves(raised.value) and all(
            isinstance(e, SamplingMaskMissing) for e in _leaves(raised.value)
        )
    assert worker.stats.groups_dropped == 0 and worker.stats.episodes == 0
    assert buffer.buffer.stats()["trajectories"] == 0


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


async def test_mixrl_rollout_ends_with_one_line_naming_the_field(
    tmp_path: Path, engines: Engines, start_router: StartRouter, start_buffer: StartBuffer
) -> None:
    router = await start_router({"a": [await engines("a", reply=dropping)]})
    buffer = await start_buffer(prompts_per_update=100, samples_per_prompt=4)
    result = await run_rollout(*rollout_flags(tmp_path, router, buffer), "--insecure-no-auth")
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "mixrl rollout: engine: output_token_sampling_mask: absent although the request set"
    )
    assert "Traceback" not in result.stderr
    assert buffer.buffer.stats()["trajectories"] == 0 and buffer.buffer.stats()["evaluations"] == 0
