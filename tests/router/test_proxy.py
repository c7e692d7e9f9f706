"""The router over real loopback HTTP, in front of stand-in engines (see conftest.py)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mixrl.rl.engine.protocol import (
    GPU_TYPE_HEADER,
    POOL_HEADER,
    PRECISION_HEADER,
    REPLICA_HEADER,
    SESSION_HEADER,
)
from mixrl.rl.router.server import RouterSettings
from mixrl.rl.router.shares import MIN_CAPACITY_SAMPLES

from .conftest import StandInResolver, pools_config


async def test_body_passes_through_and_answer_carries_pool_headers(engines, start_router) -> None:
    engine = await engines("e")
    running = await start_router(pools_config({"fp8": (1.0, [engine])}))
    raw = b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}, "model": null, "extra": [1.5]}'
    async with running.http.post(
        f"{running.url}/generate", data=raw, headers={"Content-Type": "application/json"}
    ) as response:
        assert response.status == 200
        answer = await response.json()
        assert response.headers[POOL_HEADER] == "fp8"
        assert response.headers[GPU_TYPE_HEADER] == "gpu-fp8"
        assert response.headers[PRECISION_HEADER] == "prec-fp8"
        assert response.headers[REPLICA_HEADER] == engine.url
    assert engine.generate_bodies == [raw]  # byte for byte, unknown fields included
    assert answer["meta_info"]["completion_tokens"] == 3


async def test_streamed_answers_pass_through_and_count_tokens(engines, start_router) -> None:
    engine = await engines("e")
    running = await start_router(pools_config({"p": (1.0, [engine])}))
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 5}, "stream": True}
    async with running.http.post(f"{running.url}/generate", json=body) as response:
        assert response.status == 200
        assert response.headers[POOL_HEADER] == "p"
        assert response.content_type == "text/event-stream"
        events = (await response.read()).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert [json.loads(e.removeprefix("data: "))["meta_info"]["completion_tokens"] for e in events[:-2]] == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert running.router.state.pools["p"].generated_tokens == 5


async def test_sessions_stick_to_pool_and_replica_and_split_by_capacity(engines, start_router) -> None:
    a = [await engines(f"a{i}") for i in range(2)]
    b = [await engines("b0")]
    running = await start_router(pools_config({"a": (1.5, a), "b": (1.0, b)}))
    first_replica: dict[str, str] = {}
    pools: Counter[str] = Counter()
    for turn in range(3):
        for i in range(40):
            response = await running.generate(f"s{i}")
            assert response.status == 200
            replica = response.headers[REPLICA_HEADER]
            if turn == 0:
                first_replica[f"s{i}"] = replica
                pools[response.headers[POOL_HEADER]] += 1
            assert replica == first_replica[f"s{i}"], "a session changed replica while it was alive"
    # target: a = 1.5 × 2 / (3 + 1) = 0.75 → exactly 30 of 40 with the deficit scheduler.
    assert pools == {"a": 30, "b": 10}
    # Inside pool a, new sessions were spread by load: 15 each.
    assert Counter(r for r in first_replica.values() if r != b[0].url) == {a[0].url: 15, a[1].url: 15}
    snapshot = await running.get_json("/pools")
    by_name = {pool["name"]: pool for pool in snapshot["pools"]}
    assert by_name["a"]["target_share"] == 0.75
    assert by_name["a"]["active_sessions"] == 30
    assert by_name["a"]["generated_tokens"] == 30 * 3 * 4


async def test_least_loaded_replica_gets_the_new_session(engines, start_router) -> None:
    busy = await engines("busy", hold=asyncio.Event())
    idle = await engines("idle")
    running = await start_router(pools_config({"p": (1.0, [busy, idle])}))
    running.router.state.set_replicas("p", [busy.url, idle.url])
    # Pin s0 to "busy" by making it the only ready replica for a moment.
    running.router.state.set_ready("p", idle.url, False)
    in_flight = [asyncio.create_task(running.generate("s0")) for _ in range(2)]
    await asyncio.wait_for(busy.arrived.wait(), 5)
    running.router.state.set_ready("p", idle.url, True)
    while running.router.state.replica("p", busy.url).in_flight < 2:
        await asyncio.sleep(0.01)
    response = await running.generate("s1")
    assert response.headers[REPLICA_HEADER] == idle.url
    busy.hold.set()
    assert [(await task).headers[REPLICA_HEADER] for task in in_flight] == [busy.url, busy.url]


async def test_killed_replica_gives_503_and_the_retried_turn_succeeds_elsewhere(
    engines, start_router
) -> None:
    doomed = await engines("doomed", hold=asyncio.Event())
    healthy = await engines("healthy")
    other_pool = await engines("other")
    running = await start_router(pools_config({"p": (1.0, [doomed, healthy]), "q": (0.001, [other_pool])}))
    running.router.state.set_ready("p", healthy.url, False)  # so the session lands on "doomed"
    first = await asyncio.gather(running.generate("sess"), _kill_when_arrived(doomed))
    # The replica died with the turn in flight: the router answers 503 and asks for a retry.
    response = first[0]
    assert response.status == 503
    error = json.loads(await response.read())
    assert error["retry"] is True and "retry the turn" in error["error"]
    state = running.router.state
    assert state.replica("p", doomed.url).ready is False
    assert state.pools["p"].replica_failures == 1
    # No ready replica left in p: the session moved to pool q.
    assert error["moved_to"] == {"pool": "q", "replica": other_pool.url}
    # Now "healthy" comes back; the retried turn keeps the session where it was moved.
    state.set_ready("p", healthy.url, True)
    retry = await running.generate("sess")
    assert retry.status == 200
    assert retry.headers[REPLICA_HEADER] == other_pool.url
    assert other_pool.sessions_seen == ["sess"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_replica_that_drops_mid_answer_is_marked_down(engines, start_router, stream: bool) -> None:
    """An answer cut short after its headers (the replica died mid-answer) is a replica failure
    like a refused connection: the replica is marked down and the session moves. A plain answer
    becomes the 503 the client retries; a stream already under way reaches the client cut (before,
    aiohttp answered 500 and the replica stayed ready for the next session)."""
    doomed = await engines("doomed")
    doomed.cut_after = 2
    survivor = await engines("survivor")
    running = await start_router(pools_config({"p": (1.0, [doomed, survivor])}))
    state = running.router.state
    state.set_ready("p", survivor.url, False)  # the session lands on "doomed"
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 5}, "stream": stream}
    async with running.http.post(
        f"{running.url}/generate", json=body, headers={SESSION_HEADER: "s"}
    ) as response:
        if stream:
            assert response.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()
        else:
            assert response.status == 503
            assert (await response.json())["retry"] is True
    assert state.replica("p", doomed.url).ready is False
    assert state.pools["p"].replica_failures == 1


async def test_killed_replica_session_moves_within_its_pool(engines, start_router) -> None:
    doomed = await engines("doomed")
    survivor = await engines("survivor")
    running = await start_router(pools_config({"p": (1.0, [doomed, survivor])}))
    sessions = [f"s{i}" for i in range(4)]
    placed = {sid: (await running.generate(sid)).headers[REPLICA_HEADER] for sid in sessions}
    assert set(placed.values()) == {doomed.url, survivor.url}
    await doomed.kill()  # between turns this time: the next connection is refused
    statuses = []
    for sid in sessions:
        response = await running.generate(sid)
        statuses.append(response.status)
        if response.status == 503:
            response = await running.generate(sid)  # the rollout's retry of the same turn
        assert response.status == 200
        assert response.headers[REPLICA_HEADER] == survivor.url
    # Only the first request to reach the dead replica fails; it is then marked down, and the other
    # sessions that were on it move before their next request is sent.
    on_doomed = [sid for sid in sessions if placed[sid] == doomed.url]
    assert statuses.count(503) == 1 and statuses[sessions.index(on_doomed[0])] == 503
    assert running.router.state.replica("p", doomed.url).ready is False
    # Each session's turns reached a live replica exactly once: 2 turns per session, 8 in all.
    assert Counter(survivor.sessions_seen) + Counter(doomed.sessions_seen) == dict.fromkeys(sessions, 2)


async def test_fan_out_reaches_every_ready_replica(engines, start_router) -> None:
    replicas = [await engines(f"e{i}") for i in range(3)]
    down = await engines("down", healthy=False)
    running = await start_router(pools_config({"a": (1.0, replicas[:2]), "b": (1.0, [replicas[2], down])}))
    body = {"model_path": "/weights/v7", "load_format": "auto", "weight_version": "7", "flush_cache": True}
    async with running.http.post(f"{running.url}/update_weights_from_disk", json=body) as response:
        assert response.status == 200
        answer = await response.json()
    assert answer["success"] is True
    assert sorted(r["replica"] for r in answer["results"]) == sorted(e.url for e in replicas)
    assert all(r["message"].endswith("loaded") for r in answer["results"])
    for engine in replicas:
        assert engine.update_bodies == [body]
    assert down.update_bodies == []  # not ready: it loads the latest version when it starts


async def test_fan_out_reports_a_failed_replica(engines, start_router) -> None:
    good, bad = await engines("good"), await engines("bad")
    running = await start_router(pools_config({"a": (1.0, [good, bad])}))
    await bad.kill()
    async with running.http.post(
        f"{running.url}/update_weights_from_disk", json={"model_path": "/w"}
    ) as response:
        assert response.status == 502
        answer = await response.json()
    results = {r["replica"]: r for r in answer["results"]}
    assert answer["success"] is False
    assert results[good.url]["success"] is True
    assert results[bad.url]["success"] is False and "unreachable" in results[bad.url]["message"]
    assert running.router.state.replica("a", bad.url).ready is False


async def test_metrics_exported_per_pool(engines, start_router) -> None:
    a, b = await engines("a"), await engines("b")
    running = await start_router(pools_config({"a": (3.0, [a]), "b": (1.0, [b])}, run="myrun"))
    for i in range(8):
        await running.generate(f"s{i}", max_new_tokens=5)
    await running.http.post(f"{running.url}/sessions/s0/end")
    async with running.http.get(f"{running.url}/metrics") as response:
        text = await response.text()
    samples = {
        (sample.name, sample.labels.get("pool"), sample.labels.get("le")): sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    a_labels = {"run": "myrun", "pool": "a", "gpu_type": "gpu-a", "precision": "prec-a"}
    assert samples[("mixrl_router_sessions_assigned_total", "a", None)].value == 6
    assert samples[("mixrl_router_sessions_assigned_total", "b", None)].value == 2
    assert samples[("mixrl_router_sessions", "a", None)].labels == a_labels
    assert (
        samples[("mixrl_router_sessions", "a", None)].value
        + samples[("mixrl_router_sessions", "b", None)].value
        == 7
    )
    assert samples[("mixrl_router_generated_tokens_total", "a", None)].value == 30
    assert samples[("mixrl_router_requests_in_flight", "a", None)].value == 0
    assert samples[("mixrl_router_queue_depth", "b", None)].value == 0
    assert samples[("mixrl_router_target_share", "a", None)].value == 0.75
    assert samples[("mixrl_router_replicas_ready", "b", None)].value == 1
    assert samples[("mixrl_router_request_latency_seconds_count", "a", None)].value == 6
    assert samples[("mixrl_router_request_latency_seconds_bucket", "b", "+Inf")].value == 2


async def test_queue_depth_counts_requests_held_above_the_inflight_limit(engines, start_router) -> None:
    engine = await engines("e", hold=asyncio.Event())
    config = pools_config({"p": (1.0, [engine])})
    running = await start_router(
        config, RouterSettings(run="t", health_interval=3600, max_inflight_per_replica=2)
    )
    tasks = [asyncio.create_task(running.generate(f"s{i}")) for i in range(5)]
    replica = running.router.state.replica("p", engine.url)
    # The router counts a request in flight before it reaches the engine: wait for both.
    while replica.in_flight + replica.waiting < 5 or len(engine.generate_bodies) < 2:
        await asyncio.sleep(0.01)
    assert (replica.in_flight, replica.waiting) == (2, 3)
    assert len(engine.generate_bodies) == 2
    snapshot = await running.get_json("/pools")
    assert snapshot["pools"][0]["queue_depth"] == 3
    engine.hold.set()
    responses = await asyncio.gather(*tasks)
    assert [r.status for r in responses] == [200] * 5
    assert (replica.in_flight, replica.waiting) == (0, 0)


async def test_put_pools_changes_replicas_and_shares_follow(engines, start_router) -> None:
    a0, b0 = await engines("a0"), await engines("b0")
    running = await start_router(pools_config({"a": (1.0, [a0]), "b": (1.0, [b0])}))
    new = [await engines(f"a{i}") for i in (1, 2)]
    async with running.http.put(
        f"{running.url}/pools/a", json={"replicas": [a0.url, *(e.url for e in new)], "capacity": 2.0}
    ) as response:
        assert response.status == 200
        pool = await response.json()
    assert pool["ready_replicas"] == 3  # new replicas were probed before answering
    assert pool["target_share"] == 6 / 7
    listed = {p["name"]: p for p in (await running.get_json("/pools"))["pools"]}
    assert pool.keys() == listed["a"].keys()  # the pool's /pools entry, its Service included
    counts: Counter[str] = Counter()
    for i in range(700):
        counts[(await running.generate(f"s{i}")).headers[POOL_HEADER]] += 1
    assert counts == {"a": 600, "b": 100}


async def test_put_pools_rejects_bad_input_naming_the_field(engines, start_router) -> None:
    engine = await engines("e")
    running = await start_router(pools_config({"a": (1.0, [engine])}))
    cases = [
        ("a", {"replicas": "http://x:1"}, 400, "replicas: expected a list"),
        ("a", {"replicas": ["ftp://x"]}, 400, "replicas: replica 'ftp://x' is not"),
        ("a", {"replicas": [], "capacity": -1}, 400, "capacity: expected a number in (0, 1e+06]"),
        ("a", {"replicas": [], "capacity": True}, 400, "capacity: expected a number in (0, 1e+06]"),
        # JSON's NaN and Infinity decode to floats: a NaN share would stop every new session
        ("a", {"replicas": [], "capacity": float("nan")}, 400, "capacity: expected a number in (0, 1e+06]"),
        ("a", {"replicas": [], "capacity": float("inf")}, 400, "capacity: expected a number in (0, 1e+06]"),
        ("a", {"replicas": [], "capacity": 1e300}, 400, "capacity: expected a number in (0, 1e+06]"),
        ("a", {"replicas": [], "capacity": 10**400}, 400, "capacity: expected a number in (0, 1e+06]"),
        ("zzz", {"replicas": []}, 404, "pool: no pool named 'zzz'"),
    ]
    for pool, body, status, message in cases:
        async with running.http.put(f"{running.url}/pools/{pool}", json=body) as response:
            assert response.status == status
            assert (await response.json())["error"].startswith(message)
    assert list(running.router.state.pools["a"].replicas) == [engine.url]  # nothing changed
    assert running.router.state.pools["a"].capacity == 1.0
    assert running.router.state.scheduler.shares == {"a": 1.0}


async def test_health_probes_follow_replica_health(engines, start_router) -> None:
    flaky = await engines("flaky")
    steady = await engines("steady")
    running = await start_router(pools_config({"a": (1.0, [flaky]), "b": (1.0, [steady])}))
    assert running.router.state.scheduler.shares == {"a": 0.5, "b": 0.5}
    flaky.healthy = False
    await running.router.poll_once()
    assert running.router.state.scheduler.shares == {"a": 0.0, "b": 1.0}
    assert {(await running.generate(f"s{i}")).headers[POOL_HEADER] for i in range(5)} == {"b"}
    flaky.healthy = True
    await running.router.poll_once()
    assert running.router.state.scheduler.shares == {"a": 0.5, "b": 0.5}


async def test_no_ready_replica_answers_503_retry(engines, start_router) -> None:
    engine = await engines("e", healthy=False)
    running = await start_router(pools_config({"a": (1.0, [engine])}))
    response = await running.generate("s")
    assert response.status == 503
    assert json.loads(await response.read())["retry"] is True
    assert engine.generate_bodies == []


async def test_measured_capacity_comes_from_engine_gen_throughput(engines, start_router) -> None:
    fast = await engines("fast", gen_throughput=300.0)
    slow = await engines("slow", gen_throughput=100.0)
    running = await start_router(pools_config({"fast": (None, [fast]), "slow": (None, [slow])}))
    assert running.router.state.scheduler.shares == {"fast": 0.75, "slow": 0.25}
    snapshot = await running.get_json("/pools")
    # Nothing declared: capacities relative to the pools' mean throughput (200 tokens/s = 1.0).
    assert [p["capacity_per_replica"] for p in snapshot["pools"]] == [1.5, 0.5]
    assert [p["capacity_measured"] for p in snapshot["pools"]] == [1.5, 0.5]


async def test_a_full_pool_measured_far_below_its_declared_capacity_loses_its_extra_share(
    engines, start_router
) -> None:
    """Issue #30: a pool really delivering a third of its declared capacity got most sessions."""
    a, b, slow = [await engines(name, gen_throughput=100.0) for name in ("a", "b", "slow")]
    for engine in (a, b, slow):
        engine.queued = 3  # full: what they deliver is what they can
    running = await start_router(pools_config({"a": (1.0, [a]), "b": (1.0, [b]), "slow": (3.0, [slow])}))
    state = running.router.state
    assert state.scheduler.shares == {"a": 0.2, "b": 0.2, "slow": 0.6}  # one sample: not trusted yet
    for _ in range(MIN_CAPACITY_SAMPLES):
        await running.router.poll_once()
    assert state.scheduler.shares == pytest.approx({"a": 1 / 3, "b": 1 / 3, "slow": 1 / 3})
    pools = {p["name"]: p for p in (await running.get_json("/pools"))["pools"]}
    assert pools["slow"]["capacity_source"] == "measured" and pools["slow"]["capacity_per_replica"] == 1.0
    assert pools["a"]["capacity_source"] == "configured"
    metrics = await (await running.http.get(f"{running.url}/metrics")).text()
    assert (
        'mixrl_router_capacity_measured{gpu_type="gpu-slow",pool="slow",precision="prec-slow",run="test"} 1.0'
        in metrics
    )


async def test_dns_discovery_with_stand_in_resolver(engines, start_router) -> None:
    e1, e2 = await engines("e1"), await engines("e2")
    port = int(e1.url.rsplit(":", 1)[1])
    resolver = StandInResolver()
    config = pools_config({"a": (1.0, [])}).model_copy()
    config = type(config)(run="r", pools=(config.pools[0].model_copy(update={"service": "r-a.ns.svc"}),))
    resolver.records["r-a.ns.svc"] = ["127.0.0.1"]
    settings = RouterSettings(run="r", health_interval=3600, discover_dns=True, engine_port=port)
    running = await start_router(config, settings, resolver=resolver)
    state = running.router.state
    assert list(state.pools["a"].replicas) == [e1.url] and state.pools["a"].replicas[e1.url].ready
    assert resolver.lookups == [("r-a.ns.svc", port)]
    # The Service loses its endpoint (NXDOMAIN -> no addresses): the replica goes away.
    resolver.records["r-a.ns.svc"] = []
    await running.router.poll_once()
    assert state.pools["a"].replicas == {}
    # A temporary DNS failure keeps what we had.
    resolver.records["r-a.ns.svc"] = ["127.0.0.1"]
    await running.router.poll_once()
    del resolver.records["r-a.ns.svc"]
    await running.router.poll_once()
    assert list(state.pools["a"].replicas) == [e1.url]
    assert e2.generate_bodies == []


async def _kill_when_arrived(engine) -> None:  # type: ignore[no-untyped-def]
    await asyncio.wait_for(engine.arrived.wait(), 5)
    await engine.kill()


async def test_a_pool_that_loses_half_its_replicas_hands_sessions_to_the_others(
    engines, start_router
) -> None:
    """Two of pool a's four engines fail their probe: a holds half the sessions on a third of the
    ready capacity, so the sessions that lost their replica go to b at their next turn (not to a's
    last two replicas), until a is back near its share; then nothing moves, also when they return."""
    a = [await engines(f"a{i}") for i in range(4)]
    b = [await engines(f"b{i}") for i in range(4)]
    running = await start_router(pools_config({"a": (1.0, a), "b": (1.0, b)}))
    first = {}
    for i in range(80):
        response = await running.generate(f"s{i}")
        first[f"s{i}"] = (response.headers[POOL_HEADER], response.headers[REPLICA_HEADER])
    assert Counter(pool for pool, _ in first.values()) == {"a": 40, "b": 40}
    for engine in a[:2]:
        engine.healthy = False
    await running.router.poll_once()
    lost = {a[0].url, a[1].url}
    after = {}
    for sid in first:
        response = await running.generate(sid)
        assert response.status == 200
        after[sid] = (response.headers[POOL_HEADER], response.headers[REPLICA_HEADER])
    moved = {sid for sid in first if first[sid][0] == "a" and after[sid][0] == "b"}
    held = sum(1 for pool, _ in after.values() if pool == "a")
    fair = 80 / 3
    assert fair <= held <= 1.1 * fair + 1 and len(moved) == 40 - held
    assert {first[sid][1] for sid in moved} <= lost  # only sessions whose replica was gone
    kept = [sid for sid in first if first[sid][0] == "a" and first[sid][1] not in lost]
    assert all(after[sid] == first[sid] for sid in kept)  # the others kept replica and cache
    for engine in a[:2]:
        engine.healthy = True
    await running.router.poll_once()
    for sid in first:
        response = await running.generate(sid)
        assert response.headers[POOL_HEADER] == after[sid][0]  # settled: no move back
    snapshot = {p["name"]: p for p in (await running.get_json("/pools"))["pools"]}
    assert snapshot["a"]["sessions_rebalanced_out"] == len(moved) and not snapshot["a"]["draining"]
    async with running.http.get(f"{running.url}/metrics") as response:
        text = await response.text()
    moved_metric = {
        s.labels["pool"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "mixrl_router_sessions_moved_total"
    }
    assert moved_metric == {"a": len(moved), "b": 0}
