"""Regression tests for the bugs of issue 15, each failing on the code before the fix.

The loop runs its real poll path (:meth:`AutoscalingLoop.poll`) against an in-memory stand-in of
the three API calls it makes (get, merge patch, create) and scripted Prometheus answers; the
wiring against a real Prometheus and kmock's API emulator is in test_loop_prometheus.py.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from mixrl.operator.autoscaling.loop import AutoscalingLoop, LoopSettings
from mixrl.operator.autoscaling.plan import MetricsUnavailable, Observation, PoolMemory
from mixrl.operator.autoscaling.policy import (
    PolicyConfig,
    PolicyState,
    PoolLoad,
    decide,
)
from mixrl.rl.metrics import MIXRL_ROUTER_CAPACITY_PER_REPLICA

Obj = dict[str, Any]
NS, RUN = "rl", "qwen3-moe-coding"


class FakeApi:
    """The loop's three API calls, on a dict of SamplerPools; records every write."""

    def __init__(self, pools: list[Obj]):
        self.pools = {p["metadata"]["name"]: p for p in pools}
        self.writes: list[tuple[str, str, Obj]] = []
        self.events: list[Obj] = []
        self.run_writes: list[tuple[str, str, Obj]] = []
        """Patches of RLRuns (their status: the recommended concurrency)."""

    async def get(self, resource: Any, namespace: str, name: str) -> Obj | None:
        return copy.deepcopy(self.pools.get(name))

    async def merge_patch(
        self, resource: Any, namespace: str, name: str, body: Obj, subresource: str | None = None
    ) -> Obj:
        if resource.plural == "rlruns":
            self.run_writes.append((name, subresource or "", body))
            return body
        self.writes.append((name, subresource or "", body))
        target = self.pools[name]
        for key, value in body.items():
            target.setdefault(key, {}).update(value)
        return target

    async def create(self, resource: Any, namespace: str, body: Obj) -> Obj:
        self.events.append(body)
        return body


def run_body(**autoscaling: Any) -> Obj:
    with open("examples/rlrun-mixed.yaml") as f:
        doc = yaml.safe_load(f)
    doc["metadata"]["namespace"] = NS
    doc["spec"]["autoscaling"].update(autoscaling)
    return doc


def pool_body(pool: str, replicas: int, ready: int, low: int, high: int, status: Obj | None = None) -> Obj:
    return {
        "metadata": {"name": f"{RUN}-{pool}", "namespace": NS, "uid": pool, "generation": 1},
        "spec": {"run": RUN, "pool": pool, "replicas": replicas, "minReplicas": low, "maxReplicas": high},
        "status": {"readyReplicas": ready, "conditions": [], **(status or {})},
    }


CAPACITY = MIXRL_ROUTER_CAPACITY_PER_REPLICA.name


class Harness:
    def __init__(self, run: Obj, pools: list[Obj], loads: dict[str, float | None], paused: float = 0.0):
        self.api = FakeApi(pools)
        self.loads = loads
        self.paused = paused
        self.values: dict[str, float] = {}
        """Scripted answers of the other instant queries: a substring of the query -> its value."""
        self.now = 1_000_000.0

        async def observer(session: Any, url: str, query: str, timeout: float, window: Any) -> Observation:
            for pool, value in self.loads.items():
                if f"{RUN}-{pool}-" in query:
                    if value is None:
                        return Observation(None, None, MetricsUnavailable("NoSeries", "no series"))
                    return Observation(value, value)
            raise AssertionError(query)

        async def scalar(session: Any, url: str, query: str, timeout: float) -> float:
            for needle, value in self.values.items():
                if needle in query and (CAPACITY not in query or CAPACITY in needle):
                    return value
            if CAPACITY in query:  # the router's capacity, only where a test scripts it
                raise MetricsUnavailable("NoSeries", "no router")
            if self.paused:
                return self.paused
            raise MetricsUnavailable("NoSeries", "nothing paused")

        self.loop = AutoscalingLoop(
            self.api,  # type: ignore[arg-type]
            LoopSettings(check_gpu_models=False),
            clock=lambda: self.now,
            observer=observer,
            scalar=scalar,
        )
        self.loop.observe_run(run, deleted=False)
        for body in pools:
            self.loop.observe_pool(body, deleted=False)

    async def poll(self, pool: str) -> None:
        key = (NS, f"{RUN}-{pool}")
        run = self.loop.resolved_run(self.loop.pools[key])
        assert run is not None
        memory = self.loop.memory.setdefault(key, PoolMemory())
        try:
            await self.loop.poll(key, self.loop.pools[key], run, run.pool(pool), memory, self.now)
        finally:
            await self.loop.stop()  # closes the loop's HTTP session (the scripted answers need none)

    async def poll_run(self) -> list:
        """One tick of the whole loop (the trainer objective plans a run's pools together)."""
        try:
            return await self.loop.tick()
        finally:
            await self.loop.stop()

    def replicas(self, pool: str) -> int:
        return int(self.api.pools[f"{RUN}-{pool}"]["spec"]["replicas"])

    def set_ready(self, pool: str, ready: int) -> None:
        self.api.pools[f"{RUN}-{pool}"]["status"]["readyReplicas"] = ready


async def test_a_sleeping_pool_without_series_applies_its_budget_grant() -> None:
    # a100-bf16 (capacity 0.5, $1.2/GPU-h: $2.4 per capacity-hour) is cheaper than h100-fp8
    # (1.5 capacity, $2.5: $1.67)... so take h100-bf16 (1.0, $2.5) as the dear pool asking for 8.
    run = run_body(gpuBudget=40)
    pools = [
        pool_body("h100-bf16", replicas=1, ready=1, low=0, high=8),
        pool_body("h100-fp8", replicas=0, ready=0, low=0, high=8),
    ]
    h = Harness(run, pools, {"h100-bf16": 16 * 8.0, "h100-fp8": None})
    await h.poll("h100-fp8")  # asleep: no engines, no series
    await h.poll("h100-bf16")  # asks for 8 units; the cheaper h100-fp8 is granted them
    h.now += 30
    await h.poll("h100-fp8")
    # Before the fix the sleeping pool was skipped (NoSeries), never applied its grant, and the
    # dear pool stayed at 1: 1 unit of capacity for a demand of 8.
    assert h.replicas("h100-fp8") > 0
    capacity = h.replicas("h100-fp8") * 1.5 + h.replicas("h100-bf16") * 1.0
    assert capacity >= 8


async def test_fallback_replicas_never_wake_a_sleeping_pool() -> None:
    run = run_body(fallbackReplicas=2)
    h = Harness(run, [pool_body("a100-bf16", replicas=0, ready=0, low=0, high=8)], {"a100-bf16": None})
    for _ in range(4):
        await h.poll("a100-bf16")
        h.now += 30
    assert h.replicas("a100-bf16") == 0  # before: 2, then back to 0, then 2…
    assert not any(w[1] == "scale" for w in h.api.writes)


async def test_fallback_replicas_still_apply_when_prometheus_is_down() -> None:
    run = run_body(fallbackReplicas=2)
    h = Harness(run, [pool_body("a100-bf16", replicas=5, ready=5, low=0, high=8)], {"a100-bf16": None})
    h.loads["a100-bf16"] = None
    await h.poll("a100-bf16")
    assert h.replicas("a100-bf16") == 2  # NoSeries with replicas > 0 is missing metrics


def test_pending_replicas_stop_counting_as_capacity_after_the_timeout() -> None:
    config = PolicyConfig(min_replicas=1, max_replicas=16, target_per_replica=25.0, pending_timeout_s=600)
    state = PolicyState()
    stuck = PoolLoad(load=200.0, replicas=8, ready=2, starting=6)
    first = decide(stuck, state, config, 0.0)
    assert first.desired == 8 and "within tolerance" in first.reason
    later = decide(stuck, first.state, config, 600.0)
    # Before: "within tolerance" forever, six Pending pods counted as capacity.
    assert later.desired == 2 and "pending timeout" in later.reason
    assert later.ceiling == 2
    blocked = decide(PoolLoad(load=200.0, replicas=2, ready=2), later.state, config, 630.0)
    assert blocked.desired == 2 and "blocked" in blocked.reason
    free = decide(PoolLoad(load=200.0, replicas=2, ready=2), later.state, config, 1300.0)
    assert free.desired == 8


def test_a_cold_start_in_progress_is_not_stuck() -> None:
    config = PolicyConfig(min_replicas=1, max_replicas=16, target_per_replica=25.0, pending_timeout_s=600)
    state = PolicyState()
    for t, ready in ((0, 2), (300, 4), (700, 6), (1200, 7)):
        decision = decide(PoolLoad(load=200.0, replicas=8, ready=ready, starting=8 - ready), state, config, t)
        state = decision.state
        assert "pending timeout" not in decision.reason


async def test_pending_capacity_is_replaced_from_another_pool_under_the_budget() -> None:
    run = run_body(gpuBudget=12, pendingTimeoutSeconds=600)
    pools = [
        pool_body("h100-fp8", replicas=8, ready=2, low=0, high=8),  # 6 Pending: nodes gone
        pool_body("h200-fp8", replicas=1, ready=1, low=1, high=8),
    ]
    h = Harness(run, pools, {"h100-fp8": 16 * 1.5 * 8, "h200-fp8": 16 * 1.8})
    for _ in range(25):
        await h.poll("h100-fp8")
        await h.poll("h200-fp8")
        h.set_ready("h200-fp8", h.replicas("h200-fp8"))
        h.now += 30
    assert h.replicas("h100-fp8") == 2  # the six stuck replicas were released…
    assert h.replicas("h200-fp8") > 1  # …and their GPUs went to the other pool


async def test_budget_cuts_wait_for_the_scale_down_window() -> None:
    run = run_body(gpuBudget=9)
    # h200-fp8 holds 8 of the 9 GPUs; then the cheaper b200-nvfp4 asks for 2: the budget moves
    # one GPU from h200-fp8 to it — a reallocation, not an excess, so it waits for the window.
    pools = [pool_body("h200-fp8", replicas=8, ready=8, low=1, high=8)]
    h = Harness(run, pools, {"h200-fp8": 16 * 1.8 * 8})
    await h.poll("h200-fp8")
    assert h.replicas("h200-fp8") == 8
    h.loop._budget[(NS, RUN)]["b200-nvfp4"] = _request("b200-nvfp4", desired=2, high=16)  # takes 2×1 GPU
    h.loads["h200-fp8"] = 16 * 1.8 * 7.9
    h.now += 30
    await h.poll("h200-fp8")
    # The budget (9 GPUs, b200 first) gives h200-fp8 7; before the fix it dropped at once.
    assert h.replicas("h200-fp8") == 8
    for _ in range(8):
        h.now += 30
        await h.poll("h200-fp8")
        assert h.replicas("h200-fp8") == 8  # the window holds for 300 s after the first poll
    h.now += 30
    await h.poll("h200-fp8")
    # Then the cheaper pool covers the whole demand (7 × 3.2 ≥ 8 × 1.8 + 2 × 3.2): h200-fp8 goes
    # to its minimum, as the budget's cheapest-first fill says.
    assert h.replicas("h200-fp8") == 1


def _request(name: str, desired: int, high: int) -> Any:
    from mixrl.operator.autoscaling.policy import BudgetRequest

    return BudgetRequest(name, desired, 0, high, 3.2, 1, 6.0)


async def test_a_restarted_operator_keeps_the_window() -> None:
    run = run_body()
    pools = [pool_body("h100-fp8", replicas=8, ready=8, low=1, high=8)]
    h = Harness(run, pools, {"h100-fp8": 16 * 1.5 * 8})
    await h.poll("h100-fp8")
    window = h.api.pools[f"{RUN}-h100-fp8"]["status"]["autoscalerWindow"]
    assert window and max(e["replicas"] for e in window) == 8
    # The operator restarts 100 s later; the load has fallen to one replica's worth.
    restarted = Harness(run, [copy.deepcopy(h.api.pools[f"{RUN}-h100-fp8"])], {"h100-fp8": 16 * 1.5})
    restarted.now = h.now + 100
    await restarted.poll("h100-fp8")
    assert restarted.replicas("h100-fp8") == 8  # before: 8 → 1 in one poll
    restarted.now = h.now + 310
    await restarted.poll("h100-fp8")
    assert restarted.replicas("h100-fp8") < 8  # the persisted window ends when it would have


async def test_a_pool_without_a_persisted_window_is_not_cut_on_the_first_poll() -> None:
    run = run_body()
    h = Harness(run, [pool_body("h100-fp8", replicas=8, ready=8, low=1, high=8)], {"h100-fp8": 16 * 1.5})
    await h.poll("h100-fp8")
    assert h.replicas("h100-fp8") == 8
    h.now += 301
    await h.poll("h100-fp8")
    assert h.replicas("h100-fp8") == 2  # ceil(24 · 1.1 / 24)


async def test_paused_requests_hold_replicas_during_a_weight_update() -> None:
    run = run_body()
    pool = pool_body("h100-fp8", replicas=8, ready=8, low=1, high=8, status={"autoscalerWindow": []})
    h = Harness(run, [pool], {"h100-fp8": 16 * 1.5}, paused=12.0)
    h.now += 1
    h.loop.memory[(NS, f"{RUN}-h100-fp8")] = PoolMemory(PolicyState(), last_poll=h.now - 400)
    await h.poll("h100-fp8")
    # Before: nothing set UpdatingWeights, so the engines' paused requests did not hold the pool.
    assert h.replicas("h100-fp8") == 8
    h.paused = 0.0
    h.now += 30
    await h.poll("h100-fp8")
    assert h.replicas("h100-fp8") == 2


async def test_max_below_min_is_refused_with_one_line_naming_the_field() -> None:
    run = run_body()
    h = Harness(run, [pool_body("h100-fp8", replicas=1, ready=1, low=3, high=1)], {"h100-fp8": 100.0})
    await h.poll("h100-fp8")
    h.now += 30
    await h.poll("h100-fp8")
    assert h.replicas("h100-fp8") == 1  # before: maxReplicas silently raised to 3 and scaled
    assert not h.api.writes
    [event] = h.api.events  # once, not once per poll
    assert event["message"] == "spec.maxReplicas: 1 is below spec.minReplicas 3; not scaling this pool"


def test_keda_is_modelled_as_hpa_computes_an_external_average_value() -> None:
    keda = PolicyConfig.keda_like(1, 40, 10.0)
    starting = PoolLoad(load=80.0, replicas=8, ready=4, starting=4)
    # HPA: usage / (target · spec.replicas) = 1.0 → within tolerance (before: 16, per ready pod).
    assert decide(starting, PolicyState(), keda, 0.0).desired == 8
    step = PoolLoad(load=160.0, replicas=8, ready=4, starting=4)
    assert decide(step, PolicyState(), keda, 0.0).recommendation == 16  # ceil(160 / 10), not 32


async def test_the_gpu_budget_removes_no_replica_while_the_engines_hold_paused_requests() -> None:
    # scaleDownWindowSeconds 0: a budget cut applies at once, so only rule 7 can hold it.
    run = run_body(gpuBudget=9, scaleDownWindowSeconds=0)
    pools = [pool_body("h200-fp8", replicas=8, ready=8, low=1, high=8)]
    h = Harness(run, pools, {"h200-fp8": 16 * 1.8 * 8}, paused=12.0)
    await h.poll("h200-fp8")
    # The cheaper b200-nvfp4 now covers the demand within the budget: h200-fp8 would go to 1.
    h.loop._budget[(NS, RUN)]["b200-nvfp4"] = _request("b200-nvfp4", desired=2, high=16)
    h.now += 30
    await h.poll("h200-fp8")
    # Before: the budget step read no paused requests (only a hand-set UpdatingWeights) and cut.
    assert h.replicas("h200-fp8") == 8
    decisions = h.api.pools[f"{RUN}-h200-fp8"]["status"].get("lastScaleDecisions") or []
    assert not decisions
    # Bounds apply last, over the hold: a maxReplicas lowered mid-update takes effect at once.
    h.api.pools[f"{RUN}-h200-fp8"]["spec"]["maxReplicas"] = 6
    h.now += 30
    await h.poll("h200-fp8")
    assert h.replicas("h200-fp8") == 6  # before: held at 8, above the pool's maximum
    assert (
        "held during weight update"
        in h.api.pools[f"{RUN}-h200-fp8"]["status"]["lastScaleDecisions"][-1]["reason"]
    )
    # The update over, the cut goes through.
    h.paused = 0.0
    h.now += 30
    await h.poll("h200-fp8")
    assert h.replicas("h200-fp8") == 1
