"""The buffer's token: every POST needs it and changes nothing without it; the GET reads stay open.

Real: the buffer on loopback over a real directory (its logs compared byte for byte), ``BufferClient``,
``mixrl buffer`` as a process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mixrl.rl.auth import AuthToken, write_token_file
from mixrl.rl.buffer.client import BufferClient, BufferError

from ..servers import cli_server, environment_without_token, run_cli
from .conftest import RunningBuffer, StartBuffer, group_of, write_run_config

TOKEN = AuthToken("buffer-test-token-" + "b" * 24)
RIGHT = {"Authorization": f"Bearer {TOKEN.reveal()}"}
WRONG = {"Authorization": "Bearer not-the-run-token-0123456789"}


def logs(buffer: RunningBuffer) -> dict[str, bytes]:
    """Every file of the buffer's directory, byte for byte."""
    return {p.name: p.read_bytes() for p in sorted(buffer.buffer.dir.iterdir()) if p.is_file()}


async def post(
    url: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}{path}", json=body, headers=headers or {}) as response,
    ):
        return response.status, await response.json() if response.status != 204 else None


async def assert_refused_and_unchanged(buffer: RunningBuffer, path: str, body: Any = None) -> None:
    before, stats = logs(buffer), buffer.buffer.stats()
    for headers in ({}, WRONG, {"Authorization": TOKEN.reveal()}):  # no token, a wrong one, no scheme
        status, answer = await post(buffer.url, path, body, headers)
        assert status == 401, (headers, answer)
        assert answer["error"].startswith("unauthorized: ") and TOKEN.reveal() not in answer["error"]
    assert logs(buffer) == before and buffer.buffer.stats() == stats


def trajectories(prompt: str, size: int) -> list[dict[str, Any]]:
    return [t.model_dump(mode="json") for t in group_of(prompt, size)]


async def test_every_write_needs_the_token_and_changes_nothing_without_it(start_buffer: StartBuffer) -> None:
    buffer = await start_buffer(prompts_per_update=1, samples_per_prompt=2, auth_token=TOKEN)

    await assert_refused_and_unchanged(buffer, "/trajectories", trajectories("a", 2))
    assert buffer.buffer.stats()["trajectories"] == 0
    status, answer = await post(buffer.url, "/trajectories", trajectories("a", 2), RIGHT)
    assert (status, answer) == (200, {"accepted": 2, "groups_completed": 1, "duplicates": 0})

    await assert_refused_and_unchanged(buffer, "/batch?step=1&timeout=0")
    assert buffer.buffer.stats()["batches"] == 0  # nothing assigned to step 1
    status, batch = await post(buffer.url, "/batch?step=1&timeout=0", headers=RIGHT)
    assert status == 200 and [g["prompt_id"] for g in batch["groups"]] == ["a"]

    report = {"prompt_ids": ["a"], "reason": "a poster without the token"}
    await assert_refused_and_unchanged(buffer, "/quarantine?step=1", report)
    assert buffer.buffer.stats()["quarantined"] == []  # step 1 keeps its batch

    await assert_refused_and_unchanged(buffer, "/commit?step=1")
    assert buffer.buffer.stats()["committed_step"] is None
    assert await post(buffer.url, "/commit?step=1", headers=RIGHT) == (
        200,
        {"step": 1, "committed": True, "already": False},
    )

    evaluation = {"step": 1, "weight_version": 1, "pass_at_k": {"1": 0.5}}
    await assert_refused_and_unchanged(buffer, "/evaluations", evaluation)
    assert buffer.buffer.evaluations == []
    assert (await post(buffer.url, "/evaluations", evaluation, RIGHT))[0] == 200


async def test_reads_stay_open(start_buffer: StartBuffer) -> None:
    buffer = await start_buffer(prompts_per_update=1, samples_per_prompt=2, auth_token=TOKEN)
    await buffer.client.post_trajectories(group_of("a", 2))
    await buffer.client.get_batch(1, timeout=0)
    async with aiohttp.ClientSession() as http:
        for path in ("/batch?step=1&timeout=0", "/evaluations", "/stats", "/health", "/metrics"):
            async with http.get(f"{buffer.url}{path}") as response:
                assert response.status == 200, path
    async with BufferClient(buffer.url) as reader:  # no token at all
        assert (await reader.read_batch(1, timeout=0)) == (await buffer.client.get_batch(1, timeout=0))
        assert (await reader.stats())["batches"] == 1


async def test_a_client_without_the_token_gets_one_401_and_no_retries(start_buffer: StartBuffer) -> None:
    buffer = await start_buffer(prompts_per_update=1, samples_per_prompt=2, auth_token=TOKEN)
    async with BufferClient(buffer.url, retries=5, backoff_s=10.0) as anonymous:
        for call in (
            anonymous.post_trajectories(group_of("a", 2)),
            anonymous.get_batch(1, timeout=0),
            anonymous.commit(0),
            anonymous.post_evaluation(0, 0, {1: 0.5}),
        ):
            with pytest.raises(BufferError, match=r"^POST /\w+: 401: unauthorized: ") as caught:
                await asyncio.wait_for(call, 5)  # a retry would wait 10 s
            assert caught.value.status == 401
    assert buffer.buffer.stats()["trajectories"] == 0


# ----------------------------------------------------------------------------------- the process


def sizes(tmp_path: Path) -> tuple[str, str]:
    """The buffer's ``--config``: one group of two per step."""
    return ("--config", str(write_run_config(tmp_path / "run.json", prompts=1, samples=2)))


def test_without_a_token_the_buffer_refuses_to_start_with_one_line(tmp_path: Path) -> None:
    flags = ("--dir", str(tmp_path / "buf"), *sizes(tmp_path))
    result = run_cli("buffer", *flags, env=environment_without_token())
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "mixrl buffer: no auth token: give --auth-token-file PATH or set MIXRL_AUTH_TOKEN "
        "(--insecure-no-auth runs without one, open to anyone who reaches the port)",
    )
    assert not (tmp_path / "buf").exists()  # refused before touching its directory


async def test_the_buffer_process_checks_the_token_and_never_logs_it(tmp_path: Path) -> None:
    token_file, port_file = tmp_path / "auth-token", tmp_path / "port"
    write_token_file(token_file, TOKEN)
    assert token_file.stat().st_mode & 0o777 == 0o600
    flags = ("--dir", str(tmp_path / "buf"), *sizes(tmp_path), "--auth-token-file", str(token_file))
    async with cli_server("buffer", port_file, *flags, env=environment_without_token()) as (process, url):
        assert (await post(url, "/trajectories", trajectories("a", 2), WRONG))[0] == 401
        assert (await post(url, "/commit?step=0"))[0] == 401
        async with BufferClient(url, auth_token=TOKEN) as client:
            assert await client.post_trajectories(group_of("a", 2)) == 1
            assert (await client.stats())["trajectories"] == 2
    stderr = (await process.stderr.read()).decode()  # type: ignore[union-attr]
    assert "refused POST /trajectories from 127.0.0.1: wrong token" in stderr
    assert TOKEN.reveal() not in stderr and "not-the-run-token" not in stderr
