"""``status.recommendedConcurrency`` written by the running operator, read back through the API server.

Real: the control plane (the RLRun's status subresource and its CRD schema), the operator as its own
process with the built-in loop (kopf, the chart's RBAC), a real Prometheus.  Stand-in: the run's
series, from the capacity-loss test's exporter (one loopback exporter plays the buffer, the router
and every engine pod: each Running b200 pod delivers 1 trajectory/s with its slots busy; the trainer
computes 1,024 trajectories per 256 s, so the demand is 3.8 trajectories/s).

The rollout runs 4 workers × 4 sessions = 16: that keeps 16 / targetPerReplica 16 = 1.0 unit of
capacity busy, less than the one b200 replica (3.2) the pool's minimum holds, so ``objective:
trainer`` finds the concurrency short and reports what the demand needs (the objective's
``recommended_concurrency``): 3.8 trajectories/s ÷ 1.0 per replica × 3.2 capacity × 16 sessions per
unit = 194.56 → 195 sessions.  What is checked: it is written; it is not rewritten while nothing
changes (polls every 2 s); it is rewritten when the configured concurrency changes; it is cleared
when a fill finds the concurrency enough.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from mixrl.devcluster.cluster import free_port

from .conftest import Bed, OperatorProcess, wait_for
from .test_autoscaling import builtin_run, scraped
from .test_autoscaling_capacity_loss import BUSY_S, CAPACITY, CHEAP, RATE, RunExporter

DEMAND = 1024 / BUSY_S * (1 - 0.05)  # the default trainerIdleTarget
EXPECTED = math.ceil(DEMAND / RATE[CHEAP] * CAPACITY[CHEAP] * 16)  # 195
POLL_S = 2


def test_the_operator_writes_the_recommended_concurrency_only_when_it_changes(
    cluster: Bed, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    prom_port = free_port()
    # One pool: with a second one asleep, the figure would rest on that pool's estimated rate.
    run = builtin_run(
        namespace, [CHEAP], prom_port, objective="trainer", targetPerReplica=16, pollIntervalSeconds=POLL_S
    )
    (b200,) = run["spec"]["samplerPools"]
    b200.update(minReplicas=1, maxReplicas=8)
    run["spec"]["rollout"].update(concurrency=4, workers=4)
    name = run["metadata"]["name"]
    exporter = RunExporter(cluster, namespace, name)

    def recommendation() -> dict[str, Any] | None:
        return (cluster.get(f"rlrun/{name}", "-n", namespace).get("status") or {}).get(
            "recommendedConcurrency"
        )

    def replicas() -> int:
        return int(cluster.get(f"sp/{name}-{CHEAP}", "-n", namespace)["spec"]["replicas"])

    def set_concurrency(sessions_per_worker: int) -> None:
        patch = {"spec": {"rollout": {"concurrency": sessions_per_worker}}}
        cluster.kubectl("patch", f"rlrun/{name}", "-n", namespace, "--type=merge", "-p", json.dumps(patch))

    def explained(*args: Any, **kwargs: Any) -> Any:
        try:
            return wait_for(*args, **kwargs)
        except AssertionError as exc:
            decisions = cluster.get(f"sp/{name}-{CHEAP}", "-n", namespace)["status"].get("lastScaleDecisions")
            log = [line for line in operator.log_tail(3000).splitlines() if "Handler" not in line]
            raise AssertionError(
                f"{exc}\nrecommendation: {recommendation()}\nreplicas: {replicas()}\ndecisions: {decisions}"
                "\noperator log:\n" + "\n".join(log[-40:])
            ) from None

    with scraped(exporter, tmp_path, prom_port):
        cluster.apply(run)
        # 1. Written, through the operator's status patch, as the API server stores it.  The rate
        # estimate is smoothed from poll to poll, so the figure may be rewritten while it settles.
        explained(
            lambda: (
                (r := recommendation()) is not None
                and r.get("configured") == 16
                and abs(r["sessions"] - EXPECTED) <= 0.1 * EXPECTED
            ),
            # The smoothed rate settles over minutes on a loaded bed: 154 s in one CI run of stop
            # 41, and at 180 s one was still 10 % short (175 of 195 sessions).
            timeout=300,
            what=f"status.recommendedConcurrency ≈ {EXPECTED} sessions for 16 configured",
        )
        time.sleep(5 * POLL_S)  # the estimate settles
        first = recommendation()
        assert first is not None and abs(first["sessions"] - EXPECTED) <= 0.1 * EXPECTED, first
        assert set(first) == {"sessions", "configured", "time", "message"}
        assert "rollout concurrency 16 keeps only 1 capacity busy" in first["message"], first["message"]
        assert replicas() == 1  # the fill stops at what the concurrency keeps busy

        # 2. Not rewritten while nothing changes: ten polls later the object is the one written
        # (its time would move with any rewrite: it is the poll's time, polls 2 s apart).
        seen = set()
        deadline = time.monotonic() + 10 * POLL_S
        while time.monotonic() < deadline:
            current = recommendation()
            seen.add(
                None if current is None else (current["sessions"], current["configured"], current["time"])
            )
            time.sleep(0.5)
        assert seen == {(first["sessions"], first["configured"], first["time"])}, sorted(map(str, seen))

        # 3. The configured concurrency changes (4 workers × 8 = 32, still short of one replica's
        # 3.2 units): rewritten, the sessions figure the same within the tolerance.
        set_concurrency(8)
        second = explained(
            lambda: (r := recommendation()) is not None and r.get("configured") == 32 and r,
            timeout=60,
            what="the recommendation rewritten for 32 configured sessions",
        )
        assert second["time"] >= first["time"]
        assert abs(second["sessions"] - first["sessions"]) <= 0.1 * first["sessions"], (first, second)

        # 4. Enough concurrency (4 × 64 = 256 sessions keep 16 units busy, the demand needs 12.2):
        # the fill sizes the fleet and the recommendation is cleared.
        set_concurrency(64)
        explained(lambda: recommendation() is None, timeout=60, what="the recommendation cleared")
        explained(
            replicas,
            equals=4,
            timeout=60,
            what="the fleet sized to the trainer once the concurrency allows",
        )
