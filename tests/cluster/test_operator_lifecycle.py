"""The operator against the real API server over time: drift repaired within one resync, zero writes
after a restart on an unchanged cluster, one active replica out of two, immutable fields, a failing
object that does not stop the others, and no call the chart's RBAC refuses.

Writes are counted from the API server's audit log (the operator's ServiceAccount is the user);
kopf's peering keep-alives (``kopf.dev``) are the peering protocol, not reconciliation, and are
left out of the count.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_TABLE

from .conftest import ROOT, Bed, OperatorProcess, start_operator, stop_operator, wait_for

RUN = "lifecycle"
RESYNC_S = 4.0
POOLS = ("h100-fp8", "b200-nvfp4")


def small_run(namespace: str, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
    doc["metadata"] = {"name": RUN, "namespace": namespace}
    doc["spec"]["samplerPools"] = [p for p in doc["spec"]["samplerPools"] if p["name"] in POOLS]
    # One 8-GPU node: eight data-parallel ranks.
    doc["spec"]["trainer"].update(nodes=1, gpusPerNode=8)
    doc["spec"]["trainer"].pop("parallelism", None)
    doc["spec"]["autoscaling"] = {"engine": "none"}
    doc["spec"].update(spec)
    return doc


def writes_of(events: list[dict[str, Any]]) -> list[str]:
    """Non-peering writes as ``verb resource/name``."""
    out = []
    for event in events:
        ref = event.get("objectRef", {})
        if event.get("verb") in ("create", "update", "patch", "delete") and ref.get("apiGroup") != "kopf.dev":
            sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
            out.append(f"{event['verb']} {ref.get('resource')}{sub}/{ref.get('name', '')}")
    return out


@pytest.fixture
def operators(cluster: Bed, tmp_path: Path) -> Iterator[Callable[..., OperatorProcess]]:
    """Start operators for one test; every one is stopped, and none made a call RBAC refused."""
    started: list[OperatorProcess] = []

    def start(*extra: str, name: str = "operator") -> OperatorProcess:
        process = start_operator(cluster, tmp_path, f"--resync-seconds={RESYNC_S}", *extra, name=name)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.process.poll() is None:
            stop_operator(process)
    denied = started[0].denied(cluster) if started else []  # one user for all of them: the chart's account
    assert not denied, denied


def settled(cluster: Bed, operator: OperatorProcess, namespace: str, quiet_s: float = 2 * RESYNC_S) -> None:
    """Every pool Running as desired, and no operator write for ``quiet_s`` (a resync included)."""

    def pools_running() -> bool:
        sps = cluster.get("samplerpools", "-n", namespace)["items"]
        return len(sps) == len(POOLS) and all(
            sp.get("status", {}).get("readyReplicas") == sp["spec"]["replicas"] for sp in sps
        )

    wait_for(pools_running, 150, what="pools ready")
    wait_for(
        lambda: _quiet_for(cluster, operator, quiet_s), 120, interval=0.1, what=f"{quiet_s} s without writes"
    )


def _quiet_for(cluster: Bed, operator: OperatorProcess, seconds: float) -> bool:
    before = len(writes_of(operator.requests(cluster)))
    time.sleep(seconds)
    return len(writes_of(operator.requests(cluster))) == before


def test_drift_is_repaired_within_one_resync(
    cluster: Bed, operators: Callable[..., OperatorProcess], namespace: str
) -> None:
    operator = operators()
    cluster.apply(small_run(namespace))
    settled(cluster, operator, namespace)
    pool = f"{RUN}-{POOLS[0]}"
    desired_grace = cluster.get(f"deployment/{pool}", "-n", namespace)["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    patch = json.dumps({"spec": {"template": {"spec": {"terminationGracePeriodSeconds": 5}}}})
    cluster.kubectl("patch", f"deployment/{pool}", "-n", namespace, "--type=merge", "-p", patch)
    cluster.kubectl(
        "delete",
        f"service/{RUN}-router",
        f"configmap/{RUN}-config",
        f"samplerpool/{RUN}-{POOLS[1]}",
        "-n",
        namespace,
    )

    def repaired() -> list[str]:
        grace = cluster.get(f"deployment/{pool}", "-n", namespace)["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"
        ]
        found = cluster.kubectl(
            "get",
            f"service/{RUN}-router",
            f"configmap/{RUN}-config",
            f"samplerpool/{RUN}-{POOLS[1]}",
            "-n",
            namespace,
            check=False,
        )
        return ["grace"] * (grace != desired_grace) + ["deleted"] * (found.returncode != 0)

    wait_for(repaired, 3 * RESYNC_S + 10, what="drift repaired", equals=[])


def test_a_restarted_operator_makes_zero_writes_on_an_unchanged_cluster(
    cluster: Bed, operators: Callable[..., OperatorProcess], namespace: str
) -> None:
    # The status loop reads every second and may write as often, so the quiet window of settled()
    # spans several of its passes: with the defaults (15 s, writes 30 s apart) a status write the
    # first operator still owed could fall to the second under load.
    status_loop = ("--status-seconds=1", "--status-write-seconds=1")
    first = operators(*status_loop, name="first")
    cluster.apply(small_run(namespace))
    settled(cluster, first, namespace)
    stop_operator(first)
    before = len(first.requests(cluster))  # the same user: the second operator's calls come after
    second = operators(*status_loop, name="second")
    wait_for(
        lambda: "peering" in second.log.read_text() or "Resuming" in second.log.read_text(),
        30,
        what="second start",
    )
    time.sleep(3 * RESYNC_S)  # its resume pass and at least two resyncs
    calls = second.requests(cluster)[before:]
    assert calls, "the second operator made no API request at all: it did not run"
    assert writes_of(calls) == []


def test_of_two_replicas_only_one_acts(
    cluster: Bed, operators: Callable[..., OperatorProcess], namespace: str
) -> None:
    # Two replicas of the chart's Deployment: each gets its priority from its pod name.
    first = operators("--replica-id", "mixrl-7d9f-a", name="replica-a")
    wait_for(lambda: "peering" in first.log.read_text(), 60, what="first replica up")
    second = operators("--replica-id", "mixrl-7d9f-b", name="replica-b")
    replicas = (first, second)
    paused = wait_for(
        lambda: [p for p in replicas if "Pausing operations in favour of" in p.log.read_text()],
        30,
        what="a pause",
    )
    assert len(paused) == 1, [p.log_tail(10) for p in replicas]
    standby, active = paused[0], next(p for p in replicas if p is not paused[0])
    cluster.apply(small_run(namespace))
    wait_for(
        lambda: len(cluster.get("samplerpools", "-n", namespace)["items"]) == len(POOLS), 60, what="pools"
    )
    settled(cluster, active, namespace)
    after_pause = standby.log.read_text().split("Pausing operations in favour of", 1)[1]
    assert "Handler" not in after_pause and "Handler" in active.log.read_text()


def test_changing_immutable_fields_is_handled(
    cluster: Bed, operators: Callable[..., OperatorProcess], namespace: str
) -> None:
    operator = operators()
    doc = small_run(namespace)
    cluster.apply(doc)
    settled(cluster, operator, namespace)
    trainer = f"{RUN}-trainer"
    doc["spec"]["trainer"]["gpuType"] = "B200"
    cluster.apply(doc)
    products = {
        n["metadata"]["name"]: n["metadata"]["labels"].get(GPU_PRODUCT_LABEL)
        for n in cluster.get("nodes")["items"]
    }

    def trainer_on_b200() -> bool:
        pods = cluster.get("pods", "-n", namespace, "-l", "app.kubernetes.io/component=trainer")["items"]
        live = [
            p
            for p in pods
            if p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        ]
        return bool(live) and all(
            products[p["spec"]["nodeName"]] in GPU_TABLE["B200"].gfd_products for p in live
        )

    wait_for(trainer_on_b200, 90, what="trainer moved to B200 nodes")
    assert (
        cluster.get(f"statefulset/{trainer}", "-n", namespace)["metadata"]["labels"]["mixrl.dev/gpu-type"]
        == "B200"
    )
    # A larger weights volume is an expansion; a smaller one cannot be done and says so.
    claim = f"{RUN}-weights"
    wait_for(
        lambda: cluster.get(f"pvc/{claim}", "-n", namespace)["status"].get("phase"),
        60,
        what="claim",
        equals="Bound",
    )
    doc["spec"]["weights"]["volumeSize"] = "600Gi"
    cluster.apply(doc)
    wait_for(
        lambda: cluster.get(f"pvc/{claim}", "-n", namespace)["spec"]["resources"]["requests"]["storage"],
        60,
        what="expansion",
        equals="600Gi",
    )
    doc["spec"]["weights"]["volumeSize"] = "100Gi"
    cluster.apply(doc)

    def shrink_refused() -> str:
        conditions = cluster.get(f"rlr/{RUN}", "-n", namespace).get("status", {}).get("conditions", [])
        return " ".join(
            c.get("message", "") for c in conditions if c.get("reason") == "ImmutableFieldChanged"
        )

    message = wait_for(shrink_refused, 60, what="a condition about the shrink")
    assert "volumeSize" in message or "storage" in message
    assert cluster.get(f"pvc/{claim}", "-n", namespace)["spec"]["resources"]["requests"]["storage"] == "600Gi"


def test_one_failing_object_does_not_stop_the_others(
    cluster: Bed, operators: Callable[..., OperatorProcess], namespace: str
) -> None:
    # A quota that allows no Service: every Service is refused (403), everything else must be applied.
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-services"},
        "spec": {"hard": {"services": "0"}},
    }
    cluster.apply(quota, namespace=namespace)
    operators()
    cluster.apply(small_run(namespace))
    wait_for(
        lambda: len(cluster.get("deployments", "-n", namespace)["items"]) >= len(POOLS),
        60,
        what="the pools' Deployments",
    )
    assert cluster.get("statefulsets", "-n", namespace)["items"], "the trainer was not applied"
    assert not cluster.get("services", "-n", namespace)["items"]

    def failure_reported() -> str:
        conditions = cluster.get(f"rlr/{RUN}", "-n", namespace).get("status", {}).get("conditions", [])
        return " ".join(
            c.get("message", "")
            for c in conditions
            if c.get("status") != "True" or c.get("reason") == "ApplyFailed"
        )

    assert "service" in wait_for(failure_reported, 60, what="the refused Services in a condition").lower()


def test_a_name_another_run_holds_is_left_alone(
    cluster: Bed, operators: Callable[..., OperatorProcess], namespace: str
) -> None:
    """Run ``lifecycle``'s pool ``h100-fp8`` and run ``lifecycle-h100``'s pool ``fp8`` are both the
    SamplerPool ``lifecycle-h100-fp8``: the later run is told so, the earlier one keeps its pool."""
    operators()
    cluster.apply(small_run(namespace))
    taken = f"{RUN}-{POOLS[0]}"

    def pool() -> dict[str, Any] | None:
        found = cluster.kubectl("get", f"sp/{taken}", "-n", namespace, "-o", "json", check=False)
        return json.loads(found.stdout) if found.returncode == 0 else None

    before = wait_for(pool, 60, what="the pool")
    other = small_run(namespace)
    other["metadata"]["name"] = f"{RUN}-h100"
    h100 = next(p for p in other["spec"]["samplerPools"] if p["name"] == POOLS[0])
    other["spec"]["samplerPools"] = [{**h100, "name": "fp8", "minReplicas": 3}]
    cluster.apply(other)

    def refusal() -> dict[str, Any]:
        found = cluster.get(f"rlr/{RUN}-h100", "-n", namespace).get("status", {}).get("conditions", [])
        return next((c for c in found if c["type"] == "Progressing" and c["reason"] == "NameTaken"), {})

    condition = wait_for(refusal, 60, what="Progressing NameTaken on the later run")
    assert condition["status"] == "False"
    assert (
        f"SamplerPool/{taken}" in condition["message"] and f"RLRun {RUN} controls it" in condition["message"]
    )
    time.sleep(2 * RESYNC_S)  # a resync of both runs
    after = pool()
    assert after is not None and after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["metadata"]["ownerReferences"] == before["metadata"]["ownerReferences"]
    assert after["spec"]["minReplicas"] == before["spec"]["minReplicas"] != 3
