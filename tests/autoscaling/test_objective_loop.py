"""``objective: trainer`` through the loop's real poll path: the run's series in, every pool's replicas out."""

from __future__ import annotations

from mixrl.operator.autoscaling.promql import pool_throughput_query, trainer_queries

from .test_fleet_bugs import NS, RUN, Harness, pool_body, run_body


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
    # Trainer: 1024 trajectories per 128 s of compute = 8/s; the fleet delivers 0.8/s.
    h.values = {
        "mixrl_buffer_trainer_busy_seconds": 128.0,
        "mixrl_buffer_batches_total": 1 / 900,
        "mixrl_buffer_trainer_wait_seconds_total": 0.85,
        "mixrl_buffer_trajectories{": 0.0,
        "mixrl_router_sessions": 1024.0,
        'pool="b300-nvfp4"': 0.8,
    }
    await h.poll_run()
    # b300 measures 0.2 trajectories/s per capacity unit, so 8/s needs 40 units: h100-fp8 is woken
    # and filled first (8 × 1.5 = 12 units), then b300 (28 units = 7 replicas); h100-bf16 sleeps.
    assert (h.replicas("h100-fp8"), h.replicas("b300-nvfp4"), h.replicas("h100-bf16")) == (8, 7, 0)
    decisions = h.api.pools[f"{RUN}-h100-fp8"]["status"]["lastScaleDecisions"]
    assert "cheapest throughput first" in decisions[-1]["reason"]


async def test_a_queue_run_is_planned_pool_by_pool() -> None:
    run = run_body()  # objective: queue (the default)
    h = Harness(run, [pool_body("h100-fp8", replicas=1, ready=1, low=1, high=8)], {"h100-fp8": 16 * 1.5 * 3})
    [(_, plan)] = await h.poll_run()
    assert plan.decision.desired == 3 and "traj/s" not in plan.decision.reason
