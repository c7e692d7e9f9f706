"""The live status end to end: a real Prometheus scrapes a stand-in of the run's components, and the
operator (a separate process, with the chart's RBAC) writes the RLRun's and SamplerPools' status —
with the built-in autoscaler off — raises CollapseRisk with an Event, writes nothing while the run
is idle, and at the end marks the run Succeeded and releases its GPUs.

Stand-in: the components. KWOK pods run no container, so one loopback exporter plays the trainer
and the router: it serves their series (names from mixrl.rl.metrics, labels as their telemetry
sets them, ``namespace`` as a cluster's pod discovery would attach it) with values the test sets.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.devcluster.cluster import free_port
from mixrl.rl import metrics as m

from .conftest import (
    ROOT,
    Bed,
    OperatorProcess,
    exposition_server,
    operator_with_feature,
    wait_for,
)
from .test_autoscaling import start_prometheus

POOLS = ("h100-fp8", "b200-nvfp4")
MEASURED_CAPACITY = {"h100-fp8": 1.4, "b200-nvfp4": 1.1}
"""The router's measurements: h100-fp8 near its declared 1.5, b200-nvfp4 a third of its 3.2."""


class RunExporter:
    """The trainer's and the router's series of one run; ``step`` advances on its own when ``moving``."""

    def __init__(self, namespace: str, run: str):
        self.namespace, self.run = namespace, run
        self.step = 0
        self.kl = dict.fromkeys(POOLS, 0.001)
        self.finished = 0
        self.moving = False
        self.port = free_port()
        self.server = exposition_server(self.exposition, self.port)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        threading.Thread(target=self._advance, daemon=True).start()

    def _advance(self) -> None:
        while True:
            time.sleep(1.0)
            if self.moving:
                self.step += 1

    def labels(self, pool: str, pod: str) -> str:
        return f'namespace="{self.namespace}",pod="{pod}",run="{self.run}",pool="{pool}",gpu_type="",precision=""'

    def exposition(self) -> str:
        trainer, router = f"{self.run}-trainer-0", f"{self.run}-router-abc-def"
        run = self.labels("all", trainer)
        lines = [
            f"{m.MIXRL_TRAINER_STEP.name}{{{run}}} {self.step}",
            f"{m.MIXRL_TRAINER_WEIGHT_VERSION.name}{{{run}}} {self.step}",
            f"{m.MIXRL_TRAINER_REWARD.name}{{{run}}} 0.5",
            f"{m.MIXRL_TRAINER_KL.name}{{{run}}} {sum(self.kl.values()) / len(self.kl)}",
            f"{m.MIXRL_TRAINER_FORMAT_ERROR_ENDINGS.name}{{{run}}} 0",
            f"{m.MIXRL_TRAINER_FINISHED.name}{{{run}}} {self.finished}",
        ]
        for index, pool in enumerate(POOLS):
            lines.append(f"{m.MIXRL_TRAINER_KL.name}{{{self.labels(pool, trainer)}}} {self.kl[pool]}")
            share = 0.25 if index == 0 else 0.75
            lines.append(f"{m.MIXRL_ROUTER_TRAFFIC_SHARE.name}{{{self.labels(pool, router)}}} {share}")
            version = max(self.step - 1, 0)
            lines.append(f"{m.MIXRL_ROUTER_WEIGHT_VERSION.name}{{{self.labels(pool, router)}}} {version}")
            measured = MEASURED_CAPACITY[pool]
            lines.append(f"{m.MIXRL_ROUTER_CAPACITY_MEASURED.name}{{{self.labels(pool, router)}}} {measured}")
        return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def status_operator(cluster: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """The chart's operator with --explain-placement and the chart's RBAC for it (the status loop
    reads every node and bound pod only with both)."""
    with operator_with_feature(
        cluster,
        tmp_path_factory.mktemp("status-operator"),
        "placement.explain=true",
        "-placement",
        "--status-seconds=1",
        "--status-write-seconds=2",
        "--no-builtin-autoscaler",
        "--explain-placement",
    ) as running:
        yield running


def status_writes(operator: OperatorProcess, cluster: Bed, since: int) -> list[str]:
    return [
        e["requestURI"]
        for e in operator.writes(cluster, since)
        if e.get("objectRef", {}).get("subresource") == "status"
    ]


def test_status_is_live_collapse_is_flagged_idle_costs_nothing_and_the_end_releases_gpus(
    cluster: Bed, status_operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    run = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
    run["metadata"]["namespace"] = namespace
    name = run["metadata"]["name"]
    run["spec"]["samplerPools"] = [p for p in run["spec"]["samplerPools"] if p["name"] in POOLS]
    for pool in run["spec"]["samplerPools"]:
        pool.update(minReplicas=1, maxReplicas=2)
    prom_port = free_port()
    run["spec"]["autoscaling"] = {"engine": "none", "prometheusUrl": f"http://127.0.0.1:{prom_port}"}
    run["spec"]["health"] = {"collapse": {"baselineSteps": 3, "window": 2}}
    exporter = RunExporter(namespace, name)
    prometheus = start_prometheus(tmp_path, prom_port, f"127.0.0.1:{exporter.port}")
    try:
        cluster.apply(run)
        exporter.moving = True

        def rlrun() -> dict[str, Any]:
            return cluster.get(f"rlr/{name}", "-n", namespace).get("status") or {}

        def condition(kind: str) -> dict[str, Any]:
            return next((c for c in rlrun().get("conditions", []) if c["type"] == kind), {})

        # 1. Live values on the run, in its pools list and on each SamplerPool.
        wait_for(lambda: (rlrun().get("step") or 0) >= 4, timeout=90, what="the trainer's step in the status")
        wait_for(
            lambda: condition("CollapseRisk").get("status"), equals="False", timeout=60, what="judged healthy"
        )
        status = rlrun()
        assert status["phase"] in ("Pending", "Running") and status["weightVersion"] >= 3
        assert status["reward"] == 0.5
        summary = {p["name"]: p for p in status["pools"]}
        assert summary["h100-fp8"]["trafficShare"] == 0.25 and summary["b200-nvfp4"]["kl"] == 0.001
        pool = cluster.get(f"sp/{name}-h100-fp8", "-n", namespace)["status"]
        assert pool["trafficShare"] == 0.25 and pool["kl"] == 0.001 and pool["servingWeightVersion"] >= 2
        # The measured capacity: within 1.5x of the declaration it stands; a third of it is named.
        assert pool["measuredCapacity"] == 1.4
        mismatch = next(c for c in pool["conditions"] if c["type"] == "CapacityMismatch")
        assert mismatch["status"] == "False", mismatch
        off = cluster.get(f"sp/{name}-b200-nvfp4", "-n", namespace)["status"]
        mismatch = next(c for c in off["conditions"] if c["type"] == "CapacityMismatch")
        assert (
            mismatch["status"] == "True"
            and "measured capacity 1.1 per replica against the declared 3.2" in mismatch["message"]
        )
        warnings = cluster.get("events", "-n", namespace, "--field-selector", "reason=CapacityMismatch")[
            "items"
        ]
        assert [e["involvedObject"]["name"] for e in warnings] == [name], warnings
        assert f"pool {name}-b200-nvfp4: measured capacity 1.1" in warnings[0]["message"]
        # Spend: both pools' pods and the trainer's 32 H200 GPUs, priced by the default table.
        assert status["cost"] > 0 and status["trainerGpuHours"] > 0
        assert status["costPerUpdate"] == pytest.approx(status["cost"] / status["step"], rel=2e-3)
        assert all(p["gpuHours"] > 0 for p in status["pools"])
        table = cluster.kubectl("get", "rlr,sp", "-n", namespace).stdout
        assert "0.25" in table and "0.5" in table, table

        # 2. Idle: nothing changes, so nothing is written (a write per change, at most one per 2 s).
        exporter.moving = False
        last = exporter.step
        wait_for(lambda: rlrun().get("step"), equals=last, timeout=60, what="the last step in the status")
        time.sleep(4)  # and whatever changed with it (a write at most every 2 s)
        since = len(status_operator.requests(cluster))
        time.sleep(8)
        assert status_writes(status_operator, cluster, since) == []

        # 3. Collapse in one pool: its KL grows past 3x its baseline.
        exporter.kl["b200-nvfp4"] = 0.01
        exporter.moving = True
        risk = wait_for(
            lambda: condition("CollapseRisk") if condition("CollapseRisk").get("status") == "True" else None,
            timeout=60,
            what="CollapseRisk",
        )
        assert risk["reason"] == "SignsOfCollapse" and "pool b200-nvfp4" in risk["message"], risk
        events = cluster.get("events", "-n", namespace, "--field-selector", "reason=CollapseRisk")["items"]
        assert [e["type"] for e in events] == ["Warning"] and "b200-nvfp4" in events[0]["message"]

        # 4. The end: the trainer says it finished; the run succeeds and its GPUs are released.
        exporter.finished = 1
        wait_for(lambda: rlrun().get("phase"), equals="Succeeded", timeout=60, what="phase Succeeded")
        assert rlrun()["reason"] == "TotalStepsReached"

        def released() -> list[int]:
            found = cluster.kubectl(
                "get", f"statefulset/{name}-trainer", f"statefulset/{name}-rollout", f"deployment/{name}-router",
                *[f"sp/{name}-{p}" for p in POOLS], "-n", namespace, "-o", "json",
            )  # fmt: skip
            return [item["spec"]["replicas"] for item in json.loads(found.stdout)["items"]]

        wait_for(released, equals=[0] * 5, timeout=60, what="trainer, rollout, router and pools at zero")
        ended = cluster.get("events", "-n", namespace, "--field-selector", "reason=Succeeded")["items"]
        assert len(ended) == 1 and ended[0]["involvedObject"]["kind"] == "RLRun"
        buffer = cluster.get(f"statefulset/{name}-buffer", "-n", namespace)
        assert buffer["spec"]["replicas"] == 1  # its logs stay served
    finally:
        prometheus.terminate()
        prometheus.wait(10)
        exporter.server.shutdown()


def wait_for_unplaced(cluster: Bed, namespace: str, name: str, *parts: str) -> dict[str, Any]:
    """The run's PodsPlaced condition once it is False and its message holds every one of ``parts``.
    The scheduler's first try can precede the PV controller binding the weights claim ("pod has
    unbound immediate PersistentVolumeClaims"), and under load the retry that replaces that reason
    may come seconds later: so wait for the settled message, not the first False."""
    last: dict[str, Any] = {}

    def settled() -> dict[str, Any] | None:
        status = cluster.get(f"rlrun/{name}", "-n", namespace).get("status") or {}
        last.clear()
        last.update(next((c for c in status.get("conditions", []) if c["type"] == "PodsPlaced"), {}))
        message = last.get("message", "")
        return last if last.get("status") == "False" and all(part in message for part in parts) else None

    try:
        return wait_for(settled, timeout=60, what=f"PodsPlaced False saying {parts}")
    except AssertionError as error:
        raise AssertionError(f"{error}; the condition last read: {last}") from None


def test_a_run_whose_trainer_cannot_be_placed_says_what_it_needs_why_and_who_holds_the_gpus(
    cluster: Bed, status_operator: OperatorProcess, namespace: str
) -> None:
    """Issue #31: a trainer Pending forever said only "TrainerReady: 0/1 ready".  Here one of its three pods
    asks for 8 × A100 on one node; the bed has two A100 nodes, which its other two pods fill.  With
    --explain-placement the message goes on with the nodes' free GPUs and who holds them."""
    run = yaml.safe_load((ROOT / "examples" / "rlrun-minimal.yaml").read_text())
    run["metadata"]["namespace"] = namespace
    name = run["metadata"]["name"]
    run["spec"]["trainer"].update(gpuType="A100", nodes=3, gpusPerNode=8)
    cluster.apply(run)

    holders = f"held by run {namespace}/{name} (16 GPUs in 2 pod(s))"
    condition = wait_for_unplaced(cluster, namespace, name, "Insufficient nvidia.com/gpu", holders)
    assert condition["status"] == "False" and condition["reason"] == "Unschedulable", condition
    # One of the three pods waits (which one: the StatefulSet starts them together).
    assert re.match(
        rf"trainer pod {name}-trainer-[0-2] needs 8 × A100 on one node and cannot be placed: 0/\d+ nodes",
        condition["message"],
    ), condition
    # What would fix it: both A100 nodes the pod may use are full, and whose pods fill them.
    assert re.search(
        r"; 2 A100 node\(s\) it may use; GPUs free on the most free: \S+ 0, \S+ 0; none has 8 free: it fits "
        r"once 8 more are freed on one of them; their GPUs are ",
        condition["message"],
    ), condition
    events = cluster.get("events", "-n", namespace, "--field-selector", "reason=Unschedulable")["items"]
    ours = [e for e in events if e["involvedObject"]["kind"] == "RLRun"]
    assert ours and ours[0]["type"] == "Warning", ours
    assert (
        ours[0]["message"].startswith(f"trainer pod {name}-trainer-")
        and "A100 node(s) it may use" in ours[0]["message"]
    )


def test_an_engine_pod_that_cannot_be_placed_is_named_from_the_unbound_pods_alone(
    cluster: Bed, status_operator: OperatorProcess, namespace: str
) -> None:
    """The status loop reads only a run's engine pods that are on no node yet (a field selector the
    real API server applies; the emulator of tests/operator ignores it): a pool pod whose node
    selector matches no node is among them, and named with the scheduler's reason."""
    run = yaml.safe_load((ROOT / "examples" / "rlrun-minimal.yaml").read_text())
    run["metadata"]["namespace"] = namespace
    name = run["metadata"]["name"]
    pool = run["spec"]["samplerPools"][0]
    pool["scheduling"] = {"nodeSelector": {"example.com/zone": "nowhere"}}
    cluster.apply(run)

    condition = wait_for_unplaced(cluster, namespace, name, "didn't match Pod's node affinity/selector")
    assert condition["message"].startswith(f"pool {pool['name']}'s pod {name}-{pool['name']}-"), condition
