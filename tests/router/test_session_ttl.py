"""Session expiry through the real router (docs/router.md#assignment): a session is idle only
between its requests.

Real: the router (state, aiohttp proxy, monitoring round) over loopback, with a clock the test
moves.  Stand-in: ``FakeEngine`` (tests/fakes.py), holding the turn in flight until the test lets
it answer.
"""

from __future__ import annotations

import asyncio

from mixrl.rl.engine.protocol import REPLICA_HEADER
from mixrl.rl.router.server import RouterSettings

from .conftest import pools_config


class StandInClock:
    """Monotonic time the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_turn_longer_than_the_ttl_keeps_its_session_and_replica(engines, start_router) -> None:
    """Before, the idle clock was reset only when a request was routed: the monitoring round expired
    a session whose turn ran past --session-ttl, and its next turn was placed anew."""
    slow = await engines("slow", hold=asyncio.Event())
    other = await engines("other")
    clock = StandInClock()
    settings = RouterSettings(run="t", health_interval=3600.0, session_ttl=10.0)
    running = await start_router(pools_config({"p": (1.0, [slow, other])}), settings, clock=clock)
    state = running.router.state
    state.set_ready("p", other.url, False)  # so the session lands on "slow"
    turn = asyncio.create_task(running.generate("s"))
    await asyncio.wait_for(slow.arrived.wait(), 5)
    state.set_ready("p", other.url, True)
    clock.now = 100.0  # the turn runs ten TTLs
    await running.router.poll_once()
    assert "s" in state.sessions
    clock.now = 105.0
    slow.hold.set()
    assert (await turn).status == 200
    clock.now = 114.0  # idle since the turn ended at 105: 9 s
    await running.router.poll_once()
    response = await running.generate("s")
    assert response.headers[REPLICA_HEADER] == slow.url
    clock.now = 130.0
    await running.router.poll_once()
    assert "s" not in state.sessions
