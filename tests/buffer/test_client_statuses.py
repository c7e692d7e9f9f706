"""``BufferClient`` and a buffer that answers but cannot serve: 502/503/504 from a proxy in front of
it, or its own one-line 503 when its disk fails.  Idempotent calls retry them within the same
budget and back-off as a refused connection; a call that must not be repeated fails at once; other
statuses are never retried.  It used to fail every caller at the first 503."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from mixrl.rl.buffer.client import BufferClient, BufferError

from ..fakes import serve
from .conftest import make_trajectory

NGINX_502 = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>nginx</body>\r\n</html>\r\n"

Answer = Callable[[int], web.Response]
"""The answer to a route's n-th request (from 0)."""


class Scripted:
    """A server whose every route answers from one script, counting the requests it got."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.requests.append(f"{request.method} {request.path}")
        return self.answer(len(self.requests) - 1)


Start = Callable[[Answer], Awaitable[tuple[Scripted, str]]]
"""The ``scripted`` fixture: ``server, url = await scripted(answer)``."""


@pytest.fixture
async def scripted() -> AsyncIterator[Start]:
    runners: list[web.AppRunner] = []

    async def start(answer: Answer) -> tuple[Scripted, str]:
        server = Scripted(answer)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", server.handle)
        runner, url = await serve(app)
        runners.append(runner)
        return server, url

    yield start
    for runner in runners:
        await runner.cleanup()


def unavailable_then_ok(failures: int, status: int, ok: dict[str, object]) -> Answer:
    def answer(n: int) -> web.Response:
        if n < failures:
            return web.json_response({"error": "the buffer cannot write or read its logs"}, status=status)
        return web.json_response(ok)

    return answer


@pytest.mark.parametrize("status", [502, 503, 504])
async def test_an_idempotent_call_retries_a_gateway_or_unavailable_status(
    scripted: Start, status: int
) -> None:
    server, url = await scripted(unavailable_then_ok(2, status, {"batches": 0}))
    async with BufferClient(url, retry_budget_s=10, backoff_s=0.01, max_backoff_s=0.02) as client:
        assert (await client.stats())["batches"] == 0
    assert server.requests == ["GET /stats"] * 3


async def test_a_trajectories_post_is_retried_since_the_buffer_stores_a_repeat_once(scripted: Start) -> None:
    answers = unavailable_then_ok(1, 503, {"accepted": 1, "groups_completed": 1, "duplicates": 0})
    server, url = await scripted(answers)
    async with BufferClient(url, retry_budget_s=10, backoff_s=0.01) as client:
        assert await client.post_trajectories([make_trajectory("p0")]) == 1
    assert server.requests == ["POST /trajectories"] * 2


async def test_an_evaluation_post_is_not_repeated_blindly(scripted: Start) -> None:
    server, url = await scripted(lambda _: web.Response(status=502, text=NGINX_502, content_type="text/html"))
    async with BufferClient(url, retry_budget_s=10, backoff_s=0.01) as client:
        with pytest.raises(BufferError) as refused:
            await client.post_evaluation(0, 0, {1: 0.5})
    assert server.requests == ["POST /evaluations"]
    assert refused.value.status == 502
    assert "\n" not in str(refused.value) and "502 Bad Gateway" in str(refused.value)


async def test_other_server_errors_are_not_retried(scripted: Start) -> None:
    server, url = await scripted(lambda _: web.json_response({"error": "a bug"}, status=500))
    async with BufferClient(url, retry_budget_s=10, backoff_s=0.01) as client:
        with pytest.raises(BufferError, match=r"^GET /stats: 500: a bug$") as refused:
            await client.stats()
    assert server.requests == ["GET /stats"] and refused.value.status == 500


async def test_a_spent_budget_names_the_last_status_and_message_in_one_line(scripted: Start) -> None:
    server, url = await scripted(lambda _: web.Response(status=502, text=NGINX_502, content_type="text/html"))
    async with BufferClient(url, backoff_s=0.01, retries=3) as client:
        with pytest.raises(BufferError) as refused:
            await client.commit(4)
    assert server.requests == ["POST /commit"] * 4
    message = str(refused.value)
    assert "\n" not in message and "\r" not in message, message
    assert message.startswith(f"POST /commit: the buffer at {url} kept failing (4 attempts in "), message
    assert "; last: 502: <html>" in message and "502 Bad Gateway" in message, message
    assert refused.value.status == 502
