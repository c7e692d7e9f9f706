"""The buffer over real loopback HTTP, through BufferClient."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.api.trajectory import TokenRecord, Trajectory
from mixrl.rl.buffer.client import BufferError
from mixrl.rl.buffer.server import body_limit

from .conftest import FullDisk, group_of, make_trajectory


async def test_post_group_batch_commit_round_trip(start_buffer) -> None:
    running = await start_buffer(prompts_per_update=2, samples_per_prompt=3)
    client = running.client
    assert await client.post_trajectories(group_of("a", 3, versions=(0, 1))) == 1
    assert await client.get_batch(1, timeout=0) is None  # one group of the two needed
    assert await client.post_trajectories(group_of("b", 2, pool="nvfp4")) == 0
    assert await client.post_trajectories([make_trajectory("b", 2, pool="nvfp4").model_dump()]) == 1
    batch = await client.get_batch(1, timeout=0)
    assert batch is not None and batch.step == 1
    assert [g.prompt_id for g in batch.groups] == ["a", "b"]
    assert batch.trajectories == [*group_of("a", 3, versions=(0, 1)), *group_of("b", 3, pool="nvfp4")]
    assert [s.max for s in batch.groups[0].staleness] == [1, 1, 1]
    assert batch.staleness.tokens == 12 and batch.staleness.max == 1
    again = await client.get_batch(1, timeout=0)
    assert again == batch
    assert await client.read_batch(1, timeout=0) == batch  # GET reads the same batch
    await client.commit(1)
    await client.commit(1)  # idempotent
    stats = await client.stats()
    assert (stats["step"], stats["committed_step"], stats["groups_ready"], stats["trajectories"]) == (
        1,
        1,
        0,
        6,
    )


async def test_long_poll_wakes_when_data_arrives(start_buffer) -> None:
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=2)
    started = time.monotonic()
    waiting = asyncio.create_task(running.client.get_batch(1, timeout=20))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await running.client.post_trajectories(group_of("a", 1))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # half a group does not wake it up for good
    await running.client.post_trajectories([make_trajectory("a", 1)])
    batch = await asyncio.wait_for(waiting, 5)
    assert batch is not None and [g.prompt_id for g in batch.groups] == ["a"]
    assert time.monotonic() - started < 5  # woke on arrival, not at the 20 s timeout


async def test_long_poll_times_out_with_no_batch(start_buffer) -> None:
    running = await start_buffer()
    started = time.monotonic()
    assert await running.client.get_batch(1, timeout=0.3) is None
    assert 0.25 < time.monotonic() - started < 3


async def test_two_waiters_for_the_same_step_get_the_same_batch(start_buffer) -> None:
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=1)
    waiters = [asyncio.create_task(running.client.get_batch(1, timeout=10)) for _ in range(2)]
    reader = asyncio.create_task(running.client.read_batch(1, timeout=10))  # another rank: reads only
    await asyncio.sleep(0.2)
    await running.client.post_trajectories([make_trajectory("a"), make_trajectory("b")])
    first, second, read = await asyncio.gather(*waiters, reader)
    assert first == second == read and [g.prompt_id for g in first.groups] == ["a"]
    await running.client.commit(1)
    assert [g.prompt_id for g in (await running.client.get_batch(2, timeout=0)).groups] == ["b"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt_id": "a"}, "body: expected a JSON list of trajectories"),
        ([{"prompt_id": "a", "pool": "p"}], "trajectories[0].prompt_ids: Field required"),
        (
            [make_trajectory("a").model_dump(), {**make_trajectory("b").model_dump(), "loss_mask": [1]}],
            "trajectories[1]: loss_mask has 1 entries for 4 tokens",
        ),
        ([{**make_trajectory("a").model_dump(), "reward": None}], "trajectories[0].reward: missing"),
        ([{**make_trajectory("a").model_dump(), "split": "heldout"}], "trajectories[0].split: 'heldout'"),
        (
            [{**make_trajectory("a").model_dump(), "cand_ids": [[1], "x", [], [2]]}],
            "trajectories[0].cand_ids[1]:",
        ),
    ],
)
async def test_malformed_posts_get_400_naming_the_field_and_change_nothing(
    start_buffer, body, message
) -> None:
    running = await start_buffer()
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{running.url}/trajectories", json=body) as response:
            assert response.status == 400
            error = (await response.json())["error"]
        async with http.post(f"{running.url}/trajectories", data=b"{not json") as response:
            assert response.status == 400
            assert (await response.json())["error"].startswith("body: not JSON")
    assert error.startswith(message), error
    assert "\n" not in error
    assert (await running.client.stats())["trajectories"] == 0
    assert (running.buffer.dir / "trajectories.jsonl").read_bytes() == b""


async def test_bad_query_parameters_and_step_conflicts(start_buffer) -> None:
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=1)
    async with aiohttp.ClientSession() as http:
        for method, path, status, message in [
            ("POST", "/batch", 400, "step: required query parameter"),
            ("GET", "/batch?step=x", 400, "step: expected an integer, got 'x'"),
            ("POST", "/batch?step=1&timeout=-1", 400, "timeout: must be within [0, 600] seconds"),
            ("POST", "/batch?step=" + "9" * 5000, 400, "step: expected an integer, got '99999"),
        ]:
            async with http.request(method, f"{running.url}{path}") as response:
                assert response.status == status
                error = (await response.json())["error"]
                assert error.startswith(message) and len(error) < 300, error
    with pytest.raises(BufferError, match="step 3 has no batch to commit") as caught:
        await running.client.commit(3)
    assert caught.value.status == 409
    await running.client.post_trajectories([make_trajectory("a")])
    await running.client.get_batch(1, timeout=0)
    await running.client.commit(1)
    with pytest.raises(BufferError, match="not after the last committed step 1"):
        await running.client.get_batch(0, timeout=0)


async def test_no_client_can_take_groups_from_the_trainer_or_block_its_commits(start_buffer) -> None:
    """``GET /batch`` never assigns; a batch or commit for any step but the trainer's next is a 409
    with one line, and nothing of it reaches the logs: the trainer's steps go on as before."""
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=2)
    await running.client.post_trajectories([*group_of("a", 2), *group_of("b", 2)])
    logs = {
        name: (running.buffer.dir / name).read_bytes() for name in ("trajectories.jsonl", "assignments.jsonl")
    }
    huge = 10**18
    async with aiohttp.ClientSession() as http:
        for method, path in [
            ("GET", f"/batch?step={huge}&timeout=0"),
            ("POST", f"/batch?step={huge}&timeout=0"),
            ("POST", "/batch?step=2&timeout=0"),
            ("POST", "/batch?step=0&timeout=0"),
            ("POST", f"/commit?step={huge}"),
            ("POST", "/commit?step=1"),
        ]:
            async with http.request(method, f"{running.url}{path}") as response:
                assert response.status == 409, (method, path, response.status)
                error = (await response.json())["error"]
                assert error and "\n" not in error
        # A read of the trainer's next step waits for the trainer and never takes its groups.
        async with http.get(f"{running.url}/batch?step=1&timeout=0") as response:
            assert response.status == 204
    assert {name: (running.buffer.dir / name).read_bytes() for name in logs} == logs
    stats = await running.client.stats()
    assert (stats["groups_ready"], stats["batches"], stats["step"], stats["committed_step"]) == (
        2,
        0,
        None,
        None,
    )
    for step, prompt in ((1, "a"), (2, "b")):  # the trainer's steps, undisturbed
        batch = await running.client.get_batch(step, timeout=0)
        assert [g.prompt_id for g in batch.groups] == [prompt]
        await running.client.commit(step)
    assert (await running.client.stats())["committed_step"] == 2


async def test_deeply_nested_json_is_a_400(start_buffer) -> None:
    running = await start_buffer()
    deep = b"[" * 100_000 + b"]" * 100_000
    async with aiohttp.ClientSession() as http:
        for path in ("/trajectories", "/evaluations"):
            async with http.post(f"{running.url}{path}", data=deep) as response:
                assert response.status == 400
                assert (await response.json())["error"] == "body: not JSON (nested too deeply)"
    assert (await running.client.stats())["trajectories"] == 0


async def test_staleness_filter_over_http(start_buffer) -> None:
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=2, max_staleness=0)
    await running.client.post_trajectories(group_of("stale", 2, versions=(0, 1)))
    await running.client.post_trajectories(group_of("ok", 2, versions=(1, 1)))
    batch = await running.client.get_batch(1, timeout=0)
    assert [g.prompt_id for g in batch.groups] == ["ok"]
    assert batch.staleness.max == 0
    stats = await running.client.stats()
    assert stats["dropped_stale"] == 1


async def test_evaluations_round_trip_and_validation(start_buffer) -> None:
    running = await start_buffer()
    await running.client.post_evaluation(step=10, weight_version=9, pass_at_k={1: 0.25, 4: 0.5}, tasks=32)
    evaluations = await running.client.evaluations()
    assert len(evaluations) == 1
    assert {k: evaluations[0][k] for k in ("step", "weight_version", "pass_at_k", "tasks")} == {
        "step": 10,
        "weight_version": 9,
        "pass_at_k": {"1": 0.25, "4": 0.5},
        "tasks": 32,
    }
    with pytest.raises(BufferError, match=r"evaluation.pass_at_k: pass@1 = 1.5 is outside \[0, 1\]"):
        await running.client.post_evaluation(step=11, weight_version=9, pass_at_k={1: 1.5})
    with pytest.raises(BufferError, match=r"evaluation.step: Input should be greater than or equal to 0"):
        await running.client.post_evaluation(step=-1, weight_version=9, pass_at_k={1: 0.5})
    assert (await running.client.stats())["evaluations"] == 1


async def test_metrics_exported(start_buffer) -> None:
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=2)
    await running.client.post_trajectories(group_of("a", 2, versions=(0, 1), pool="fp8"))
    await running.client.post_trajectories(group_of("b", 1, versions=(1, 1), pool="nvfp4"))
    await running.client.get_batch(1, timeout=0)
    await running.client.post_evaluation(step=3, weight_version=2, pass_at_k={1: 0.4})
    async with aiohttp.ClientSession() as http, http.get(f"{running.url}/metrics") as response:
        text = await response.text()
    samples = {
        (s.name, s.labels.get("pool"), s.labels.get("le") or s.labels.get("k")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("mixrl_buffer_trajectories_received_total", "fp8", None)] == 2
    assert samples[("mixrl_buffer_trajectories_received_total", "nvfp4", None)] == 1
    assert samples[("mixrl_buffer_trajectories", "fp8", None)] == 0
    assert samples[("mixrl_buffer_trajectories", "nvfp4", None)] == 1
    assert samples[("mixrl_buffer_groups_partial", None, None)] == 1
    assert samples[("mixrl_buffer_batches_total", None, None)] == 1
    assert samples[("mixrl_buffer_step", None, None)] == 1
    # fp8 tokens at step 1: versions 0 and 1 in each of two trajectories -> staleness 1, 0, 1, 0.
    assert samples[("mixrl_buffer_staleness_bucket", "fp8", "0.0")] == 2
    assert samples[("mixrl_buffer_staleness_bucket", "fp8", "1.0")] == 4
    assert samples[("mixrl_buffer_staleness_sum", "fp8", None)] == 2
    assert samples[("mixrl_buffer_eval_pass_at_k", None, "1")] == 0.4


async def test_a_client_gone_mid_body_stores_nothing_and_logs_no_traceback(
    start_buffer, caplog: pytest.LogCaptureFixture
) -> None:
    running = await start_buffer()
    host, port = running.url.removeprefix("http://").split(":")
    body = b'[{"prompt_id": "p", "sample_index": 0'  # the start of a body announced much longer
    with caplog.at_level(logging.INFO):
        _, writer = await asyncio.open_connection(host, int(port))
        head = f"POST /trajectories HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        writer.write((head + "Content-Length: 100000\r\n\r\n").encode() + body)
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        for _ in range(100):  # until the server has seen the connection go
            if any("went away" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.02)
    assert any("went away" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert (await running.client.stats())["trajectories"] == 0  # nothing half-stored
    assert (running.buffer.dir / "trajectories.jsonl").read_text() == ""


WORST_LOGPROB = -2.2250738585072014e-308  # the longest float64 repr
WORST_ID = 2**31 - 1


def largest_group(samples: int, context_tokens: int, candidates: int) -> list[Trajectory]:
    """A group as large as a run lets it be: a one-token prompt, then generated tokens up to the
    context limit, each with K candidates, every number at its longest JSON form (but the weight
    version, which the buffer bounds by the trainer's next step)."""
    group = []
    for index in range(samples):
        trajectory = Trajectory(
            run="test",
            prompt_id="p" * 200,
            sample_index=index,
            pool="pool",
            prompt_ids=[WORST_ID],
            reward=WORST_LOGPROB,
            finish_reason="context_limit",
            num_turns=WORST_ID,
        )
        record = TokenRecord(
            token_id=WORST_ID,
            logprob=WORST_LOGPROB,
            cand_ids=[WORST_ID - j for j in range(candidates)],
            cand_logprobs=[WORST_LOGPROB] * candidates,
            support_size=candidates,
            weight_version=1,
        )
        for _ in range(context_tokens - 1):
            trajectory.append_generated(record)
        group.append(trajectory)
    return group


async def test_the_body_limit_fits_the_largest_group_of_the_run_and_no_more(start_buffer) -> None:
    run = resolve(load_rlrun(Path(__file__).parents[2] / "examples" / "quickstart.yaml"))
    limit = body_limit(run)
    group = largest_group(
        run.trainer.samples_per_prompt, run.model.max_context_tokens, run.sampling.top_logprobs_num
    )
    body = json.dumps([t.model_dump(mode="json") for t in group])  # as the buffer client sends it
    assert len(body) <= limit < 3 * len(body)  # always fits, yet a bound, not a guess of gigabytes
    running = await start_buffer(
        samples_per_prompt=run.trainer.samples_per_prompt,
        max_body_bytes=limit,
        candidates=run.sampling.top_logprobs_num,
    )
    assert await running.client.post_trajectories(group) == 1  # accepted whole: the group is complete
    assert (await running.client.stats())["trajectories"] == len(group)


async def test_a_body_beyond_the_limit_gets_413_and_stores_nothing(start_buffer) -> None:
    running = await start_buffer(samples_per_prompt=2, max_body_bytes=4096)
    with pytest.raises(BufferError, match="413: Maximum request body size 4096 exceeded") as refused:
        await running.client.post_trajectories(largest_group(2, 64, 4))
    assert refused.value.status == 413 and "\n" not in str(refused.value)
    assert (await running.client.stats())["trajectories"] == 0
    assert (running.buffer.dir / "trajectories.jsonl").read_text() == ""


async def test_a_full_disk_is_one_line_and_stores_nothing(
    start_buffer, caplog: pytest.LogCaptureFixture
) -> None:
    """A log the buffer cannot write answers 503 naming the reason (not aiohttp's 500 and a
    traceback); nothing of the request is stored, and the same post goes through once there is room."""
    running = await start_buffer(prompts_per_update=1, samples_per_prompt=2)
    real = running.buffer._traj_log
    running.buffer._traj_log = FullDisk(real)
    with caplog.at_level(logging.ERROR), pytest.raises(BufferError) as refused:
        await running.client.post_trajectories(group_of("a", 2), group="a")
    assert refused.value.status == 503
    assert "No space left on device" in str(refused.value) and "nothing" in str(refused.value)
    assert not any(record.exc_info for record in caplog.records)  # one line, no traceback
    assert (await running.client.stats())["trajectories"] == 0
    running.buffer._traj_log = real
    assert await running.client.post_trajectories(group_of("a", 2), group="a") == 1
    batch = await running.client.get_batch(1, timeout=0)
    assert batch is not None and batch.trajectories == group_of("a", 2)
