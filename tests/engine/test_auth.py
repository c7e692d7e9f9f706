"""The engine's token: every control endpoint needs it, generation and reads stay open.

Real: the engine's HTTP app on loopback (in this process, and ``mixrl engine`` as a child process
for the command line and its log), the weight store, ``EngineClient``.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from safetensors.torch import load_file

from mixrl.local.processes import EngineProcess
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine import server
from mixrl.rl.engine.client import EngineClient, EngineError
from mixrl.rl.engine.service import EngineService
from mixrl.rl.weights import WeightStore

from .conftest import serve_in_process

TOKEN = AuthToken("engine-test-token-" + "k" * 24)
RIGHT = {"Authorization": f"Bearer {TOKEN.reveal()}"}
WRONG = {"Authorization": "Bearer not-the-run-token-0123456789"}
BAD_HEADERS = {
    "no token": {},
    "wrong token": WRONG,
    "another scheme": {"Authorization": "Basic dXNlcjpwdw=="},
}


@pytest.fixture
async def guarded(
    dense_path: str, tmp_path: Path
) -> AsyncIterator[tuple[str, EngineService, aiohttp.ClientSession, WeightStore]]:
    """An engine requiring TOKEN, with version 3 of its own weights in a store under its weight root."""
    store = WeightStore(str(tmp_path / "store"))
    config = json.loads((Path(dense_path) / "config.json").read_text())
    state = load_file(Path(dense_path) / "model.safetensors")
    await asyncio.to_thread(store.publish, 3, state, {"step": 3}, config)
    async with (
        serve_in_process(auth_token=TOKEN, model_path=dense_path, weight_root=str(tmp_path)) as (
            url,
            service,
        ),
        aiohttp.ClientSession(base_url=url) as http,
    ):
        yield url, service, http, store


async def call(
    http: aiohttp.ClientSession,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    async with http.request(method, path, json=body, headers=headers or {}) as response:
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text


async def assert_refused(http: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> None:
    """No token, a wrong one, another scheme: 401 each time, SGLang's error shape, the Bearer challenge."""
    for why, headers in BAD_HEADERS.items():
        async with http.request(method, path, json=body, headers=headers) as response:
            payload = await response.json()
            assert response.status == 401, (why, payload)
            assert response.headers["WWW-Authenticate"].startswith('Bearer realm="mixrl"'), why
        assert set(payload) == {"error"} and payload["error"].startswith("unauthorized: "), why
        assert TOKEN.reveal() not in json.dumps(payload)


async def test_weight_updates_need_the_token_and_change_nothing_without_it(guarded) -> None:  # type: ignore[no-untyped-def]
    _, service, http, store = guarded
    body = {"model_path": store.path(3), "weight_version": "3"}
    await assert_refused(http, "POST", "/update_weights_from_disk", body)
    assert service.weight_version == 0
    status, answer = await call(http, "POST", "/update_weights_from_disk", body, RIGHT)
    assert (status, answer["success"], service.weight_version) == (200, True, 3)

    await assert_refused(http, "POST", "/update_weight_version", {"new_version": "9"})
    assert service.weight_version == 3
    status, _ = await call(http, "POST", "/update_weight_version", {"new_version": "9"}, RIGHT)
    assert (status, service.weight_version) == (200, 9)


async def test_pause_continue_and_abort_need_the_token(guarded) -> None:  # type: ignore[no-untyped-def]
    url, service, http, _ = guarded
    await assert_refused(http, "POST", "/pause_generation", {"mode": "in_place"})
    assert not service.sched.paused
    assert (await call(http, "POST", "/pause_generation", {"mode": "in_place"}, RIGHT))[0] == 200
    assert service.sched.paused

    # A request waits while generation is paused; refused aborts leave it waiting.
    async with EngineClient(url) as reader:  # no token: generation and metrics are open
        waiting = asyncio.create_task(reader.generate([1, 2, 3], max_new_tokens=4, rid="held"))
        while (await reader.metrics()).get("sglang:num_queue_reqs", 0) < 1:
            await asyncio.sleep(0.01)
        await assert_refused(http, "POST", "/abort_request", {"rid": "held"})
        await assert_refused(http, "POST", "/abort_request", {"abort_all": True})
        assert not waiting.done()
        await assert_refused(http, "POST", "/continue_generation", {})
        assert service.sched.paused
        status, answer = await call(http, "POST", "/abort_request", {"rid": "held"}, RIGHT)
        assert (status, answer) == (200, {"success": True, "aborted": 1})
        assert (await call(http, "POST", "/continue_generation", {}, RIGHT))[0] == 200
        assert not service.sched.paused
        assert (await waiting).aborted


async def test_flush_cache_needs_the_token_on_either_method(guarded) -> None:  # type: ignore[no-untyped-def]
    _, _, http, _ = guarded
    for method in ("GET", "POST"):
        await assert_refused(http, method, "/flush_cache")
        assert (await call(http, method, "/flush_cache", headers=RIGHT))[0] == 200


async def test_generation_and_reads_stay_open(guarded) -> None:  # type: ignore[no-untyped-def]
    _, _, http, _ = guarded
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert (await call(http, "POST", "/generate", body))[0] == 200
    for path in (
        "/get_weight_version",
        "/get_model_info",
        "/model_info",
        "/get_server_info",
        "/server_info",
        "/health",
        "/health_generate",
        "/metrics",
    ):
        assert (await call(http, "GET", path))[0] == 200, path
    async with http.head("/health") as response:
        assert response.status == 200
    assert (await call(http, "GET", "/no_such_route"))[0] == 404  # not a 401: nothing there to protect


async def test_the_token_is_checked_before_the_body_is_read(guarded) -> None:  # type: ignore[no-untyped-def]
    _, _, http, _ = guarded
    big = b"[" * (9 << 20)  # over --max-request-mib, and not JSON
    async with http.post("/update_weights_from_disk", data=io.BytesIO(big)) as response:
        assert response.status == 401


async def test_the_client_sends_its_token_and_reports_a_refusal(guarded) -> None:  # type: ignore[no-untyped-def]
    url, service, _, _ = guarded
    async with EngineClient(url, auth_token=TOKEN) as client:
        await client.update_weight_version(5)
        await client.pause_generation()
        await client.continue_generation()
        await client.flush_cache()
    assert service.weight_version == 5
    async with EngineClient(url, retries=0) as anonymous:
        with pytest.raises(
            EngineError, match=r"^POST /update_weight_version: HTTP 401: unauthorized"
        ) as caught:
            await anonymous.update_weight_version(6)
        assert caught.value.status == 401
        assert await anonymous.get_weight_version() == 5


async def test_refusals_are_logged_without_any_token(guarded, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    _, _, http, _ = guarded
    with caplog.at_level(logging.DEBUG):
        await assert_refused(http, "POST", "/pause_generation", {})
        await call(http, "POST", "/update_weight_version", {"new_version": "1"}, RIGHT)
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    # one line, then quiet: a caller retrying without the token cannot flood the log
    assert refusals == ["refused POST /pause_generation from 127.0.0.1: no bearer token"]
    assert TOKEN.reveal() not in caplog.text and WRONG["Authorization"][7:] not in caplog.text


# ----------------------------------------------------------------------------------- the process


def run_engine(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "MIXRL_AUTH_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "engine", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, **(env or {})},
    )


def test_without_a_token_the_engine_refuses_to_start_with_one_line(dense_path: str) -> None:
    """The process: ``mixrl engine`` without a token exits 2 with one line, before the model loads."""
    result = run_engine("--model-path", dense_path, "--port", "0")
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "mixrl engine: no auth token: give --auth-token-file PATH or set MIXRL_AUTH_TOKEN "
        "(--insecure-no-auth runs without one, open to anyone who reaches the port)",
    )


def test_each_token_problem_is_one_line_and_exit_2(
    dense_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rest of the token's refusals, through the same entry point in this process (each a
    start of ``mixrl engine`` would cost seconds of imports; the process path is the test above)."""
    monkeypatch.delenv("MIXRL_AUTH_TOKEN", raising=False)
    short = tmp_path / "short"
    short.write_text("abc\n")
    missing = tmp_path / "missing"
    cases: list[tuple[list[str], dict[str, str], str]] = [
        (
            ["--auth-token-file", str(short)],
            {},
            f"--auth-token-file {short}: the token is shorter than 16 characters",
        ),
        (
            ["--auth-token-file", str(missing)],
            {},
            f"--auth-token-file {missing}: cannot read it (No such file or directory)",
        ),
        (
            ["--insecure-no-auth", "--auth-token-file", str(short)],
            {},
            "--insecure-no-auth: contradicts --auth-token-file; give one of them",
        ),
        (
            [],
            {"MIXRL_AUTH_TOKEN": "white space inside the token"},
            "$MIXRL_AUTH_TOKEN: the token holds characters a bearer token cannot carry "
            "(allowed: letters, digits, - . _ ~ + / and trailing =)",
        ),
    ]
    for args, env, line in cases:
        with monkeypatch.context() as patched:
            for name, value in env.items():
                patched.setenv(name, value)
            assert server.main(["--model-path", dense_path, *args]) == 2
        assert capsys.readouterr().err.splitlines() == [f"mixrl engine: {line}"]


@pytest.fixture(scope="module")
def token_engine(dense_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    log_path = tmp_path_factory.mktemp("logs") / "engine.log"
    with EngineProcess(dense_path, auth_token=TOKEN, log_path=log_path) as process:
        yield process


async def test_the_engine_process_checks_the_token_and_never_logs_it(token_engine: EngineProcess) -> None:
    async with aiohttp.ClientSession(base_url=token_engine.url) as http:
        await assert_refused(http, "POST", "/update_weight_version", {"new_version": "4"})
        assert (await call(http, "GET", "/get_weight_version"))[1] == {"weight_version": "0"}
        assert (await call(http, "POST", "/update_weight_version", {"new_version": "4"}, RIGHT))[0] == 200
        assert (await call(http, "GET", "/get_weight_version"))[1] == {"weight_version": "4"}
    log = token_engine.log_path.read_text()
    assert "refused POST /update_weight_version from 127.0.0.1: no bearer token" in log
    assert TOKEN.reveal() not in log and "not-the-run-token" not in log
    assert "authentication is off" not in log
