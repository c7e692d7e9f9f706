"""Bounded staleness per request (docs/api.md#bounded-staleness): with ``algorithm.maxStaleness``
the worker's training turns demand a minimum weight version, wait through the router's 409s
without counting them as failures, and give up (one log line, the group dropped) only after
``version_wait_s``.

Real: the worker, its router client, the router and the buffer over loopback; the test plays the
trainer (takes a batch, commits it) and the weight sync (moves a replica's version, then lets the
router probe it).  Stand-in: ``VersionedEngine``, the scripted policy's ``FakeEngine`` that also
answers ``/get_weight_version`` and tags its tokens with the version the test sets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from mixrl.rl.buffer.grouping import Group, TrajectoryMeta
from mixrl.rl.rollout.demos import demonstration_tokens
from mixrl.rl.rollout.router_client import RouterClient, VersionUnavailable
from mixrl.rl.rollout.worker import WorkerSettings, min_weight_version

from ..fakes import WeightVersionEngine, started_engines
from .conftest import TOKENIZER, StartBuffer, StartRouter, scripted_reply
from .test_agent import TASK
from .test_worker import polling_worker, resolved_run, running, wait_for


@dataclass
class VersionedEngine(WeightVersionEngine):
    """The scripted policy at weight version ``version`` (see the module docstring)."""

    def __post_init__(self) -> None:
        self.delay = 0.002

        def reply(body: dict[str, Any]) -> dict[str, Any]:
            return scripted_reply(version=self.version)(body)

        self.reply = reply


@pytest.fixture
async def versioned() -> AsyncIterator[Callable[..., Awaitable[VersionedEngine]]]:
    async with started_engines(VersionedEngine) as start:
        yield start


def group_of(version: int) -> Group:
    """A buffer group of one trajectory whose one generated token has ``version``."""
    return Group("p", (TrajectoryMeta.from_columns(0, "p", ("a", "cpu", "bf16"), [version], [1]),))


def test_the_minimum_keeps_every_token_fresh_enough_for_the_next_step() -> None:
    assert min_weight_version(7, None) is None, "no bound: fully asynchronous"
    assert [min_weight_version(5, s) for s in (0, 1, 2, 3, 9)] == [5, 5, 4, 3, 0]
    for committed in range(6):
        for staleness in range(1, 5):
            minimum = min_weight_version(committed, staleness)
            assert minimum is not None and 0 <= minimum <= committed
            # the buffer's own rule, at the first step that can take the group
            assert not group_of(minimum).is_stale(committed + 1, staleness)
            if minimum > 0:
                assert group_of(minimum - 1).is_stale(committed + 1, staleness), "one older is dropped"


def test_max_staleness_comes_from_the_run() -> None:
    run = resolved_run()
    bounded = run.model_copy(update={"trainer": run.trainer.model_copy(update={"max_staleness": 2})})
    assert WorkerSettings.from_run(run).max_staleness is None
    assert WorkerSettings.from_run(bounded).max_staleness == 2


async def test_turns_wait_for_fresh_weights_instead_of_failing(
    versioned: Any, start_router: StartRouter, start_buffer: StartBuffer
) -> None:
    behind, ahead = await versioned("behind"), await versioned("ahead")
    router = await start_router({"a": [behind, ahead]})
    buffer = await start_buffer(prompts_per_update=1, samples_per_prompt=4, max_staleness=1)
    # no back-pressure: nobody takes step 2, and the groups that waited must still be posted
    settings = dataclasses.replace(
        WorkerSettings.from_run(resolved_run()), evaluates=False, max_staleness=1, max_steps_ahead=0
    )
    client = RouterClient(router.url, settings.sampling, TOKENIZER.stop_token_ids, max_version_backoff_s=0.05)
    worker = polling_worker(settings, client, buffer)
    async with running(worker, client):
        await wait_for(lambda: worker.stats.groups_posted >= 1)
        # the trainer takes step 1 and commits it: turns now demand version 1, which nobody serves
        assert await buffer.client.get_batch(1) is not None
        await buffer.client.commit(1)
        await wait_for(lambda: client.version_waits > 0)
        await asyncio.sleep(0.1)  # turns begun before the commit (version 0 allowed) have ended
        dropped = worker.stats.groups_dropped
        # the weights reach one replica; the router reads its version at its next probe
        ahead.version = 1
        await router.router.poll_once()
        seen_behind, posted = len(behind.generate_bodies), worker.stats.groups_posted
        await wait_for(lambda: worker.stats.groups_posted >= posted + 2)
    assert len(behind.generate_bodies) == seen_behind, "no turn went to the replica that is behind"
    assert client.retries == 0, "a 409 is a wait, not a failing replica"
    assert worker.stats.groups_dropped == dropped == 0
    state = router.router.state
    assert state.version_refusals > 0 and state.replica("a", ahead.url).weight_version == 1


async def test_a_turn_gives_up_after_its_version_wait_with_one_line(
    versioned: Any, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    router = await start_router({"a": [await versioned("a", version=2)]})
    settings = WorkerSettings.from_run(resolved_run())
    ids, mask = demonstration_tokens(TASK, TOKENIZER)
    prompt = ids[: mask.index(1)]
    async with RouterClient(
        router.url,
        settings.sampling,
        TOKENIZER.stop_token_ids,
        version_wait_s=0.3,
        max_version_backoff_s=0.05,
    ) as client:
        with caplog.at_level(logging.INFO, logger="mixrl.rollout"):
            served = await client.generate("s", prompt, 4, min_version=2)
            assert served.records and {r.weight_version for r in served.records} == {2}
            with pytest.raises(
                VersionUnavailable, match=r"weight version 3 or newer within 0s \(newest: v2\)"
            ):
                await client.generate("s", prompt, 4, min_version=3)
    assert client.version_waits >= 2 and client.versions_unavailable == 1 and client.retries == 0
    waits = [r for r in caplog.records if "waiting for weights of version 3" in r.getMessage()]
    assert len(waits) == 1, "one line per turn, not one per retry"
    assert any(r.levelno == logging.WARNING and "within 0s" in r.getMessage() for r in caplog.records)
