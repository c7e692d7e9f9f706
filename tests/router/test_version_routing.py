"""Version-aware routing (docs/router.md#version-aware-routing): a request that demands a minimum
weight version goes only to a ready replica serving it, and is answered 409 when none does.

Real: the router (state, aiohttp proxy, health probes reading ``/get_weight_version``) over loopback.
Stand-in: ``VersionedEngine``, the folder's ``FakeEngine`` that also serves a weight version the
test sets (``/get_weight_version``, the version in its answers) and, as the torch engine does,
refuses with 409 a request whose minimum it does not serve.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from mixrl.rl.engine.protocol import POOL_HEADER, REPLICA_HEADER, SESSION_HEADER
from mixrl.rl.engine.version_gate import (
    CONFLICT,
    MIN_VERSION_FIELD,
    MIN_VERSION_HEADER,
    refusal_body,
    request_min_version,
    retry_after_headers,
)
from mixrl.rl.router.config import RouterConfig
from mixrl.rl.router.shares import ShareScheduler

from ..fakes import WeightVersionEngine, counting_reply, started_engines
from .conftest import RunningRouter, pools_config

BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 1.0}}


@dataclass
class VersionedEngine(WeightVersionEngine):
    """A FakeEngine serving weight version ``version`` (see the module docstring)."""

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        minimum = request_min_version(json.loads(raw), request.headers)
        if minimum is not None and self.version < minimum:
            self.generate_bodies.append(raw)
            body = refusal_body(minimum, self.version, "the engine")
            return web.json_response(body, status=CONFLICT, headers=retry_after_headers())
        return await super()._generate(_Replayed(request, raw))  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        self.reply = self._versioned_reply

    def _versioned_reply(self, body: dict[str, Any]) -> dict[str, Any]:
        answer = counting_reply(self.name)(body)
        answer["meta_info"]["weight_version"] = str(self.version)
        return answer


class _Replayed:
    """A request whose body was already read, handed on to FakeEngine's handler."""

    def __init__(self, request: web.Request, raw: bytes) -> None:
        self._request, self._raw = request, raw
        self.headers = request.headers

    async def read(self) -> bytes:
        return self._raw


@pytest.fixture
async def versioned() -> AsyncIterator[Callable[..., Awaitable[VersionedEngine]]]:
    async with started_engines(VersionedEngine) as start:
        yield start


def config(pools: dict[str, list[VersionedEngine]]) -> RouterConfig:
    """Pools of capacity 1 with these replicas."""
    return pools_config({name: (1.0, list(engines)) for name, engines in pools.items()})


async def ask(
    router: RunningRouter, session: str | None, minimum: int | None = None, in_body: bool = False
) -> tuple[int, Any, Any]:
    headers = {SESSION_HEADER: session} if session else {}
    body: dict[str, Any] = dict(BODY)
    if minimum is not None and in_body:
        body[MIN_VERSION_FIELD] = minimum
    elif minimum is not None:
        headers[MIN_VERSION_HEADER] = str(minimum)
    async with router.http.post(f"{router.url}/generate", json=body, headers=headers) as response:
        return response.status, await response.json(content_type=None), response.headers


async def test_a_minimum_goes_only_to_replicas_serving_it_and_moves_an_older_session(
    versioned: Any, start_router: Any
) -> None:
    old, new = await versioned("old", version=3), await versioned("new", version=5)
    router = await start_router(config({"p": [old, new]}))
    replicas = router.router.state.pool("p").replicas
    assert (replicas[old.url].weight_version, replicas[new.url].weight_version) == (3, 5)  # probed

    # Without a minimum nothing changes: a session stays on the replica it was bound to.
    status, _, headers = await ask(router, "s1")
    first = headers[REPLICA_HEADER]
    status, _, headers = await ask(router, "s1")
    assert status == 200 and headers[REPLICA_HEADER] == first

    # A minimum only the new replica serves: every request goes there, new sessions and old ones.
    old_seen = len(old.generate_bodies)
    for session in ("s1", "s2", "s3", None):
        status, payload, headers = await ask(router, session, minimum=4)
        assert status == 200 and headers[REPLICA_HEADER] == new.url, session
        assert payload["meta_info"]["weight_version"] == "5"
    assert router.router.state.sessions["s1"].replica == new.url
    assert len(old.generate_bodies) == old_seen, "nothing reached the older replica"


async def test_no_replica_serving_the_minimum_is_a_409_naming_the_versions_and_the_session_stays(
    versioned: Any, start_router: Any
) -> None:
    old, new = await versioned("old", version=3), await versioned("new", version=5)
    router = await start_router(config({"p": [old, new]}))
    status, _, headers = await ask(router, "s1", minimum=5)
    assert status == 200 and headers[REPLICA_HEADER] == new.url

    for in_body in (False, True):
        status, payload, headers = await ask(router, "s1", minimum=6, in_body=in_body)
        assert status == 409
        assert (payload[MIN_VERSION_FIELD], payload["weight_version"]) == (6, 5)
        assert payload["retry"] is True and headers["Retry-After"] == "1"
        assert "version 6 or newer" in payload["error"]["message"]
    state = router.router.state
    assert state.sessions["s1"].replica == new.url, "a refused session keeps its replica"
    assert state.snapshot()["version_refusals"] == 2

    # The old replica loads version 7; the next probe reads it and the session moves there.
    old.version = 7
    await router.router.poll_once()
    status, payload, headers = await ask(router, "s1", minimum=6)
    assert status == 200 and headers[REPLICA_HEADER] == old.url
    assert payload["meta_info"]["weight_version"] == "7"


async def test_a_bad_minimum_is_400_naming_it(versioned: Any, start_router: Any) -> None:
    router = await start_router(config({"p": [await versioned("a", version=1)]}))
    status, payload, _ = await ask(router, None, minimum=-2, in_body=True)
    assert status == 400 and payload["error"].startswith(f"{MIN_VERSION_FIELD}: must be an integer")
    async with router.http.post(
        f"{router.url}/generate", json=BODY, headers={MIN_VERSION_HEADER: "latest"}
    ) as response:
        assert response.status == 400
        assert (await response.json())["error"].startswith(f"{MIN_VERSION_HEADER}: must be an integer")


async def test_new_sessions_go_to_the_pool_that_serves_the_minimum(versioned: Any, start_router: Any) -> None:
    behind, ahead = await versioned("behind", version=1), await versioned("ahead", version=2)
    router = await start_router(config({"behind": [behind], "ahead": [ahead]}))
    pools = [(await ask(router, f"s{i}", minimum=2))[2][POOL_HEADER] for i in range(6)]
    assert pools == ["ahead"] * 6
    unbounded = {(await ask(router, f"t{i}"))[2][POOL_HEADER] for i in range(6)}
    assert unbounded == {"behind", "ahead"}, "without a minimum the shares hold"


async def test_an_engine_older_than_the_router_thought_refuses_and_the_router_learns_it(
    versioned: Any, start_router: Any
) -> None:
    a, b = await versioned("a", version=4), await versioned("b", version=4)
    router = await start_router(config({"p": [a, b]}))
    status, _, headers = await ask(router, "s1", minimum=4)
    assert status == 200
    bound = a if headers[REPLICA_HEADER] == a.url else b
    bound.version = 2  # rolled back (a trainer resumed from an older checkpoint); no probe since

    status, payload, headers = await ask(router, "s1", minimum=4)
    assert status == 409 and (payload[MIN_VERSION_FIELD], payload["weight_version"]) == (4, 2)
    assert headers["Retry-After"] == "1"
    assert router.router.state.replica("p", bound.url).weight_version == 2  # read from the 409
    assert router.router.state.version_refusals == 1  # the replica's 409, passed on, counts too
    status, _, headers = await ask(router, "s1", minimum=4)
    assert status == 200 and headers[REPLICA_HEADER] != bound.url, "the retry goes to the other one"


def test_a_pool_left_out_by_a_minimum_gets_no_burst_of_sessions_afterwards() -> None:
    scheduler = ShareScheduler({"a": 0.5, "b": 0.5})
    assert [scheduler.next_pool(among=["b"]) for _ in range(10)] == ["b"] * 10
    after = [scheduler.next_pool() for _ in range(10)]
    assert after.count("a") == 5 and after.count("b") == 5, after
    assert scheduler.next_pool(among=[]) is None


@dataclass
class UnversionedEngine(VersionedEngine):
    """A VersionedEngine whose ``/get_weight_version`` answers ``answer`` instead of its version
    (a proxy or an engine build that leaves the field out, or garbles it)."""

    answer: Any = None

    async def _weight_version(self, request: web.Request) -> web.Response:
        return web.json_response(self.answer)


@pytest.mark.parametrize(
    "answer", [{}, {"weight_version": None}, {"weight_version": "latest"}, ["3"]], ids=repr
)
async def test_a_version_answer_without_a_version_leaves_it_unknown_not_zero(
    answer: Any, start_router: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, an answer without ``weight_version`` was read as version 0: a replica at version 3
    behind such a proxy was taken to serve 0, and requests demanding 3 were refused with 409 while
    requests demanding 0 went to a replica whose weights nobody knew."""
    async with started_engines(UnversionedEngine) as start:
        mute = await start("mute", version=3, answer=answer)
        with caplog.at_level("WARNING", logger="mixrl.router"):
            router = await start_router(config({"p": [mute]}))
            await router.router.poll_once()  # a second probe: still one line
        assert router.router.state.replica("p", mute.url).weight_version is None
        lines = [r.getMessage() for r in caplog.records if "/get_weight_version" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith(
            f"replica {mute.url}: /get_weight_version: weight_version"
        )
        status, payload, _ = await ask(router, "s", minimum=0)
        assert status == 409 and payload["weight_version"] is None  # none known, not 0
        # Its answers still tell: a request without a minimum learns the version it names.
        status, _, _ = await ask(router, "s")
        assert status == 200 and router.router.state.replica("p", mute.url).weight_version == 3
