"""Mismatch-aware routing end to end over loopback: the trainer's per-pool fresh mismatch posted to
the real buffer, read back by the real router from the buffer's ``GET /stats``, moves a degraded
pool's health down to its floor and its new sessions to the healthy pool, and back once it recovers.

Stand-ins: the engines are ``FakeEngine`` (tests/fakes.py); the trainer is the test posting what
``mixrl.rl.trainer.main`` posts after each step (``mismatch_report`` of the step's per-pool figures).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixrl.rl.buffer.client import BufferClient
from mixrl.rl.health.routing import HealthPolicy, mismatch_report
from mixrl.rl.router.server import RouterSettings

from ..servers import buffer_at
from .conftest import RunningRouter, pools_config

POLICY = HealthPolicy(kl_threshold=0.01, extreme_share_threshold=0.05, degrade_after=2, recover_after=2)
BAD = {"kl_k3_fresh": 0.05, "extreme_ratio_fresh": 0.0, "fresh_tokens": 120}
GOOD = {"kl_k3_fresh": 0.001, "extreme_ratio_fresh": 0.0, "fresh_tokens": 200}


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def sessions_by_pool(router: RunningRouter, count: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _ in range(count):
        response = await router.generate(session=uuid.uuid4().hex)
        assert response.status == 200
        pool = response.headers["X-Mixrl-Pool"]
        counts[pool] = counts.get(pool, 0) + 1
    return counts


async def test_a_degraded_pool_loses_its_new_sessions_and_gets_them_back(
    tmp_path: Path, engines: Any, start_router: Any
) -> None:
    healthy, degraded = await engines("a"), await engines("b")
    async with buffer_at(tmp_path / "buffer") as buffer_url, BufferClient(buffer_url) as trainer:
        settings = RouterSettings(
            run="test", health_interval=0.05, buffer_url=buffer_url, health_policy=POLICY
        )
        router = await start_router(pools_config({"a": (1.0, [healthy]), "b": (1.0, [degraded])}), settings)
        state = router.router.state

        async def step(number: int, b: dict[str, float]) -> None:
            await trainer.post_mismatch(mismatch_report(number, {"a": GOOD, "b": b}))
            await eventually(lambda: state.mismatch_step == number, f"the router to read step {number}")

        assert await sessions_by_pool(router, 20) == {"a": 10, "b": 10}
        await step(1, BAD)
        assert state.health["b"].health == 1.0  # one bad step is not enough (degradeAfter 2)
        for number in range(2, 7):  # 0.5, 0.25, 0.125, then the floor 0.1
            await step(number, BAD)
        assert state.health["b"].health == POLICY.floor and state.health["a"].health == 1.0
        assert state.scheduler.shares == {"a": 1 / 1.1, "b": 0.1 / 1.1}
        counts = await sessions_by_pool(router, 110)
        assert abs(counts["a"] - 100) <= 1 and abs(counts.get("b", 0) - 10) <= 1, counts
        metrics = await (await router.http.get(f"{router.url}/metrics")).text()
        assert (
            'mixrl_router_pool_health{gpu_type="gpu-b",pool="b",precision="prec-b",run="test"} 0.1' in metrics
        )
        pools = {p["name"]: p for p in (await router.get_json("/pools"))["pools"]}
        assert pools["b"]["health"] == POLICY.floor

        # A report of an older step (a trainer redoing a step after a crash) moves nothing.
        await trainer.post_mismatch(mismatch_report(3, {"b": GOOD}))
        assert (await trainer.stats())["mismatch"]["step"] == 6

        # A step without fresh tokens from b holds its health and resets its streak.
        await step(7, {"kl_k3": 0.0, "tokens": 50})
        assert state.health["b"].health == POLICY.floor and state.health["b"].good_streak == 0
        for number in range(8, 14):  # recovers after 2 good steps: 0.2, 0.4, 0.8, 1.0
            await step(number, GOOD)
        assert state.health["b"].health == 1.0
        assert state.scheduler.shares == {"a": 0.5, "b": 0.5}
