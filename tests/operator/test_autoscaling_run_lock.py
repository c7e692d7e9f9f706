"""The built-in autoscaler writes a run's status (recommendedConcurrency) under the run's lock,
the one its reconciler and live status loop write the whole status under."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from mixrl.api.kube_types import Obj
from mixrl.operator.autoscaling.loop import AutoscalingLoop
from mixrl.operator.kube.rbac import ApiResource

from .support import NAMESPACE


class Client:
    def __init__(self) -> None:
        self.patches: list[tuple[str, str, Obj]] = []

    async def merge_patch(
        self, r: ApiResource, ns: str, name: str, body: Obj, subresource: Any = None
    ) -> Obj:
        self.patches.append((r.kind, name, body))
        return body


async def test_the_recommended_concurrency_waits_for_the_runs_lock() -> None:
    client = Client()
    locks: dict[tuple[str, str], asyncio.Lock] = {}
    loop = AutoscalingLoop(
        client,  # type: ignore[arg-type]
        run_lock=lambda namespace, name: locks.setdefault((namespace, name), asyncio.Lock()),
    )
    key = (NAMESPACE, "demo")
    loop.runs[key] = {
        "metadata": {"name": "demo", "namespace": NAMESPACE},
        "status": {"recommendedConcurrency": {"sessions": 512, "configured": 256}},
    }
    plan = SimpleNamespace(recommended_concurrency=None, filled=True, summary="enough")  # clears it
    objective = SimpleNamespace(concurrency=256)
    async with locks.setdefault(key, asyncio.Lock()):  # a reconcile of the run is writing
        write = asyncio.create_task(loop.report_concurrency(key, plan, objective, 0.0, 0.1))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert client.patches == []
    await write
    assert client.patches == [("RLRun", "demo", {"status": {"recommendedConcurrency": None}})]
