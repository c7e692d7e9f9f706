"""A replica released as stuck stays not-capacity until the pool's ready count rises (the fleet
objective's rule 8; the test bed's capacity-loss run flapped 7 → 5 → 7 without it)."""

from __future__ import annotations

from mixrl.operator.autoscaling.fleet_objective import (
    FleetPool,
    ObjectiveConfig,
    ObjectiveMemory,
    TrainerSignals,
    plan_fleet,
)
from mixrl.operator.autoscaling.policy import (
    PolicyConfig,
    PolicyState,
    PoolLoad,
    fleet_pending,
    pending_ceiling,
    stuck_until_ready,
    track_pending,
)

CONFIG = PolicyConfig(min_replicas=1, max_replicas=8, target_per_replica=16.0, pending_timeout_s=20)


def poll(
    state: PolicyState, released: int | None, load: PoolLoad, now: float
) -> tuple[PolicyState, int | None, int, int]:
    """One poll of the loop's rule-8 steps for one pool: (state, released_at, plain stuck, stuck)."""
    state, plain = track_pending(state, load, now, CONFIG)
    state, _ = pending_ceiling(state, load.replicas, plain, now, CONFIG)
    released, stuck = stuck_until_ready(released, load, plain)
    return state, released, plain, stuck


def test_a_released_replica_stays_stuck_until_one_comes_up() -> None:
    # The pool's nodes are gone: its one replica (minReplicas) stays Pending.
    lost = PoolLoad(load=None, replicas=1, ready=0, starting=1)
    state, released = PolicyState(), None
    plain_counts, counts = [], []
    for now in range(0, 80, 2):
        state, released, plain, stuck = poll(state, released, lost, float(now))
        plain_counts.append(plain)
        counts.append(stuck)
    assert 0 in plain_counts[11:]  # the restarted pending clock alone says "not stuck" again
    assert counts[10:] == [1] * len(counts[10:])  # from the first timeout on: stuck, every poll
    # The nodes come back: the replica comes up, and the pool counts as capacity again.
    state, released, _, stuck = poll(state, released, PoolLoad(load=None, replicas=1, ready=1), 80.0)
    assert (released, stuck) == (None, 0)


def test_the_fleet_does_not_take_the_replacement_back() -> None:
    """The objective's view while the lost pool's replica is counted stuck versus not."""
    signals = TrainerSignals(
        step_rate=None, idle_share=0.0, buffered=256.0, in_flight=1024.0, busy_step_s=256.0
    )
    config = ObjectiveConfig(step_size=1024, concurrency=1024, sessions_per_capacity=16)
    memory = ObjectiveMemory(rates={"b200": 1.0, "h200": 0.5625}, busy_step_s=256.0)

    def plan(stuck: int) -> dict[str, int]:
        pools = [
            FleetPool("b200", 1, 0, 3.2, 4, 6.0, 1, 8, stuck=stuck, ceiling=1),  # growth blocked
            FleetPool("h200", 7, 7, 1.8, 4, 3.5, 0, 8, throughput=7 * 0.5625, busy_share=1.0),
        ]
        return plan_fleet(pools, signals, config, memory).targets

    assert plan(stuck=1) == {"b200": 1, "h200": 7}  # 3.94 traj/s for 3.8: within tolerance
    assert plan(stuck=0) == {"b200": 1, "h200": 5}  # the Pending replica read as 1 traj/s


def test_a_pool_on_probation_does_not_grow_until_a_replica_comes_up() -> None:
    """fleet_pending, the rule-8 step the loop and the trainer-coupled simulator share: after a
    release the pool's ceiling stays at its count (its minReplicas replica Pending is the probe)
    past the block, and lifts when a replica comes up."""
    lost = PoolLoad(load=None, replicas=1, ready=0, starting=1)
    state = PolicyState()
    ceilings = []
    for now in range(0, 120, 2):
        state, stuck, ceiling = fleet_pending(state, lost, float(now), CONFIG)
        ceilings.append((stuck, ceiling))
    released = ceilings.index((1, 1))  # the first timeout
    assert released <= 11
    # The block of pending_ceiling ends 20 s after each release; the pool still may not grow.
    assert ceilings[released:] == [(1, 1)] * len(ceilings[released:])
    up = PoolLoad(load=None, replicas=1, ready=1)
    state, stuck, _ = fleet_pending(state, up, 120.0, CONFIG)
    assert (state.released_at, stuck) == (None, 0)
    state, stuck, ceiling = fleet_pending(state, up, 160.0, CONFIG)  # the last release's block is over
    assert (stuck, ceiling) == (0, None)


def test_a_pool_on_probation_with_nothing_pending_may_probe_one_replica() -> None:
    """Half the nodes left: after the release the pool has only ready replicas, so one more may be
    asked (the probe); while that one is Pending the pool may not grow further."""
    state = PolicyState()
    for now in range(0, 22, 2):  # 6 requested, 3 ready, stuck at the timeout (20 s)
        state, stuck, ceiling = fleet_pending(state, PoolLoad(None, 6, 3, starting=3), float(now), CONFIG)
    assert (stuck, ceiling) == (3, 3)
    state, stuck, ceiling = fleet_pending(state, PoolLoad(None, 3, 3), 30.0, CONFIG)  # cut to 3: blocked
    assert (stuck, ceiling) == (0, 3)
    state, stuck, ceiling = fleet_pending(state, PoolLoad(None, 3, 3), 60.0, CONFIG)  # block over
    assert (stuck, ceiling) == (0, 4)
    state, stuck, ceiling = fleet_pending(state, PoolLoad(None, 4, 3, starting=1), 62.0, CONFIG)
    assert (stuck, ceiling) == (1, 4)  # the probe is not supply, and nothing more is ordered
    state, stuck, ceiling = fleet_pending(state, PoolLoad(None, 4, 4), 64.0, CONFIG)  # it came up
    assert (state.released_at, stuck, ceiling) == (None, 0, None)  # (the block ended at 40 s)


def test_the_fleet_does_not_move_back_to_the_lost_pool_after_the_block() -> None:
    """The test bed's intermittent (1, 7) → (5, 0): once the block after the release ended, a fill
    (the backlog below its band) grew the cheaper lost pool, counting its new Pending replicas as
    supply, and the window then let the replacing pool go."""
    signals = TrainerSignals(step_rate=None, idle_share=0.0, buffered=0.0, in_flight=600.0, busy_step_s=256.0)
    config = ObjectiveConfig(step_size=1024, concurrency=1024, sessions_per_capacity=16)
    memory = ObjectiveMemory(rates={"b200": 1.0, "h200": 0.5625}, busy_step_s=256.0)
    state = PolicyState()
    for now in range(0, 30, 2):  # b200's one replica (its minimum) Pending since its nodes went
        state, stuck, ceiling = fleet_pending(state, PoolLoad(None, 1, 0, starting=1), float(now), CONFIG)
    targets = []
    for now in range(30, 120, 2):
        state, stuck, ceiling = fleet_pending(state, PoolLoad(None, 1, 0, starting=1), float(now), CONFIG)
        pools = [
            FleetPool("b200", 1, 0, 3.2, 4, 6.0, 1, 8, stuck=stuck, ceiling=ceiling),
            FleetPool("h200", 7, 7, 1.8, 4, 3.5, 0, 8, throughput=7 * 0.5625, busy_share=1.0),
        ]
        targets.append(plan_fleet(pools, signals, config, memory).targets)
    assert all(t["b200"] == 1 for t in targets), targets
    assert targets[-1]["h200"] == 8  # the short supply goes to the pool that has nodes


def test_one_probe_per_pending_timeout() -> None:
    """A probe the plan stops wanting goes before it times out; the next may come only a pending
    timeout after the last one was seen Pending, not at the next poll."""
    state = PolicyState()
    for now in range(0, 22, 2):
        state, stuck, ceiling = fleet_pending(state, PoolLoad(None, 6, 3, starting=3), float(now), CONFIG)
    assert stuck == 3  # released at 20 s
    state, _, ceiling = fleet_pending(state, PoolLoad(None, 3, 3), 42.0, CONFIG)  # block over
    assert ceiling == 4  # the first probe may go (the release was seen 22 s ago)
    state, _, ceiling = fleet_pending(state, PoolLoad(None, 4, 3, starting=1), 44.0, CONFIG)
    assert ceiling == 4
    state, _, ceiling = fleet_pending(state, PoolLoad(None, 3, 3), 46.0, CONFIG)  # the plan cut it
    assert ceiling == 3  # not straight back
    state, _, ceiling = fleet_pending(state, PoolLoad(None, 3, 3), 64.0, CONFIG)
    assert ceiling == 4  # 20 s after the probe was seen Pending


def test_a_probe_that_stays_pending_waits_for_the_nodes_instead_of_being_released() -> None:
    """The probe of a pool on probation is kept however long the cluster says it cannot start (a
    Pending pod with no node costs nothing): releasing it and probing again a timeout later made a
    reversal per timeout while the nodes stayed gone; kept, it starts as soon as they are back."""
    state = PolicyState()
    for now in range(0, 22, 2):
        state, stuck, ceiling = fleet_pending(state, PoolLoad(None, 6, 3, starting=3), float(now), CONFIG)
    state, stuck, ceiling = fleet_pending(state, PoolLoad(None, 3, 3), 60.0, CONFIG)
    assert ceiling == 4  # the probe may go
    for now in range(62, 200, 2):  # Pending, unschedulable by the cluster's word, for 138 s
        pending = PoolLoad(None, 4, 3, starting=1, stuck=1)
        state, stuck, ceiling = fleet_pending(state, pending, float(now), CONFIG)
        assert (stuck, ceiling) == (1, 4), now  # not supply, not released, nothing more ordered
        view = FleetPool("b200", 4, 3, 3.2, 4, 6.0, 1, 8, stuck=stuck, ceiling=ceiling)
        assert view.probing and view.low == 4
    state, stuck, ceiling = fleet_pending(state, PoolLoad(None, 4, 4), 200.0, CONFIG)  # nodes back
    assert (state.released_at, stuck, ceiling) == (None, 0, None)  # probation over: it may regrow
