"""Session binding, replica choice and moves in RouterState (pure, no I/O)."""

from __future__ import annotations

import math

import pytest

from mixrl.rl.router.config import PoolConfig
from mixrl.rl.router.state import NoReadyReplica, RouterState


def state_with(pools: dict[str, int], ttl: float = 100.0, ready: bool = True) -> RouterState:
    configs = [
        PoolConfig(name=name, capacity=1.0, replicas=tuple(f"http://{name}{i}:1" for i in range(n)))
        for name, n in pools.items()
    ]
    state = RouterState(configs, session_ttl=ttl)
    for config in configs:
        for url in config.replicas:
            state.set_ready(config.name, url, ready)
    return state


def test_a_session_stays_on_its_pool_and_replica() -> None:
    state = state_with({"a": 2, "b": 2})
    first = state.route("s", now=0.0)
    for t in range(1, 50):
        state.route(f"other{t}", now=float(t))  # other sessions come and go
        again = state.route("s", now=float(t))
        assert (again.pool, again.replica, again.moved) == (first.pool, first.replica, False)


def test_new_sessions_go_to_the_least_loaded_replica() -> None:
    state = state_with({"a": 3})
    busy, idle, fresh = "http://a0:1", "http://a1:1", "http://a2:1"
    for _ in range(3):
        state.begin("a", busy)
    state.begin("a", idle)
    # fresh: 0 in flight; idle: 1; busy: 3.
    assert state.route("s1", now=0).replica == fresh
    state.begin("a", fresh)
    state.begin("a", fresh)
    assert state.route("s2", now=0).replica == idle
    # Equal in-flight counts: fewer bound sessions wins (s1 is on fresh, s2 on idle).
    state.finish("a", busy)
    state.finish("a", busy)
    state.finish("a", fresh)
    assert {r.url: r.in_flight for r in state.pools["a"].replicas.values()} == {busy: 1, idle: 1, fresh: 1}
    state.route("s3", now=0)
    sessions = {r.url: r.sessions for r in state.pools["a"].replicas.values()}
    assert sessions == {busy: 1, idle: 1, fresh: 1}


def test_a_down_replica_moves_its_sessions_within_the_pool() -> None:
    state = state_with({"a": 2, "b": 1})
    sessions = [f"s{i}" for i in range(12)]
    routes = {sid: state.route(sid, now=0) for sid in sessions}
    victim = next(r for r in routes.values() if r.pool == "a").replica
    survivor = next(url for url in state.pools["a"].replicas if url != victim)
    state.mark_down("a", victim)
    for sid, before in routes.items():
        after = state.route(sid, now=1)
        assert after.pool == before.pool
        if before.replica == victim:
            assert (after.replica, after.moved) == (survivor, True)
        else:
            assert (after.replica, after.moved) == (before.replica, False)
    assert state.pools["a"].replicas[victim].sessions == 0
    assert state.pools["a"].replica_failures == 1


def test_a_pool_without_ready_replicas_hands_its_sessions_to_other_pools() -> None:
    state = state_with({"a": 1, "b": 1, "c": 1})
    on_a = [sid for sid in (f"s{i}" for i in range(30)) if state.route(sid, now=0).pool == "a"]
    assert len(on_a) == 10
    state.set_ready("a", "http://a0:1", False)
    moved = [state.route(sid, now=1) for sid in on_a]
    assert all(route.moved and route.pool in ("b", "c") for route in moved)
    assert state.pools["a"].sessions_moved_out == 10
    # The new pool is kept afterwards, even when "a" comes back.
    state.set_ready("a", "http://a0:1", True)
    assert [state.route(sid, now=2).pool for sid in on_a] == [route.pool for route in moved]


def test_no_ready_replica_anywhere_raises() -> None:
    state = state_with({"a": 1}, ready=False)
    with pytest.raises(NoReadyReplica):
        state.route("s", now=0)
    assert state.sessions == {}


def test_removed_replica_unbinds_sessions_and_new_replicas_wait_for_a_probe() -> None:
    state = state_with({"a": 2})
    route = state.route("s", now=0)
    other = next(url for url in state.pools["a"].replicas if url != route.replica)
    added = state.set_replicas("a", [other, "http://a9:1"])
    assert added == ["http://a9:1"]
    assert state.pools["a"].replicas["http://a9:1"].ready is False
    again = state.route("s", now=1)
    assert (again.replica, again.moved) == (other, True)


def test_end_and_expiry_forget_sessions() -> None:
    state = state_with({"a": 1}, ttl=10.0)
    state.route("ended", now=0)
    state.route("idle", now=0)
    state.route("active", now=0)
    assert state.end_session("ended") is True
    assert state.end_session("ended") is False
    state.route("active", now=8)
    assert state.expire_sessions(now=12) == ["idle"]
    assert set(state.sessions) == {"active"}
    assert state.pools["a"].replicas["http://a0:1"].sessions == 1
    assert state.active_sessions() == {"a": 1}


def test_a_session_with_a_request_in_flight_never_expires_and_idles_from_its_end() -> None:
    """Before, only routing reset the idle clock: a turn running longer than the TTL had its
    session expired under it, and the next turn lost its replica (and its prefix cache)."""
    state = state_with({"a": 2}, ttl=10.0)
    route = state.route("long", now=0)
    held = state.hold("long")
    assert state.expire_sessions(now=50) == []  # 50 s into one turn: busy, not idle
    state.release(held, now=60)  # the turn ends: idle from here
    assert state.expire_sessions(now=69) == []
    assert state.route("long", now=69).replica == route.replica  # the next turn keeps its replica
    state.release(state.hold("long"), now=70)
    assert state.expire_sessions(now=81) == ["long"]
    # A release reaches the session it held, not a new one of the same name.
    state.route("renamed", now=100)
    old = state.hold("renamed")
    state.end_session("renamed")
    state.route("renamed", now=101)
    state.hold("renamed")
    state.release(old, now=102)
    assert state.sessions["renamed"].in_flight == 1
    assert state.expire_sessions(now=200) == []
    assert state.hold(None) is None  # requests without a session hold nothing


def test_snapshot_reports_shares_and_load() -> None:
    state = state_with({"a": 1, "b": 3})
    for i in range(8):
        state.route(f"s{i}", now=0)
    state.begin("b", "http://b0:1")
    snapshot = {pool["name"]: pool for pool in state.snapshot()["pools"]}  # type: ignore[union-attr]
    assert snapshot["a"]["target_share"] == pytest.approx(0.25)
    assert snapshot["b"]["target_share"] == pytest.approx(0.75)
    assert (snapshot["a"]["sessions_assigned"], snapshot["b"]["sessions_assigned"]) == (2, 6)
    assert snapshot["b"]["in_flight"] == 1
    assert snapshot["a"]["active_session_share"] == pytest.approx(0.25)


def test_cost_accrues_for_every_known_replica_at_its_pools_price_and_is_exported() -> None:
    from prometheus_client import generate_latest

    from mixrl.rl.router.exporter import make_registry

    pools = [
        PoolConfig(
            name="h100", replicas=("http://a:1", "http://b:1"), gpus_per_replica=1, price_per_gpu_hour=2.5
        ),
        PoolConfig(name="b200", replicas=("http://c:1",), gpus_per_replica=8, price_per_gpu_hour=6.0),
    ]
    state = RouterState(pools)
    state.accrue_cost(1800)  # half an hour; a replica not yet ready costs all the same (its node runs)
    assert state.pools["h100"].cost_dollars == 2.5 and state.pools["b200"].cost_dollars == 24.0
    text = generate_latest(make_registry(state, "r")[0]).decode()
    assert 'mixrl_cost_dollars_total{gpu_type="",pool="b200",precision="",run="r"} 24.0' in text


def spread(state: RouterState, n: int) -> list[str]:
    sessions = [f"s{i}" for i in range(n)]
    for sid in sessions:
        state.route(sid, now=0)
    return sessions


def test_a_pool_that_lost_half_its_capacity_sheds_sessions_from_lost_replicas_first() -> None:
    state = state_with({"a": 4, "b": 4})
    sessions = spread(state, 80)
    assert state.active_sessions() == {"a": 40, "b": 40}
    lost = ["http://a0:1", "http://a1:1"]
    for url in lost:
        state.mark_down("a", url)
    before = {sid: (s.pool, s.replica) for sid, s in state.sessions.items()}
    moves = [(sid, state.route(sid, now=1)) for sid in sessions]
    fair = 80 / 3  # a's share is 2 of 6 replicas now
    held = state.active_sessions()["a"]
    assert fair <= held <= 1.1 * fair + 1  # back near its share, not below it
    moved = [sid for sid, route in moves if route.pool == "b" and before[sid][0] == "a"]
    assert len(moved) == 40 - held
    assert all(before[sid][1] in lost for sid in moved)  # only sessions that had lost their replica
    assert state.pools["a"].sessions_rebalanced_out == len(moved)
    # Settled: more turns move nothing, and a's replicas coming back moves nothing back.
    assert all(not state.route(sid, now=2).moved for sid in sessions)
    for url in lost:
        state.set_ready("a", url, True)
    routes = [state.route(sid, now=3) for sid in sessions]
    assert state.active_sessions() == {"a": held, "b": 80 - held}
    assert not any(r.moved and r.pool != state.sessions[r.session].pool for r in routes)
    assert state.pools["b"].sessions_rebalanced_out == 0


def test_sessions_on_working_replicas_move_only_when_the_lost_ones_are_not_enough() -> None:
    state = state_with({"a": 8, "b": 9})
    sessions = spread(state, 170)
    assert state.active_sessions() == {"a": 80, "b": 90}
    # Lost one at a time: three losses stay within bounds (at most 1.32 × the share), so their
    # sessions move to a's other replicas, which end up holding more than a's share.
    for k in range(3):
        state.mark_down("a", f"http://a{k}:1")
        assert all(not state.route(sid, now=1).moved or state.sessions[sid].pool == "a" for sid in sessions)
    assert state.active_sessions()["a"] == 80 and not state.pools["a"].draining
    # The fourth: 80 sessions on 4 of 13 replicas (1.53 × the share).  The 16 that lost their
    # replica are not enough to get back to 1.1 × the share: a few with a working replica move too.
    state.mark_down("a", "http://a3:1")
    homeless = {sid for sid, s in state.sessions.items() if s.replica == "http://a3:1"}
    live = {sid for sid, s in state.sessions.items() if s.pool == "a"} - homeless
    fair = 170 * 4 / 13
    for sid in sessions:
        state.route(sid, now=2)
    assert {state.sessions[sid].pool for sid in homeless} == {"b"}
    live_moved = sum(1 for sid in live if state.sessions[sid].pool == "b")
    assert live_moved == len(live) - math.floor(1.1 * fair)  # exactly down to the stopping mark
    assert state.active_sessions()["a"] == math.floor(1.1 * fair)
    assert state.pools["a"].sessions_rebalanced_out == len(homeless) + live_moved
    assert not state.pools["a"].draining
    assert all(not state.route(sid, now=3).moved for sid in sessions)  # no swing back


def test_another_pool_growing_does_not_move_sessions_that_have_a_replica() -> None:
    state = state_with({"a": 2, "b": 2})
    state.set_ready("b", "http://b0:1", False)
    state.set_ready("b", "http://b1:1", False)
    sessions = spread(state, 40)  # all on a
    for url in ("http://b0:1", "http://b1:1"):
        state.set_ready("b", url, True)  # a holds 2 × its share now, but lost nothing
    assert all(state.route(sid, now=1).pool == "a" for sid in sessions)
    assert state.pools["a"].sessions_rebalanced_out == 0


def test_a_lower_capacity_is_no_loss_of_replicas() -> None:
    state = state_with({"a": 2, "b": 2})
    sessions = spread(state, 40)
    state.set_capacity("a", 0.25)  # a's share falls to 1/5: it holds 2.5 × that, but lost no replica
    assert all(not state.route(sid, now=1).moved for sid in sessions)
    state.mark_down("a", "http://a0:1")  # now it has lost one: its sessions leave, then some
    moved = [state.route(sid, now=2) for sid in sessions]
    assert state.pools["a"].sessions_rebalanced_out == sum(r.moved and r.pool == "b" for r in moved) > 0


def test_a_replica_that_leaves_and_returns_mid_request_keeps_an_exact_in_flight_count() -> None:
    """DNS discovery drops a pod that fails a readiness check and lists it again when it passes;
    its requests still in flight end after it is back.  They must be counted on it while they run
    and leave it at 0 when they end, not at -1 (a negative load would draw every new session)."""
    state = state_with({"a": 2})
    flapping, steady = "http://a0:1", "http://a1:1"
    state.begin("a", flapping)
    state.begin("a", flapping)
    state.set_replicas("a", [steady])
    assert state.set_replicas("a", [flapping, steady]) == [flapping]  # new again: probed first
    replica = state.replica("a", flapping)
    assert replica is not None and replica.ready is False
    assert replica.in_flight == 2  # still running there
    state.finish("a", flapping)
    state.finish("a", flapping)
    assert replica.in_flight == 0
    state.set_ready("a", flapping, True)
    state.begin("a", steady)
    assert state.route("new", now=0.0).replica == flapping  # 0 in flight against steady's 1
    # One of its requests ends while it is away: counted off the requests it will have when back.
    state.begin("a", steady)
    state.set_replicas("a", [flapping])
    state.finish("a", steady)
    state.set_replicas("a", [flapping, steady])
    assert state.replica("a", steady).in_flight == 1  # type: ignore[union-attr]
    assert sum(r["in_flight"] for r in state.snapshot()["pools"][0]["replicas"]) == 1  # type: ignore[index]
