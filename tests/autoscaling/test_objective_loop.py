"""``objective: trainer`` through the loop's real poll path: the run's series in, every pool's replicas out."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import aiohttp.web
import pytest

from mixrl.api.models import GROUP
from mixrl.api.status import ConcurrencyRecommendation
from mixrl.operator.autoscaling import loop as loop_module
from mixrl.operator.autoscaling.fleet_objective import FleetPlan, ObjectiveMemory
from mixrl.operator.autoscaling.plan import concurrency_status
from mixrl.operator.autoscaling.promql import (
    default_load_query,
    pool_busy_query,
    pool_rate_per_replica_query,
    pool_throughput_query,
    trainer_queries,
)
from mixrl.operator.kube.rbac import is_allowed, permissions

from .conftest import EngineMetrics, engine_job, free_port
from .test_fleet_bugs import NS, RUN, Harness, pool_body, run_body
from .test_loop_prometheus import eventually_value, value_of

STARVED_TRAINER = {
    "clamp_max": 1.0,  # the pools' busy share: the rollout keeps them busy
    "mixrl_buffer_trainer_busy_seconds": 128.0,
    "mixrl_buffer_batches_total": 1 / 900,
    "mixrl_buffer_trainer_wait_seconds_total": 0.85,
    "mixrl_buffer_trajectories{": 0.0,
    "mixrl_router_sessions": 1024.0,
    'pool="b300-nvfp4"': 0.8,
}
"""The mixed example's series with a starved trainer: 1024 trajectories per 128 s of compute = 8/s,
while the fleet (one b300 replica) delivers 0.8/s."""


def test_the_trainer_queries_read_the_buffer_and_the_router() -> None:
    queries = trainer_queries(NS, RUN)
    assert (
        queries["step_rate"] == f'sum(rate(mixrl_buffer_batches_total{{namespace="{NS}",run="{RUN}"}}[5m]))'
    )
    assert "mixrl_buffer_trainer_wait_seconds_total" in queries["idle_share"]
    assert queries["busy_step_s"].startswith("avg(avg_over_time(mixrl_buffer_trainer_busy_seconds{")
    assert (
        "mixrl_router_sessions" in queries["in_flight"]
        and "mixrl_buffer_trajectories{" in queries["buffered"]
    )
    assert pool_throughput_query(NS, RUN, "b200-nvfp4").endswith(',pool="b200-nvfp4"}[5m]))')


async def test_the_fleet_is_sized_to_the_trainer_cheapest_capacity_first() -> None:
    # The mixed example: 128 prompts × 8 samples = 1024 trajectories per step, 4 workers × 64 sessions.
    run = run_body(objective="trainer", trainerIdleTarget=0.0)
    pools = [
        pool_body("h100-fp8", replicas=0, ready=0, low=0, high=8),  # asleep; $2.5 per 1.5: cheapest
        pool_body("b300-nvfp4", replicas=1, ready=1, low=1, high=8),  # $8 per 4.0
        pool_body("h100-bf16", replicas=0, ready=0, low=0, high=4),  # asleep; $2.5 per 1.0: dearest
    ]
    h = Harness(run, pools, {"h100-fp8": None, "b300-nvfp4": 16 * 4.0, "h100-bf16": None})
    h.values = dict(STARVED_TRAINER)
    await h.poll_run()
    # b300 measures 0.2 trajectories/s per capacity unit, so 8/s needs 40 units: h100-fp8 is woken
    # and filled first (8 × 1.5 = 12 units), then b300 (28 units = 7 replicas); h100-bf16 sleeps.
    assert (h.replicas("h100-fp8"), h.replicas("b300-nvfp4"), h.replicas("h100-bf16")) == (8, 7, 0)
    decisions = h.api.pools[f"{RUN}-h100-fp8"]["status"]["lastScaleDecisions"]
    assert "cheapest throughput first" in decisions[-1]["reason"]


async def test_a_zero_scale_down_window_still_plans() -> None:
    run = run_body(objective="trainer", scaleDownWindowSeconds=0)
    h = Harness(run, [pool_body("b300-nvfp4", replicas=1, ready=1, low=1, high=8)], {"b300-nvfp4": 64.0})
    h.values = {"clamp_max": 1.0, "mixrl_buffer_trainer_busy_seconds": 128.0, 'pool="b300-nvfp4"': 0.8}
    await h.poll_run()  # raised "ObjectiveConfig.horizon_s: must be > 0" every tick before
    assert h.replicas("b300-nvfp4") == 8


async def test_a_queue_run_is_planned_pool_by_pool() -> None:
    run = run_body()  # objective: queue (the default)
    h = Harness(run, [pool_body("h100-fp8", replicas=1, ready=1, low=1, high=8)], {"h100-fp8": 16 * 1.5 * 3})
    [(_, plan)] = await h.poll_run()
    assert plan.decision.desired == 3 and "traj/s" not in plan.decision.reason


async def test_a_pool_is_sized_by_the_capacity_the_router_shares_by() -> None:
    """The router measured h100-fp8 at a third of its declared 1.5 and shares sessions by 0.5: the
    policy sizes the pool by the same figure (16 x 0.5 = 8 requests per replica), not by 24."""
    run = run_body()
    h = Harness(run, [pool_body("h100-fp8", replicas=1, ready=1, low=1, high=8)], {"h100-fp8": 16 * 1.5 * 3})
    h.values = {f'mixrl_router_capacity_per_replica{{namespace="{NS}",run="{RUN}",pool="h100-fp8"': 0.5}
    [(_, plan)] = await h.poll_run()
    assert plan.decision.desired == 8  # ceil(72 / 8), bounded by maxReplicas 8


async def test_every_trainer_query_runs_on_a_real_prometheus(serve, prometheus) -> None:
    """The buffer's and the router's series as they expose them, scraped every second: each query
    of the objective returns a number (a typo in PromQL would be QueryFailed, not a value)."""
    scrapes = {"n": 0}
    buffer_port, router_port, engine_port = free_port(), free_port(), free_port()
    labels = f'run="{RUN}",pool="b200-nvfp4",gpu_type="B200",precision="nvfp4"'

    async def buffer(_: aiohttp.web.Request) -> aiohttp.web.Response:
        scrapes["n"] += 1
        n = scrapes["n"]
        lines = [
            f'mixrl_buffer_batches_total{{run="{RUN}"}} {n // 2}',
            f'mixrl_buffer_trainer_wait_seconds_total{{run="{RUN}"}} {0.25 * n}',
            f'mixrl_buffer_trainer_busy_seconds{{run="{RUN}"}} 120',
            f"mixrl_buffer_trajectories{{{labels}}} 300",
            f"mixrl_buffer_trajectories_received_total{{{labels}}} {4 * n}",
        ]
        return aiohttp.web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def router(_: aiohttp.web.Request) -> aiohttp.web.Response:
        text = f"mixrl_router_sessions{{{labels}}} 512\nmixrl_router_replicas_ready{{{labels}}} 2\n"
        return aiohttp.web.Response(text=text, content_type="text/plain")

    engine = EngineMetrics(negotiate=False)
    engine.set(20, 30)
    await serve(buffer, buffer_port)
    await serve(router, router_port)
    await serve(engine.handle, engine_port)
    job = "  - job_name: {0}\n    honor_labels: true\n    static_configs:\n      - targets: ['127.0.0.1:{1}']\n        labels: {{namespace: {2}}}\n"
    server = await prometheus(
        [
            job.format("buffer", buffer_port, NS),
            job.format("router", router_port, NS),
            engine_job("e", engine_port, NS, f"{RUN}-b200-nvfp4-abcde-11111"),
        ]
    )
    queries = {**trainer_queries(NS, RUN), "supply": pool_throughput_query(NS, RUN, "b200-nvfp4")}
    # A short subquery window: a 5m:15s one has no aligned steps with samples in a fresh Prometheus.
    load = default_load_query(NS, f"{RUN}-b200-nvfp4")
    queries["busy"] = pool_busy_query(load, NS, RUN, "b200-nvfp4", 16 * 3.2, ("3s", "1s"))

    async with aiohttp.ClientSession() as session:
        await value_of(session, server.url, "count(up == 1)", 3.0)  # every target scraped
        # rate() over the window needs two samples of a counter: wait for the second scrape
        await value_of(session, server.url, "count(count_over_time(mixrl_buffer_batches_total[5m]) > 1)", 1.0)
        values = {name: await eventually_value(session, server.url, q) for name, q in queries.items()}
    assert values["busy_step_s"] == 120 and values["buffered"] == 300 and values["in_flight"] == 512
    assert 0 < values["idle_share"] < 1 and 0 < values["step_rate"] < 1 and values["supply"] > 0
    assert values["busy"] == pytest.approx(50 / (16 * 3.2 * 2))  # 50 requests on 2 × 51.2 slots


async def test_a_young_series_reads_at_its_real_speed_per_replica(serve, prometheus) -> None:
    """A pool two ready replicas strong delivering 2 trajectories/s each, its series seconds old:
    ``rate()/ready`` divides by the whole 5-minute window and read it at a few percent of its speed
    (on the test bed every pool went to its maximum); the per-replica query reads ≈ 2."""
    start = asyncio.get_running_loop().time()
    labels = f'run="{RUN}",pool="b200-nvfp4"'

    async def buffer(_: aiohttp.web.Request) -> aiohttp.web.Response:
        received = 2 * 2 * (asyncio.get_running_loop().time() - start)
        text = (
            f"mixrl_buffer_trajectories_received_total{{{labels}}} {received}\n"
            f"mixrl_router_replicas_ready{{{labels}}} 2\n"
        )
        return aiohttp.web.Response(text=text, content_type="text/plain")

    port = free_port()
    await serve(buffer, port)
    job = "  - job_name: b\n    honor_labels: true\n    static_configs:\n      - targets: ['127.0.0.1:{0}']\n        labels: {{namespace: {1}}}\n"
    server = await prometheus([job.format(port, NS)])
    async with aiohttp.ClientSession() as session:
        counter = "mixrl_buffer_trajectories_received_total"
        await value_of(session, server.url, f"count(count_over_time({counter}[5m]) >= 5)", 1.0)
        per_replica = await eventually_value(
            session, server.url, pool_rate_per_replica_query(NS, RUN, "b200-nvfp4")
        )
        naive = await eventually_value(session, server.url, pool_throughput_query(NS, RUN, "b200-nvfp4")) / 2
    assert per_replica == pytest.approx(2.0, rel=0.3)
    assert naive < 0.5  # what the objective was given before


def concurrency_bound(**autoscaling: Any) -> Harness:
    """b300 alone delivers 0.8 trajectories/s per replica (0.2 per capacity unit); the trainer wants
    8/s, 40 units, but 64 × 4 sessions keep only 256 / 16 = 16 units busy."""
    run = run_body(objective="trainer", **autoscaling)
    run["spec"]["rollout"]["concurrency"] = 64
    h = Harness(run, [pool_body("b300-nvfp4", replicas=1, ready=1, low=1, high=16)], {"b300-nvfp4": 64.0})
    h.values = {
        "clamp_max": 1.0,
        "mixrl_buffer_trainer_busy_seconds": 128.0 * 0.95,  # 1024 per 121.6 s × 0.95 = 8/s
        "mixrl_buffer_trainer_wait_seconds_total": 0.5,
        "mixrl_buffer_trajectories{": 1024.0,  # 1.25 steps with those in flight: inside the band
        "mixrl_router_sessions": 256.0,
        'pool="b300-nvfp4"': 0.8,
    }
    return h


async def test_the_concurrency_the_demand_needs_is_written_to_the_run_status() -> None:
    h = concurrency_bound()
    await h.poll_run()
    assert h.replicas("b300-nvfp4") == 4  # what 256 sessions keep busy, no more
    [(name, subresource, patch)] = h.api.run_writes
    assert (name, subresource) == (RUN, "status")
    value = patch["status"]["recommendedConcurrency"]
    assert (value["sessions"], value["configured"]) == (40 * 16, 256)  # 40 units × 16 sessions each
    assert "rollout concurrency 256" in value["message"] and value["time"].endswith("Z")
    ConcurrencyRecommendation.model_validate(value)  # the CRD's own model
    for clusterwide in (True, False):  # the operator's RBAC table (and so the chart) grants the write
        assert is_allowed(permissions(clusterwide), GROUP, "rlruns/status", "patch")
    # The same figure again: no second write (one per change, not one per poll).
    h.now += 60
    await h.poll_run()
    assert len(h.api.run_writes) == 1


async def test_a_run_that_leaves_the_trainer_objective_has_its_recommendation_cleared() -> None:
    h = concurrency_bound()
    await h.poll_run()
    assert len(h.api.run_writes) == 1
    run = dict(h.loop.runs[(NS, RUN)])
    run["spec"] = {**run["spec"], "autoscaling": {**run["spec"]["autoscaling"], "objective": "queue"}}
    h.loop.observe_run(run, deleted=False)
    h.now += 60
    await h.poll_run()
    assert h.api.run_writes[-1] == (RUN, "status", {"status": {"recommendedConcurrency": None}})
    h.now += 60
    await h.poll_run()
    assert len(h.api.run_writes) == 2  # cleared once


def test_the_recommendation_is_cleared_only_by_a_fill_that_found_the_concurrency_enough() -> None:
    previous = {"sessions": 640, "configured": 256, "time": "t", "message": "m"}
    memory = ObjectiveMemory()

    def plan(recommended: int | None, filled: bool) -> FleetPlan:
        return FleetPlan({}, {}, 8.0, 8.0, recommended, memory, "s", filled=filled)

    assert concurrency_status(previous, plan(None, filled=False), 256, 0.0, 0.1) == (False, None)
    assert concurrency_status(previous, plan(None, filled=True), 256, 0.0, 0.1) == (True, None)
    assert concurrency_status(None, plan(None, filled=True), 256, 0.0, 0.1) == (False, None)
    assert concurrency_status(previous, plan(660, filled=True), 256, 0.0, 0.1)[0] is False  # wobble
    assert concurrency_status(previous, plan(720, filled=True), 256, 0.0, 0.1)[1]["sessions"] == 720
    assert concurrency_status(previous, plan(640, filled=True), 512, 0.0, 0.1)[1]["configured"] == 512


@pytest.mark.parametrize(
    ("counted", "written"),
    [
        (600.0, None),  # this poll's pods learned it
        # None counted (no ready pod, or no creation-to-ready time to read): the pool's
        # status.coldStartSeconds, learned earlier, is the horizon (before: no plan ahead at all).
        (None, 600.0),
    ],
)
async def test_a_speeding_trainer_is_planned_a_learned_cold_start_ahead_through_the_loop(
    counted: float | None, written: float | None
) -> None:
    """The learned cold start reaches the objective: a trainer whose busy time falls is planned
    for one cold start ahead, and the decision says so."""
    from mixrl.operator.autoscaling.replicas import Census

    run = run_body(objective="trainer", trainerIdleTarget=0.0)
    status = {} if written is None else {"coldStartSeconds": written}
    pool = pool_body("b300-nvfp4", replicas=4, ready=4, low=1, high=16, status=status)
    h = Harness(run, [pool], {"b300-nvfp4": 64.0})

    async def census(key: Any, body: Any) -> Census:
        ready = int(body["status"]["readyReplicas"])
        return Census(ready=ready, starting=0, stuck=0, cold_start_s=counted)

    h.loop.pods_of = census  # type: ignore[method-assign]
    # The trainer computes 1024 trajectories in 160 s, falling 3.75 s every 30 s poll (to 85 s);
    # four ready replicas deliver what it needs at each poll (0.2 /s per capacity unit, 4.0 per replica).
    for poll in range(21):
        busy = 160.0 - 3.75 * poll
        h.now += 30.0
        h.set_ready("b300-nvfp4", h.replicas("b300-nvfp4"))
        h.values = {
            "clamp_max": 1.0,
            "mixrl_buffer_trainer_busy_seconds": busy,
            "mixrl_buffer_trajectories{": 1024.0,
            "mixrl_router_sessions": 512.0,
            'pool="b300-nvfp4"': 1024 / busy / h.replicas("b300-nvfp4"),
        }
        await h.poll_run()
    reasons = [d["reason"] for d in h.api.pools[f"{RUN}-b300-nvfp4"]["status"]["lastScaleDecisions"]]
    assert any("trainer speeding up" in r and "600 s" in r for r in reasons), reasons


def test_a_run_is_resolved_once_per_event_not_at_every_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    h = concurrency_bound()
    resolved: list[object] = []
    real = loop_module.run_to_scale
    monkeypatch.setattr(loop_module, "run_to_scale", lambda body: resolved.append(body) or real(body))
    pool = h.loop.pools[(NS, f"{RUN}-b300-nvfp4")]
    first = h.loop.resolved_run(pool)
    assert first is not None and all(h.loop.resolved_run(pool) is first for _ in range(3))
    assert len(resolved) == 1
    run = dict(h.loop.runs[(NS, RUN)])  # an event: the run as it is now, ended
    h.loop.observe_run({**run, "status": {"phase": "Succeeded"}}, deleted=False)
    assert h.loop.resolved_run(pool) is None and len(resolved) == 2


async def test_a_starved_trainer_is_reported_on_the_run() -> None:
    # Before, TrainerStarved was posted under the run's name with the SamplerPool kind, so
    # `kubectl describe rlrun` never showed it.
    h = concurrency_bound()
    why = "cheap at its maximum (4)"
    plan = FleetPlan({}, {}, 1.0, 0.5, None, ObjectiveMemory(), f"trainer idle 30%: {why}", stalled=why)
    await h.loop.report_stall((NS, RUN), plan, h.now)
    await h.loop.report_stall((NS, RUN), plan, h.now + 60)  # once per distinct reason
    [event] = h.api.events
    assert event["reason"] == "TrainerStarved" and event["type"] == "Warning"
    assert {k: event["involvedObject"][k] for k in ("kind", "name")} == {"kind": "RLRun", "name": RUN}


async def test_the_trainer_objective_checks_the_gpu_models_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """WrongGpuType under ``objective: trainer``: before, the fleet's poll never asked DCGM."""
    asked: list[str] = []

    async def label_values(session: Any, url: str, query: str, label: str, timeout: float) -> set[str]:
        asked.append(query)
        return {"NVIDIA A100-SXM4-80GB"}

    monkeypatch.setattr(loop_module, "query_label_values", label_values)
    run = run_body(objective="trainer")
    h = Harness(run, [pool_body("b300-nvfp4", replicas=1, ready=1, low=1, high=8)], {"b300-nvfp4": 64.0})
    h.loop.settings = loop_module.LoopSettings(check_gpu_models=True)
    await h.poll_run()
    assert asked and all(f"{RUN}-b300-nvfp4" in q for q in asked)
    conditions = {c["type"]: c for c in h.api.pools[f"{RUN}-b300-nvfp4"]["status"]["conditions"]}
    assert conditions["WrongGpuType"]["status"] == "True"
    assert [e["reason"] for e in h.api.events] == ["WrongGpuType"]
