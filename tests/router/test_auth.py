"""The router's token: weight fan-out, pool changes and session ends need it; it goes to every replica.

Real: the router on loopback, ``mixrl router`` as a process.  Stand-in: ``FakeEngine`` (see
tests/fakes.py), here also checking the token as SGLang's ``--api-key`` does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from mixrl.rl.auth import AuthToken, write_token_file
from mixrl.rl.engine.protocol import SESSION_HEADER
from mixrl.rl.router.server import RouterSettings

from ..fakes import FakeEngine
from ..servers import cli_server, environment_without_token, run_cli
from .conftest import RunningRouter, pools_config
from .run_files import write_run

TOKEN = AuthToken("router-test-token-" + "r" * 24)
RIGHT = {"Authorization": f"Bearer {TOKEN.reveal()}"}
WRONG = {"Authorization": "Bearer not-the-run-token-0123456789"}

Engines = Callable[..., Awaitable[FakeEngine]]
StartRouter = Callable[..., Awaitable[RunningRouter]]


async def guarded_router(engines: Engines, start_router: StartRouter) -> tuple[RunningRouter, FakeEngine]:
    """A router requiring TOKEN in front of one engine that requires it too (SGLang with --api-key)."""
    engine = await engines("e", api_key=TOKEN.reveal())
    config = pools_config({"p": (1.0, [engine])})
    router = await start_router(config, RouterSettings(run="test", health_interval=3600.0, auth_token=TOKEN))
    return router, engine


async def call(
    router: RunningRouter, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with router.http.request(method, f"{router.url}{path}", json=body, headers=headers or {}) as resp:
        return resp.status, await resp.json()


async def assert_refused(router: RunningRouter, method: str, path: str, body: Any = None) -> None:
    for headers in ({}, WRONG):
        status, answer = await call(router, method, path, body, headers)
        assert status == 401, (headers, answer)
        assert answer["error"].startswith("unauthorized: ") and TOKEN.reveal() not in answer["error"]


async def test_the_weight_fan_out_needs_the_token_and_carries_it_to_each_replica(
    engines: Engines, start_router: StartRouter
) -> None:
    router, engine = await guarded_router(engines, start_router)
    body = {"model_path": "/weights/v00000001", "weight_version": "1"}
    await assert_refused(router, "POST", "/update_weights_from_disk", body)
    assert engine.update_bodies == []  # nothing reached any engine
    status, answer = await call(router, "POST", "/update_weights_from_disk", body, RIGHT)
    assert (status, answer["success"]) == (200, True)
    assert engine.update_bodies == [body]
    assert engine.authorizations[-1] == RIGHT["Authorization"]
    # Each refusal is counted by reason on the router's /metrics.
    async with router.http.get(f"{router.url}/metrics") as response:
        text = await response.text()
    for reason in ("missing", "wrong"):
        line = f'mixrl_auth_refused_requests_total{{component="router",reason="{reason}",run="test"}} 1.0'
        assert line in text, text


async def test_pool_changes_and_session_ends_need_the_token(
    engines: Engines, start_router: StartRouter
) -> None:
    router, engine = await guarded_router(engines, start_router)
    other = await engines("other", api_key=TOKEN.reveal())
    await assert_refused(router, "PUT", "/pools/p", {"replicas": [other.url]})
    assert list(router.router.state.pool("p").replicas) == [engine.url]
    status, answer = await call(router, "PUT", "/pools/p", {"replicas": [engine.url, other.url]}, RIGHT)
    assert status == 200 and answer["ready_replicas"] == 2

    assert (await router.generate("s1")).status == 200  # generation is open
    await assert_refused(router, "POST", "/sessions/s1/end")
    assert "s1" in router.router.state.sessions
    assert await call(router, "POST", "/sessions/s1/end", headers=RIGHT) == (200, {"ended": True})
    assert "s1" not in router.router.state.sessions


async def test_generation_and_reads_stay_open_and_replicas_get_the_routers_own_token(
    engines: Engines, start_router: StartRouter
) -> None:
    router, engine = await guarded_router(engines, start_router)
    # A caller's own Authorization (here a wrong one) is never passed on: the replica sees the run's.
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}
    async with router.http.post(
        f"{router.url}/generate", json=body, headers={**WRONG, SESSION_HEADER: "s"}
    ) as response:
        assert response.status == 200
    assert engine.authorizations == [RIGHT["Authorization"]]
    for path in ("/pools", "/health", "/metrics"):
        async with router.http.get(f"{router.url}{path}") as response:
            assert response.status == 200, path


async def test_a_router_without_the_token_is_refused_by_sglang_engines(
    engines: Engines, start_router: StartRouter
) -> None:
    """The other half of SGLang's ``--api-key``: its /generate needs the token, so the router must send it."""
    engine = await engines("e", api_key=TOKEN.reveal())
    router = await start_router(pools_config({"p": (1.0, [engine])}))
    assert router.router.state.pool("p").ready_replicas()  # /health is open on SGLang too
    assert (await router.generate("s")).status == 401
    assert engine.authorizations == [None]


# ----------------------------------------------------------------------------------- the process


def router_files(tmp_path: Path, engine: FakeEngine) -> tuple[str, ...]:
    """``--config`` and ``--replicas`` of a run with one pool ``p`` served by ``engine``."""
    config, replicas = write_run(tmp_path, {"p": [engine.url]})
    return ("--config", str(config), "--replicas", str(replicas))


def test_without_a_token_the_router_refuses_to_start_with_one_line(tmp_path: Path) -> None:
    config, _ = write_run(tmp_path, {"a": []})
    result = run_cli("router", "--config", str(config), env=environment_without_token())
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "mixrl router: no auth token: give --auth-token-file PATH or set MIXRL_AUTH_TOKEN "
        "(--insecure-no-auth runs without one, open to anyone who reaches the port)",
    )


async def test_the_router_process_takes_its_token_from_the_file_or_the_environment(
    tmp_path: Path, engines: Engines
) -> None:
    engine = await engines("e", api_key=TOKEN.reveal())
    files = router_files(tmp_path, engine)
    token_file = tmp_path / "auth-token"
    write_token_file(token_file, TOKEN)
    # the file wins over the environment; with the variable alone, the variable is the token
    for auth, env in (
        (
            ["--auth-token-file", str(token_file)],
            environment_without_token(MIXRL_AUTH_TOKEN="a-different-token-in-the-shell"),
        ),
        ([], environment_without_token(MIXRL_AUTH_TOKEN=TOKEN.reveal())),
    ):
        async with cli_server("router", tmp_path / "port", *files, *auth, env=env) as (process, url):
            body = {"model_path": "/w/v1"}
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/update_weights_from_disk", json=body, headers=WRONG) as response:
                    assert response.status == 401
                async with http.post(f"{url}/update_weights_from_disk", json=body, headers=RIGHT) as response:
                    assert response.status == 200, await response.text()
                async with http.post(f"{url}/generate", json={"input_ids": [1]}) as response:
                    assert response.status == 200  # open here, and the engine got the router's token
        stderr = (await process.stderr.read()).decode()  # type: ignore[union-attr]
        assert "refused POST /update_weights_from_disk from 127.0.0.1: wrong token" in stderr
        assert TOKEN.reveal() not in stderr and "not-the-run-token" not in stderr
        assert "authentication is off" not in stderr


async def test_insecure_no_auth_is_said_in_one_warning_line(tmp_path: Path, engines: Engines) -> None:
    engine = await engines("e")
    files = (*router_files(tmp_path, engine), "--insecure-no-auth")
    env = environment_without_token()
    async with (
        cli_server("router", tmp_path / "port", *files, env=env) as router,
        aiohttp.ClientSession() as http,
        http.post(f"{router.url}/update_weights_from_disk", json={"model_path": "/w"}) as response,
    ):
        assert response.status == 200
    stderr = (await router.process.stderr.read()).decode()  # type: ignore[union-attr]
    warnings = [line for line in stderr.splitlines() if "authentication is off" in line]
    assert len(warnings) == 1 and "--insecure-no-auth" in warnings[0]
