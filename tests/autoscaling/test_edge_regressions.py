"""Regression tests for edge cases of the built-in autoscaler, each failing on the code before its fix.

The pure policy is called directly; the loop runs its real poll path against the in-memory API and
scripted Prometheus of test_fleet_bugs.py.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import aiohttp
import aiohttp.web
import pytest

from mixrl.operator.autoscaling.loop import AutoscalingLoop, LoopSettings
from mixrl.operator.autoscaling.plan import MetricsUnavailable, Observation, run_to_scale
from mixrl.operator.autoscaling.policy import PolicyConfig, PolicyState, PoolLoad, decide
from mixrl.operator.autoscaling.pool_api import query_prometheus
from mixrl.operator.autoscaling.replicas import Census
from mixrl.operator.kube.client import ApiError

from .conftest import free_port
from .test_fleet_bugs import NS, RUN, FakeApi, Harness, Obj, pool_body, run_body
from .test_objective_loop import STARVED_TRAINER


def test_stuck_replicas_are_released_while_their_pool_reports_no_metrics() -> None:
    """A pool whose nodes are gone has no engine left to export a load, so its query has no
    series: the cluster's word on its stuck replicas must still release them (rule 8)."""
    config = PolicyConfig(min_replicas=0, max_replicas=8, target_per_replica=8.0)
    stuck = PoolLoad(load=None, replicas=4, ready=0, starting=4, stuck=4, why_stuck="Unschedulable")
    decision = decide(stuck, PolicyState(), config, 0.0)
    # Before: "metrics unavailable: holding" at 4 Pending replicas, poll after poll.
    assert decision.desired == 0 and decision.ceiling == 0
    assert "4 stuck, released (Unschedulable)" in decision.reason
    # ...and the pool may not grow back for the pending timeout, metrics or not.
    later = decide(PoolLoad(load=None, replicas=0, ready=0), decision.state, config, 30.0)
    assert later.ceiling == 0 and later.desired == 0


def test_a_cold_start_without_metrics_is_still_held() -> None:
    config = PolicyConfig(min_replicas=0, max_replicas=8, target_per_replica=8.0)
    starting = PoolLoad(load=None, replicas=4, ready=0, starting=4, stuck=0)
    for t in (0.0, 600.0, 1200.0):
        decision = decide(starting, PolicyState(), config, t)
        assert decision.desired == 4 and decision.reason == "metrics unavailable: holding"


async def test_a_budget_pool_whose_replicas_are_all_stuck_hands_its_share_to_the_others() -> None:
    # h100-fp8 ($2.5 per 1.5 capacity) is cheaper than h100-bf16 ($2.5 per 1.0), so the budget
    # put the demand there; then its nodes went: 4 replicas Unschedulable, no engine, no series.
    run = run_body(gpuBudget=40)
    pools = [
        pool_body("h100-fp8", replicas=4, ready=0, low=0, high=8, status={"selector": "app=fp8"}),
        pool_body("h100-bf16", replicas=1, ready=1, low=0, high=8),
    ]
    h = Harness(run, pools, {"h100-fp8": None, "h100-bf16": 16 * 8.0})

    async def pods_of(key: Any, body: Any) -> Census | None:
        if key[1] == f"{RUN}-h100-fp8":
            return Census(ready=0, starting=0, stuck=4, why_stuck="Unschedulable: no node")
        return None

    h.loop.pods_of = pods_of  # type: ignore[method-assign]
    await h.poll("h100-fp8")
    await h.poll("h100-bf16")
    # Before: h100-fp8 held its 4 Pending replicas and was pinned there in the budget, so the
    # dear pool got 2 units for a demand of 8 while 6 units that serve nothing were counted.
    assert h.replicas("h100-fp8") == 0
    assert h.replicas("h100-bf16") == 8


async def test_a_failed_write_to_one_pool_does_not_skip_the_rest_of_the_fleet() -> None:
    """``objective: trainer`` plans a run's pools together and writes them one by one; a conflict
    on one pool's scale write must not leave the others unwritten (and the run unreported)."""
    run = run_body(objective="trainer", trainerIdleTarget=0.0)
    pools = [
        pool_body("h100-fp8", replicas=0, ready=0, low=0, high=8),
        pool_body("b300-nvfp4", replicas=1, ready=1, low=1, high=8),
    ]
    h = Harness(run, pools, {"h100-fp8": None, "b300-nvfp4": 16 * 4.0})
    h.values = dict(STARVED_TRAINER)
    patch = h.api.merge_patch

    async def conflicting(
        resource: Any, namespace: str, name: str, body: Any, subresource: Any = None
    ) -> Any:
        if name == f"{RUN}-h100-fp8" and subresource == "scale":
            raise ApiError(409, "Conflict", "the object has been modified")
        return await patch(resource, namespace, name, body, subresource)

    h.api.merge_patch = conflicting  # type: ignore[method-assign]
    done = await h.poll_run()
    # Before: the 409 on h100-fp8 ended the run's poll, so b300 stayed at 1 (the plan says 7).
    assert h.replicas("h100-fp8") == 0
    assert h.replicas("b300-nvfp4") == 7
    assert [key[1] for key, _ in done] == [f"{RUN}-b300-nvfp4"]
    # The pool whose write failed is asked again at the next poll.
    h.api.merge_patch = patch  # type: ignore[method-assign]
    h.now += 30
    await h.poll_run()
    assert h.replicas("h100-fp8") == 8


async def test_an_answer_without_a_plain_number_is_a_failed_query_not_a_crash() -> None:
    """``autoscaling.query`` is the user's: one over a native histogram answers ``histogram``
    samples, which have no ``value``.  That must be the pool's QueryFailed (its condition says
    why), not an exception that ends the loop's tick before the pools after it are polled."""
    answers = [
        {"resultType": "vector", "result": [{"metric": {}, "histogram": [1.0, {"count": "3", "sum": "9"}]}]},
        {"resultType": "vector", "result": [{"metric": {}, "value": [1.0, "many"]}]},
        {"resultType": "scalar", "result": [1.0, None]},
    ]
    served: list[dict[str, Any]] = []

    async def handler(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"status": "success", "data": served[-1]})

    app = aiohttp.web.Application()
    app.router.add_get("/api/v1/query", handler)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            for answer in answers:
                served.append(answer)
                with pytest.raises(MetricsUnavailable) as caught:
                    await query_prometheus(session, f"http://127.0.0.1:{port}", "sum(my_native_histogram)")
                assert caught.value.reason == "QueryFailed", answer
                assert "expected a number" in caught.value.message
    finally:
        await runner.cleanup()


async def test_a_restarted_operator_keeps_the_growth_block_after_stuck_replicas_were_released() -> None:
    """Rule 8: after stuck replicas are released the pool may not grow for the pending timeout.  A
    restart must not end that block early, or the pool grows straight back into the capacity that
    just left its replicas unschedulable."""
    run = run_body()
    pools = [pool_body("h100-fp8", replicas=4, ready=0, low=0, high=8, status={"selector": "app=fp8"})]
    h = Harness(run, pools, {"h100-fp8": None})

    async def stuck(key: Any, body: Any) -> Census | None:
        return Census(ready=0, starting=0, stuck=4, why_stuck="Unschedulable: no node")

    h.loop.pods_of = stuck  # type: ignore[method-assign]
    await h.poll("h100-fp8")
    assert h.replicas("h100-fp8") == 0
    # The operator restarts a minute later (the pending timeout is 600 s); the load is back.
    restarted = Harness(run, [copy.deepcopy(h.api.pools[f"{RUN}-h100-fp8"])], {"h100-fp8": 16 * 1.5 * 4})
    restarted.now = h.now + 60

    async def gone(key: Any, body: Any) -> Census | None:
        return Census(ready=0, starting=0, stuck=0)  # the released replicas' pods are gone

    restarted.loop.pods_of = gone  # type: ignore[method-assign]
    await restarted.poll("h100-fp8")
    assert restarted.replicas("h100-fp8") == 0  # before: 0 → 4, into the same unschedulable nodes
    restarted.now = h.now + 601
    await restarted.poll("h100-fp8")
    assert restarted.replicas("h100-fp8") == 4  # the persisted block ends when it would have


def two_runs(hung: str, healthy: str) -> tuple[list[Obj], list[Obj]]:
    """Run ``RUN`` on Prometheus ``hung`` and run ``other`` on ``healthy``, two pools each."""
    runs = [run_body(prometheusUrl=hung), run_body(prometheusUrl=healthy)]
    runs[1]["metadata"]["name"] = "other"
    pools = [pool_body(p, replicas=1, ready=1, low=1, high=8) for p in ("h100-fp8", "h100-bf16")]
    for p in ("h100-fp8", "h100-bf16"):
        body = pool_body(p, replicas=1, ready=1, low=1, high=8)
        body["metadata"].update(name=f"other-{p}", uid=f"other-{p}")
        body["spec"]["run"] = "other"
        pools.append(body)
    return runs, pools


async def test_a_hung_prometheus_is_asked_once_per_tick_and_other_prometheuses_still_answer() -> None:
    """A Prometheus that times out cost every query of every pool on it a timeout, one after
    another: a tick took minutes, and pools on a healthy Prometheus waited behind it."""
    hung, healthy = "http://hung:9090", "http://prometheus:9090"
    runs, pools = two_runs(hung, healthy)
    asked: list[str] = []

    def answer(url: str, query: str) -> float:
        asked.append(url)
        if url == hung:
            raise MetricsUnavailable("PrometheusUnreachable", f"{url}/api/v1/query: TimeoutError")
        return 16 * 3 * (1.5 if "h100-fp8" in query else 1.0)  # 3 replicas' worth

    async def observer(session: Any, url: str, query: str, timeout: float, window: Any) -> Observation:
        try:
            return Observation(answer(url, query), answer(url, query))
        except MetricsUnavailable as problem:
            return Observation(None, None, problem)

    async def scalar(session: Any, url: str, query: str, timeout: float) -> float:
        answer(url, query)
        raise MetricsUnavailable("NoSeries", "no router")

    api, now = FakeApi(pools), [1e6]
    settings = LoopSettings(check_gpu_models=False)
    loop = AutoscalingLoop(api, settings, clock=lambda: now[0], observer=observer, scalar=scalar)  # type: ignore[arg-type]
    for run in runs:
        loop.observe_run(run, deleted=False)
    for body in pools:
        loop.observe_pool(body, deleted=False)
    try:
        done = await loop.tick()
        first = list(asked)
        asked.clear()
        now[0] += 30
        await loop.tick()
    finally:
        await loop.stop()
    assert first.count(hung) == 1  # before: 4, each a timeout (the load and the router's capacity, per pool)
    assert len(done) == 4
    for p in ("h100-fp8", "h100-bf16"):
        (condition,) = api.pools[f"{RUN}-{p}"]["status"]["conditions"]
        assert (condition["type"], condition["status"]) == ("MetricsAvailable", "False")
        assert condition["reason"] == "PrometheusUnreachable" and hung in condition["message"]
        assert api.pools[f"{RUN}-{p}"]["spec"]["replicas"] == 1  # held
        assert api.pools[f"other-{p}"]["spec"]["replicas"] == 3  # the healthy Prometheus still decides
    # The next tick asks the hung Prometheus again (it may have come back), once.
    assert asked.count(hung) == 1


async def test_an_unexpected_error_in_one_pool_does_not_end_the_tick_for_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = run_body()
    pools = [
        pool_body("h100-fp8", replicas=1, ready=1, low=1, high=8),
        pool_body("h100-bf16", replicas=1, ready=1, low=1, high=8),
    ]
    h = Harness(run, pools, {"h100-fp8": 16 * 1.5 * 3, "h100-bf16": 16 * 3.0})
    observer = h.loop.observer

    async def broken(session: Any, url: str, query: str, timeout: float, window: Any) -> Observation:
        if f"{RUN}-h100-fp8-" in query:
            raise RuntimeError("a bug in one pool's poll")
        return await observer(session, url, query, timeout, window)

    h.loop.observer = broken
    with caplog.at_level(logging.WARNING, logger="mixrl.operator.autoscaling"):
        done = await h.poll_run()
    # Before: the RuntimeError ended the tick, so h100-bf16 (after it) was never polled.
    assert [key[1] for key, _ in done] == [f"{RUN}-h100-bf16"]
    assert h.replicas("h100-bf16") == 3
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"{RUN}-h100-fp8" in line and "a bug in one pool's poll" in line

    async def cancelled(session: Any, url: str, query: str, timeout: float, window: Any) -> Observation:
        raise asyncio.CancelledError

    h.loop.observer = cancelled
    h.now += 30
    with pytest.raises(asyncio.CancelledError):  # the operator's shutdown is not one pool's failure
        await h.poll_run()


async def test_a_failed_scale_write_records_no_scale_up() -> None:
    run = run_body()
    h = Harness(run, [pool_body("h100-fp8", replicas=1, ready=1, low=1, high=8)], {"h100-fp8": 16 * 1.5 * 3})
    key = (NS, f"{RUN}-h100-fp8")
    patch = h.api.merge_patch

    async def conflicting(
        resource: Any, namespace: str, name: str, body: Any, subresource: Any = None
    ) -> Any:
        if subresource == "scale":
            raise ApiError(409, "Conflict", "the object has been modified")
        return await patch(resource, namespace, name, body, subresource)

    h.api.merge_patch = conflicting  # type: ignore[method-assign]
    with pytest.raises(ApiError):
        await h.poll("h100-fp8")
    assert h.replicas("h100-fp8") == 1
    # Before: the state said 2 replicas were added this period, so the rate limit counted them.
    assert h.loop.memory[key].state.scale_ups == ()
    h.api.merge_patch = patch  # type: ignore[method-assign]
    h.now += 30
    await h.poll("h100-fp8")
    assert h.replicas("h100-fp8") == 3
    assert h.loop.memory[key].state.scale_ups == ((h.now, 2),)


def test_a_run_kueue_holds_is_not_scaled() -> None:
    # Its controller keeps the pools at zero until Kueue admits it; the loop scaling them to their
    # minimum made the two write against each other every tick.
    run = run_body()
    assert run_to_scale({**run, "status": {"phase": "Pending"}}) is not None
    assert run_to_scale({**run, "status": {"phase": "Queued"}}) is None
