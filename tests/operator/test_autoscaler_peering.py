"""The built-in autoscaler follows kopf's peering: while another operator is active, it does not scale.

The rule (pure) is checked against kopf's own: a live peer with a higher priority, or a second live
peer with the same one.  Then through the running operator against the API stand-in: a
higher-priority peer appears in the ClusterKopfPeering object, kopf pauses its handlers, and the
loop — a task of the same process, which kopf does not pause — stops visiting pools too; it resumes
when the peer goes.  Prometheus is a closed loopback port (the loop's visits are what we count).
"""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from mixrl.operator.autoscaling.loop import LoopSettings
from mixrl.operator.controller.peering import paused_by_peers

from .emulator import ApiServer
from .support import (
    NAMESPACE,
    PEERING,
    SAMPLERPOOLS,
    assert_covered,
    conditions,
    create,
    eventually,
    operator_calls,
    patch,
    small_run,
)

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
PEERING_PATH = f"/apis/kopf.dev/v1/clusterkopfpeerings/{PEERING}"


def peer(priority: int, seconds_ago: float = 0.0, lifetime: int = 60) -> dict[str, Any]:
    seen = NOW - timedelta(seconds=seconds_ago)
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen.isoformat()}


@pytest.mark.parametrize(
    ("status", "paused"),
    [
        ({}, False),  # nobody yet (or only optional peering)
        ({"me": peer(0)}, False),  # ourselves alone
        ({"me": peer(0), "dev": peer(666)}, True),  # `mixrl operator --dev` took over
        ({"me": peer(0), "dev": peer(666, seconds_ago=61)}, False),  # ... and died a while ago
        ({"me": peer(0), "twin": peer(0)}, True),  # same priority: kopf pauses both
        ({"me": peer(10), "old": peer(5)}, False),  # a lower priority is paused, not us
        ({"me": peer(0), "junk": "not a peer", "bad": {"priority": 9}}, False),  # not kopf's entries
    ],
)
def test_paused_by_peers_follows_kopfs_rule(status: dict[str, Any], paused: bool) -> None:
    assert paused_by_peers(status, 10 if "old" in status else 0, NOW) is paused


def loop_visits(api: ApiServer, since: int) -> int:
    """GETs of the pool the loop sends before each decision (the reconcilers are paused with kopf)."""
    path = f"/apis/mixrl.dev/v1alpha1/namespaces/{NAMESPACE}/samplerpools/demo-b200"
    return sum(
        1
        for r in list(api)[since:]
        if r.method.value == "GET"
        and r.url.path == path
        and r.headers.get("User-Agent", "").startswith("mixrl-operator/")
    )


async def test_the_loop_pauses_while_a_higher_priority_operator_is_active(
    api: ApiServer, operator: Any
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        nothing_listens = f"http://127.0.0.1:{sock.getsockname()[1]}"
    manifest = small_run("demo")
    manifest["spec"]["autoscaling"] = {"prometheusUrl": nothing_listens, "pollIntervalSeconds": 0.1}
    async with operator(autoscaling=LoopSettings(tick_s=0.05, query_timeout_s=1.0)):
        await create(api, manifest)
        await eventually(
            lambda: "MetricsAvailable" in conditions(api.live(SAMPLERPOOLS, NAMESPACE, "demo-b200") or {}),
            what="the loop at work",
        )
        since = len(list(api))  # active: it keeps visiting (every 0.1 s; slower on a loaded machine)
        await eventually(lambda: loop_visits(api, since) >= 3, what="three visits of the active loop")

        seen = datetime.now(UTC).isoformat()
        await patch(
            api, PEERING_PATH, {"status": {"dev@laptop": {"priority": 666, "lifetime": 60, "lastseen": seen}}}
        )
        # A visit already under way may finish (late on a loaded machine); an active loop visits
        # every 0.1 s, so a quiet second within a few seconds means it paused.
        for _ in range(5):
            since = len(list(api))
            await asyncio.sleep(1.0)
            if loop_visits(api, since) == 0:
                break
        assert loop_visits(api, since) == 0, "paused with kopf"

        await patch(api, PEERING_PATH, {"status": {"dev@laptop": None}})
        since = len(list(api))
        await eventually(lambda: loop_visits(api, since) >= 3, what="the loop resumes")
    assert_covered(operator_calls(api), clusterwide=True)
