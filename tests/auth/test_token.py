"""mixrl/rl/auth.py on its own: token sources and their one-line errors, the hidden repr, the file
mode, and the middleware on a real aiohttp app over loopback.  The components' own endpoints are
tested in tests/engine, tests/router and tests/buffer (test_auth.py in each)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from mixrl.rl import auth
from mixrl.rl.auth import AuthConfigError, AuthToken

from ..fakes import serve

TOKEN = AuthToken("unit-test-token-" + "u" * 24)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    auth.add_auth_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_token_never_shows_when_printed() -> None:
    holder = {"token": TOKEN}
    for shown in (repr(TOKEN), str(TOKEN), f"{TOKEN}", repr(holder)):
        assert TOKEN.reveal() not in shown and "<hidden>" in shown
    same, other = AuthToken(TOKEN.reveal()), AuthToken("another-token-0123456789")
    assert same == TOKEN and other != TOKEN and hash(same) == hash(TOKEN)


def test_sources_flags_beat_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN.reveal() + "\n")  # a Secret made from a file keeps its newline
    env = {"MIXRL_AUTH_TOKEN": "the-shell-has-another-token"}
    assert auth.token_from_args(parse("--auth-token-file", str(token_file)), env) == TOKEN
    assert auth.token_from_args(parse(), env) == AuthToken("the-shell-has-another-token")
    assert auth.token_from_args(parse("--insecure-no-auth"), env) is None
    with pytest.raises(AuthConfigError, match=r"^no auth token: give --auth-token-file PATH or set "):
        auth.token_from_args(parse(), {})


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "empty (expected the run's token)"),
        ("  \n", "empty (expected the run's token)"),
        ("tiny-tok", "the token is shorter than 16 characters"),
        ("x" * 5000, "the token is longer than 4096 characters"),
        ("a token with spaces in it", "the token holds characters a bearer token cannot carry"),
        ("päss-wörd-0123456789", "the token holds characters a bearer token cannot carry"),
        ("abcdefghijklmnop=q", "the token holds characters a bearer token cannot carry"),
    ],
)
def test_a_bad_token_is_one_line_that_does_not_quote_it(tmp_path: Path, content: str, problem: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(content)
    with pytest.raises(AuthConfigError) as caught:
        auth.token_from_args(parse("--auth-token-file", str(token_file)), {})
    message = str(caught.value)
    assert message.startswith(f"--auth-token-file {token_file}: {problem}")
    assert "\n" not in message and (not content.strip() or content.strip() not in message)


def test_valid_tokens_take_every_b64token_character() -> None:
    for value in ("abcdefghijklmnop", "A-Z.a_z~0+9/base64==", "x" * 4096):
        assert auth.parse_token(value, "test").reveal() == value


def test_unreadable_files_and_contradictions_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(AuthConfigError, match=r"cannot read it \(Is a directory\)$"):
        auth.token_from_args(parse("--auth-token-file", str(tmp_path)), {})
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe" * 20)
    with pytest.raises(AuthConfigError, match=r"not UTF-8 text$"):
        auth.token_from_args(parse("--auth-token-file", str(binary)), {})
    with pytest.raises(
        AuthConfigError, match=r"^--insecure-no-auth: contradicts --auth-token-file; give one"
    ):
        auth.token_from_args(parse("--insecure-no-auth", "--auth-token-file", str(binary)), {})


def test_the_token_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "run" / "auth-token"
    path.parent.mkdir()
    path.write_text("an older token, world-readable")
    path.chmod(0o644)
    auth.write_token_file(path, TOKEN)
    assert path.stat().st_mode & 0o777 == 0o600
    assert auth.read_token_file(path) == TOKEN


# ----------------------------------------------------------------------------------- middleware


@asynccontextmanager
async def small_app(
    count_refusal: Callable[[str], None] | None = None,
) -> AsyncIterator[tuple[str, list[str]]]:
    """A small app: an open GET, a protected POST, a protected route with a variable part."""
    done: list[str] = []

    async def act(request: web.Request) -> web.Response:
        done.append(f"{request.method} {request.path}")
        return web.json_response({"ok": True})

    log = logging.getLogger("test.auth")
    app = web.Application(middlewares=auth.auth_middlewares(TOKEN, {("GET", "/read")}, log, count_refusal))
    app.router.add_get("/read", act)
    app.router.add_post("/write", act)
    app.router.add_post("/things/{name}/end", act)
    runner, url = await serve(app)
    try:
        yield url, done
    finally:
        await runner.cleanup()


@pytest.fixture
async def app_url() -> AsyncIterator[tuple[str, list[str]]]:
    async with small_app() as served:
        yield served


async def test_the_middleware_protects_everything_not_listed_as_open(app_url: tuple[str, list[str]]) -> None:
    url, done = app_url
    async with aiohttp.ClientSession(base_url=url) as http:
        for method, path in (("GET", "/read"), ("HEAD", "/read")):
            async with http.request(method, path) as response:
                assert response.status == 200, method
        for path in ("/write", "/things/a/end"):
            async with http.post(path) as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"] == 'Bearer realm="mixrl"'
                assert (await response.json())["error"] == (
                    f"unauthorized: POST {path.replace('/a/', '/{name}/')} needs the run's token "
                    "(Authorization: Bearer <token>)"
                )
            async with http.post(path, headers={"Authorization": "Bearer " + "w" * 40}) as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"] == 'Bearer realm="mixrl", error="invalid_token"'
            # a token that starts like the right one is no better than any other
            async with http.post(path, headers={"Authorization": f"Bearer {TOKEN.reveal()}x"}) as response:
                assert response.status == 401
        assert [d for d in done if d.startswith("POST")] == []
        for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive (RFC 7235)
            async with http.post(
                "/write", headers={"Authorization": f"{scheme} {TOKEN.reveal()}"}
            ) as response:
                assert response.status == 200, scheme
        async with http.post("/missing") as response:
            assert response.status == 404
        async with http.put("/write") as response:
            assert response.status == 405
    assert done.count("POST /write") == 3


async def test_refusals_are_reported_at_most_every_ten_seconds_with_a_count(
    app_url: tuple[str, list[str]], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = app_url
    now = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    async with aiohttp.ClientSession(base_url=url) as http:
        with caplog.at_level(logging.WARNING, logger="test.auth"):
            for _ in range(5):
                async with http.post("/write") as response:
                    assert response.status == 401
            now[0] += 10.0
            async with http.post("/write", headers={"Authorization": "Bearer " + "w" * 40}) as response:
                assert response.status == 401
    assert [r.getMessage() for r in caplog.records] == [
        "refused POST /write from 127.0.0.1: no bearer token",
        "refused POST /write from 127.0.0.1: wrong token (4 more refused since the last report)",
    ]


def test_bearer_headers() -> None:
    assert auth.bearer_headers(None) == {}
    assert auth.bearer_headers(TOKEN) == {"Authorization": f"Bearer {TOKEN.reveal()}"}


async def test_refusals_are_counted_by_reason_in_the_servers_registry() -> None:
    registry = CollectorRegistry()
    count = auth.refusal_counter(registry, "demo", "buffer")

    def refused(reason: str) -> float | None:
        labels = {"run": "demo", "component": "buffer", "reason": reason}
        return registry.get_sample_value("mixrl_auth_refused_requests_total", labels)

    assert (refused("missing"), refused("wrong")) == (0.0, 0.0)  # exported before the first one

    async with small_app(count) as (url, _), aiohttp.ClientSession(base_url=url) as http:
        for headers in ({}, {}, {"Authorization": "Bearer " + "w" * 40}, auth.bearer_headers(TOKEN)):
            async with http.post("/write", headers=headers):
                pass
        async with http.get("/read"):  # open: never counted
            pass
    assert (refused("missing"), refused("wrong")) == (2.0, 1.0)
