"""Rule 8 on the real control plane: a cold start longer than the pending timeout is waited for;
replicas the scheduler cannot place are released at once, with its reason.

Real: the control plane, the scheduler, the operator as its own process under the chart's RBAC
(it lists the pool's pods and, for an unschedulable one, the events), a real Prometheus.  Played:
the cold start — the test bed's KWOK starts a pod that asks for the node label
``kwok.mixrl.dev/pod-start-delay`` that long after it is scheduled (mixrl.devcluster.stages), as a
node pulling an engine image and loading a model would; the engines (tests/cluster/test_autoscaling.py's
exporter: one loopback endpoint for every Running pod of the pool).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from mixrl.devcluster.cluster import free_port
from mixrl.devcluster.stages import START_DELAY_LABEL

from .conftest import Bed, OperatorProcess, wait_for
from .test_autoscaling import POOL, TARGET, PoolExporter, builtin_run, scraped

COLD_START_S = 15
PENDING_TIMEOUT_S = 6  # far below the cold start: the clock alone would release the new replicas
FULL = "mixrl.dev/test-full=yes:NoSchedule"


def test_a_cold_start_is_waited_for_and_unschedulable_replicas_are_released_with_the_reason(
    cluster: Bed, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    prom_port = free_port()
    run = builtin_run(namespace, [POOL], prom_port, pendingTimeoutSeconds=PENDING_TIMEOUT_S)
    pool_spec = run["spec"]["samplerPools"][0]
    pool_spec.update(minReplicas=1, maxReplicas=6, capacity=1.0)
    pool_spec.setdefault("scheduling", {})["nodeSelector"] = {START_DELAY_LABEL: f"{COLD_START_S}s"}
    name = f"{run['metadata']['name']}-{POOL}"
    nodes = cluster.gpu_nodes("H100")
    assert nodes, "the test bed has H100 nodes"
    exporter = PoolExporter(cluster, namespace, name)
    with scraped(exporter, tmp_path, prom_port):
        cluster.kubectl("label", "nodes", *nodes, f"{START_DELAY_LABEL}={COLD_START_S}s", "--overwrite")
        try:
            exporter.load = 3.5 * TARGET  # wants 4 replicas once a first engine reports it
            cluster.apply(run)

            def pool() -> dict:
                found = cluster.kubectl("get", f"sp/{name}", "-n", namespace, "-o", "json", check=False)
                return json.loads(found.stdout) if found.returncode == 0 else {"spec": {}, "status": {}}

            def requested_and_running() -> tuple[int | None, int]:
                return pool()["spec"].get("replicas"), len(exporter.pods())

            def stuck_condition() -> dict:
                found = [
                    c for c in pool().get("status", {}).get("conditions", []) if c["type"] == "ReplicasStuck"
                ]
                return found[0] if found else {}

            wait_for(
                requested_and_running, equals=(1, 1), timeout=COLD_START_S + 60, what="the first replica up"
            )
            scaled_at = time.monotonic()
            wait_for(lambda: requested_and_running()[0], equals=4, timeout=30, what="the pool asks for 4")
            wait_for(
                lambda: stuck_condition().get("reason"), equals="ColdStart", timeout=15, what="a cold start"
            )
            # Longer than the pending timeout, nothing released: the scheduler placed the pods.
            time.sleep(max(0.0, scaled_at + PENDING_TIMEOUT_S + 5 - time.monotonic()))
            assert requested_and_running() == (4, 1)
            wait_for(requested_and_running, equals=(4, 4), timeout=COLD_START_S + 30, what="all four up")
            decisions = pool()["status"]["lastScaleDecisions"]
            assert [d["toReplicas"] for d in decisions] == [4], decisions
            learned = wait_for(
                lambda: pool()["status"].get("coldStartSeconds"), timeout=15, what="a cold start learned"
            )
            assert COLD_START_S - 2 <= learned <= COLD_START_S + 15, learned

            # The H100 nodes are full for new pods: the two more replicas asked for cannot be placed.
            cluster.kubectl("taint", "nodes", *nodes, FULL)
            exporter.load = 6 * TARGET
            released = wait_for(
                lambda: next(
                    (
                        d
                        for d in pool()["status"]["lastScaleDecisions"]
                        if d["toReplicas"] < d["fromReplicas"]
                    ),
                    None,
                ),
                timeout=120,  # the scale-up waits for the minute's average load to confirm it
                what="the unschedulable replicas released",
            )
            assert released["fromReplicas"] == 6 and released["toReplicas"] == 4, released
            assert "2 stuck, released" in released["reason"] and "Unschedulable" in released["reason"], (
                released
            )
            assert "pending timeout" not in released["reason"]
            condition = stuck_condition()
            assert condition["status"] == "True" and "untolerated taint" in condition["message"], condition
            events = cluster.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
            assert any(e["reason"] == "ReplicasStuck" and e["type"] == "Warning" for e in events["items"])
            # Growth waits the pending timeout; the four that run keep serving.
            assert requested_and_running() == (4, 4)
        finally:
            cluster.kubectl("taint", "nodes", *nodes, FULL.split("=")[0] + "-", check=False)
            cluster.kubectl("label", "nodes", *nodes, f"{START_DELAY_LABEL}-", check=False)
