"""The buffer's door: a trajectory that breaks the run's contract is refused with one line and
nothing of its post is stored; a repeated post is stored once, a clashing one refused; a batch the
trainer cannot train is quarantined, and its step goes on with other groups, across restarts."""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from mixrl.rl.buffer.client import BufferClient, BufferError
from mixrl.rl.buffer.grouping import StepError
from mixrl.rl.buffer.store import ASSIGNMENTS, QUARANTINE, TrajectoryBuffer

from .conftest import StartBuffer, group_of, make_trajectory


async def test_an_impossible_trajectory_is_refused_naming_it_and_nothing_of_the_post_is_stored(
    start_buffer: StartBuffer,
) -> None:
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=2)
    group = group_of("a", 2)
    group[1].logprobs[3] = math.nan  # the second generated token (after two tool tokens)
    with pytest.raises(BufferError, match=r"400: trajectories\[1\]\.logprobs\[3\]: nan is not") as refused:
        await running.client.post_trajectories(group)
    assert "\n" not in str(refused.value)
    other_run = group_of("b", 2)
    other_run[0].run = "someone-else"
    with pytest.raises(BufferError, match=r"400: trajectories\[0\]\.run: 'someone-else' is not this run"):
        await running.client.post_trajectories(other_run)
    beyond = group_of("c", 2)
    beyond[1].sample_index = 7
    with pytest.raises(BufferError, match=r"sample_index: 7 is not below samplesPerPrompt \(2\)"):
        await running.client.post_trajectories(beyond)
    stats = await running.client.stats()
    assert (stats["trajectories"], stats["groups_partial"]) == (0, 0)


async def test_versions_are_bounded_by_the_trainers_next_step(start_buffer: StartBuffer) -> None:
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=1)
    with pytest.raises(BufferError, match=r"weight_version\[0\]: 2 is newer than the latest version \(1\)"):
        await running.client.post_trajectories([make_trajectory("a", versions=(2, 2))])
    await running.client.post_trajectories([make_trajectory("a", versions=(1, 1))])
    await running.client.get_batch(1)
    await running.client.commit(1)
    await running.client.post_trajectories([make_trajectory("b", versions=(2, 2))])


async def test_a_whole_group_post_refuses_a_stray_or_a_missing_sample(start_buffer: StartBuffer) -> None:
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=3)
    stray = group_of("a", 3)
    stray[2].prompt_id = "b"
    with pytest.raises(BufferError, match=r"400: trajectories\[2\]\.prompt_id: 'b' in the group of 'a'"):
        await running.client.post_trajectories(stray, group="a")
    with pytest.raises(BufferError, match=r"group 'a' needs sample indices 0\.\.2 once each, got \[0, 1\]"):
        await running.client.post_trajectories(group_of("a", 2), group="a")
    assert (await running.client.stats())["trajectories"] == 0
    assert await running.client.post_trajectories(group_of("a", 3), group="a") == 1


async def test_a_repeated_post_is_stored_once_and_a_clash_is_refused(start_buffer: StartBuffer) -> None:
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=2)
    assert await running.client.post_trajectories(group_of("a", 2)) == 1
    assert await running.client.post_trajectories(group_of("a", 2)) == 0  # acknowledged, not stored again
    stats = await running.client.stats()
    assert (stats["trajectories"], stats["groups_ready"], stats["duplicates"]) == (2, 1, 2)
    clash = group_of("a", 2)
    clash[1].reward = 0.0
    with pytest.raises(BufferError, match=r"409: trajectories\[1\]: prompt 'a' sample 1 was already posted"):
        await running.client.post_trajectories(clash)
    twice = [make_trajectory("b", 0), make_trajectory("b", 0, reward=0.5)]
    with pytest.raises(BufferError, match="409"):
        await running.client.post_trajectories(twice)
    assert (await running.client.stats())["trajectories"] == 2
    batch = await running.client.get_batch(1, timeout=1)
    assert batch is not None and len(batch.trajectories) == 2  # trained once, not twice


@asynccontextmanager
async def answer_lost_once(upstream: str) -> AsyncIterator[str]:
    """A loopback proxy to ``upstream`` that forwards the first request but drops its answer (the
    connection closes as the answer starts), and relays everything after it: a lost answer."""
    host, port = upstream.removeprefix("http://").split(":")
    dropped = asyncio.Event()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, drop: bool) -> None:
        try:
            while chunk := await reader.read(65536):
                if drop:
                    dropped.set()
                    break
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.close()

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        drop = not dropped.is_set()
        await asyncio.gather(
            pipe(client_reader, up_writer, False),
            pipe(up_reader, client_writer, drop),
            return_exceptions=True,
        )

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_a_post_whose_answer_was_lost_is_retried_and_stored_once(start_buffer: StartBuffer) -> None:
    """The client the rollout worker uses retries a post it has no answer to (at least once); the
    buffer had stored the first attempt, so the retry is acknowledged without a second copy."""
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=2)
    async with (
        answer_lost_once(running.url) as proxied,
        BufferClient(proxied, retries=3, backoff_s=0.05) as client,
    ):
        assert await client.post_trajectories(group_of("a", 2), group="a") == 0  # the retry's answer
    stats = await running.client.stats()
    assert (stats["trajectories"], stats["groups_ready"], stats["duplicates"]) == (2, 1, 2)


def test_a_quarantined_batch_is_never_served_again_and_its_step_takes_the_next_groups(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2) as buffer:
        for prompt in "abc":
            buffer.append(group_of(prompt, 2))
        first = buffer.batch(1)
        assert first is not None and json.loads(first.body)["groups"][0]["prompt_id"] == "a"
        with pytest.raises(StepError, match="those prompts are not the step's batch"):
            buffer.quarantine(1, ["b"], "wrong batch named")
        entry = buffer.quarantine(1, ["a"], "the trainer crashed on it (IndexError: ...)")
        assert entry["file"] == f"{QUARANTINE}/step-1-0.json"
        assert (tmp_path / entry["file"]).read_bytes() == first.body  # kept as it was served
        again = buffer.batch(1)
        assert again is not None and json.loads(again.body)["groups"][0]["prompt_id"] == "b"
        buffer.commit(1)
        with pytest.raises(StepError, match="step 1 is committed"):
            buffer.quarantine(1, ["b"], "too late")
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2) as restarted:
        stats = restarted.stats()
        assert [q["prompt_ids"] for q in stats["quarantined"]] == [["a"]]
        assert stats["committed_step"] == 1 and stats["groups_ready"] == 1
        served = restarted.batch(1)
        assert served is not None and json.loads(served.body)["groups"][0]["prompt_id"] == "b"
        assert restarted.batch(2) is not None  # c: the quarantined a is in no later batch either
        assert json.loads(restarted.batch(2).body)["groups"][0]["prompt_id"] == "c"  # type: ignore[union-attr]


def test_a_quarantined_batch_is_on_disk_before_its_record_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quarantine record names a file: that file's bytes, then its name in the folder, are
    fsynced before the record is, so a power loss never leaves a record pointing at nothing."""
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2) as buffer:
        buffer.append(group_of("a", 2))
        assert buffer.batch(1) is not None
        synced: list[tuple[int, int]] = []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            stat = os.fstat(fd)
            synced.append((stat.st_dev, stat.st_ino))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        entry = buffer.quarantine(1, ["a"], "the trainer crashed on it")
        monkeypatch.undo()

    def identity(path: Path) -> tuple[int, int]:
        stat = path.stat()
        return stat.st_dev, stat.st_ino

    file = identity(tmp_path / entry["file"])
    folder = identity(tmp_path / QUARANTINE)
    record = identity(tmp_path / ASSIGNMENTS)
    assert file in synced and folder in synced and record in synced, synced
    assert synced.index(file) < synced.index(folder) < synced.index(record)
    assert identity(tmp_path) in synced[: synced.index(file)]  # the folder's own name, before all


async def test_quarantine_over_http_counts_in_stats_and_metrics(start_buffer: StartBuffer) -> None:
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=2)
    await running.client.post_trajectories(group_of("a", 2))
    await running.client.post_trajectories(group_of("b", 2))
    assert (await running.client.get_batch(1)) is not None
    entry = await running.client.quarantine(1, ["a"], "tokens[3]: outside the vocabulary")
    assert entry["step"] == 1 and entry["reason"] == "tokens[3]: outside the vocabulary"
    with pytest.raises(BufferError, match="409: step 1 has no batch to quarantine"):
        await running.client.quarantine(1, ["a"], "a second report")
    batch = await running.client.get_batch(1)
    assert batch is not None and [g.prompt_id for g in batch.groups] == ["b"]
    with pytest.raises(BufferError, match="409: step 1: those prompts are not the step's batch"):
        await running.client.quarantine(1, ["a"], "a late report from another rank")  # b stays
    metrics = await running.client._http().get(f"{running.url}/metrics")
    text = await metrics.text()
    assert 'mixrl_buffer_quarantined_batches_total{run="test"} 1.0' in text
    assert 'mixrl_buffer_batches_total{run="test"} 2.0' in text  # served twice: never counts back
