"""The trainer's clock on the buffer's /metrics: what ``autoscaling.objective: trainer`` reads."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from mixrl.rl import metrics

from .conftest import group_of


async def scrape(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


async def test_wait_and_compute_time_of_the_trainer_are_exported(start_buffer) -> None:
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=2)
    wait, busy = (
        metrics.MIXRL_BUFFER_TRAINER_WAIT_SECONDS_TOTAL.name,
        metrics.MIXRL_BUFFER_TRAINER_BUSY_SECONDS.name,
    )
    assert await running.client.get_batch(1, timeout=0.3) is None  # no data: 0.3 s of idle trainer
    first = await scrape(running.url)
    assert 0.25 <= first[wait] < 2 and busy not in first
    waiting = asyncio.create_task(running.client.get_batch(1, timeout=10))
    await asyncio.sleep(0.4)
    await running.client.post_trajectories(group_of("a", 2))
    assert await asyncio.wait_for(waiting, 5) is not None
    await asyncio.sleep(0.5)  # the trainer "computes" step 1
    await running.client.commit(1)
    await running.client.post_trajectories(group_of("b", 2))
    assert await running.client.get_batch(2, timeout=5) is not None
    second = await scrape(running.url)
    assert second[wait] >= first[wait] + 0.35  # the wait for step 1's data
    assert 0.45 <= second[busy] < 3  # from handing out step 1 to asking for step 2


async def test_the_trainers_ranks_asking_for_one_step_count_one_wait(start_buffer) -> None:
    """A trainer of several ranks: rank 0 takes the step's batch (POST), rank 1 reads it (GET),
    both waiting for the same data; the trainer's wait is one rank's, not the sum over the ranks
    (its rate is the trainer's idle share, at most 1), and one batch is served."""
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=2)
    wait = metrics.MIXRL_BUFFER_TRAINER_WAIT_SECONDS_TOTAL.name
    started = asyncio.get_running_loop().time()
    rank0 = asyncio.create_task(running.client.get_batch(1, timeout=10))
    rank1 = asyncio.create_task(running.client.read_batch(1, timeout=10))
    await asyncio.sleep(0.5)
    await running.client.post_trajectories(group_of("a", 2))
    taken, read = await asyncio.wait_for(asyncio.gather(rank0, rank1), 10)
    elapsed = asyncio.get_running_loop().time() - started
    assert taken is not None and read is not None
    assert [g.prompt_id for g in read.groups] == [g.prompt_id for g in taken.groups] == ["a"]
    scraped = await scrape(running.url)
    assert 0.4 <= scraped[wait] <= elapsed  # two ranks' waits would be about twice the elapsed time
    assert scraped[metrics.MIXRL_BUFFER_BATCHES_TOTAL.name] == 1
