"""An RLRun trains in the cluster, in real containers built from the project's Dockerfiles: the chart
installed by Helm with the bed's images (the operator runs as the chart's pod, under its RBAC), then
``kubectl apply`` of ``examples/rlrun-cluster-cpu.yaml``; the trainer's step rises in its pod, every
engine pod follows the trainer's versions through its own init container and weight-sync sidecar,
and the held-out evaluation is recorded by the buffer.

The host reaches pod IPs directly (the bed routes the node's pod subnet to it), so the test reads
each component's HTTP API the way the components read each other's. The run's live status comes
from the bed's Prometheus (mixrl.devcluster.monitoring), which scrapes the pods as a cluster's
Prometheus does: ``kubectl get rlr`` shows the step the trainer's pod exported."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import CHART, Bed, wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rlrun-cluster-cpu.yaml"
NAMESPACE = "rl"
RUN = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]


def http_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def pods(bed: Bed, selector: str) -> list[dict]:
    return bed.get("pods", "-n", NAMESPACE, "-l", selector)["items"]


def pod_ip(bed: Bed, component: str) -> str | None:
    running = [p for p in pods(bed, f"app.kubernetes.io/component={component}") if p["status"].get("podIP")]
    return running[0]["status"]["podIP"] if running else None


def buffer_stats(bed: Bed) -> dict:
    ip = pod_ip(bed, "buffer")
    if ip is None:
        return {}
    try:
        return http_json(f"http://{ip}:8100/stats")
    except (OSError, urllib.error.URLError, ValueError):
        return {}


def evaluations(bed: Bed) -> list[dict]:
    ip = pod_ip(bed, "buffer")
    try:
        return http_json(f"http://{ip}:8100/evaluations")["evaluations"] if ip else []
    except (OSError, urllib.error.URLError, ValueError, KeyError):
        return []


def describe(bed: Bed) -> str:
    """What a person would look at when the run does not progress."""
    listing = bed.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide", check=False).stdout
    events = bed.kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False).stdout
    return f"{listing}\n{events[-3000:]}"


@pytest.fixture(scope="module")
def trained(real_bed: Bed) -> Bed:
    values = Path(real_bed.state.dir) / "chart-values.yaml"
    real_bed.helm("install", "mixrl", str(CHART), "-n", "mixrl-system", "--create-namespace", "--wait",
                  "--timeout", "300s", "-f", str(values), "--set", "watch.allNamespaces=true")  # fmt: skip
    real_bed.kubectl("create", "namespace", NAMESPACE)
    real_bed.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLE))
    started = time.monotonic()
    try:
        wait_for(lambda: (buffer_stats(real_bed).get("committed_step") or -1) >= 10, timeout=600, interval=5,
                 what="the trainer's step to reach 10")  # fmt: skip
        print(f"apply -> step 10 in {time.monotonic() - started:.0f} s")
        wait_for(lambda: any(e["step"] >= 10 for e in evaluations(real_bed)), timeout=300, interval=5,
                 what="the held-out evaluation at step 10")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe(real_bed)}") from None
    for record in evaluations(real_bed):
        print(f"held-out evaluation in the cluster: step {record['step']}, pass@k {record['pass_at_k']}")
    return real_bed


def test_the_operator_runs_as_the_charts_pod(trained: Bed) -> None:
    (operator,) = trained.get("pods", "-n", "mixrl-system")["items"]
    assert operator["status"]["phase"] == "Running"
    assert operator["spec"]["serviceAccountName"].startswith("mixrl")


def test_kubectl_apply_trains_in_the_cluster(trained: Bed) -> None:
    stats = buffer_stats(trained)
    assert stats["committed_step"] >= 10, stats
    for component in ("trainer", "buffer", "router", "rollout"):
        assert pods(trained, f"app.kubernetes.io/component={component}"), component


def test_every_engine_serves_a_recent_version(trained: Bed) -> None:
    engines = pods(trained, "app.kubernetes.io/component=sampler")
    assert len(engines) == 2
    for engine in engines:
        ip = engine["status"]["podIP"]
        version = wait_for(lambda ip=ip: _weight_version(ip), what=f"{engine['metadata']['name']}'s version")
        assert version >= 5, (engine["metadata"]["name"], version)


def _weight_version(ip: str) -> int | None:
    try:
        answer = http_json(f"http://{ip}:30000/get_weight_version")
    except (OSError, urllib.error.URLError, ValueError):
        return None
    value = answer.get("weight_version") if isinstance(answer, dict) else answer
    return int(str(value).lstrip("v")) if value is not None else None


def test_kubectl_get_rlr_shows_the_trainers_figures_from_prometheus(trained: Bed) -> None:
    def status() -> dict | None:
        run = trained.get("rlrun", RUN, "-n", NAMESPACE)["status"]
        return run if run.get("step", 0) >= 5 and "reward" in run and "weightVersion" in run else None

    run = wait_for(status, timeout=120, interval=2, what="the run's live status from Prometheus")
    assert 0.0 <= run["reward"] <= 1.0, run
    printed = trained.kubectl("get", "rlr", "-n", NAMESPACE).stdout
    header, row = printed.splitlines()[:2]
    step_column = header.split().index("STEP")
    assert int(row.split()[step_column]) >= 5, printed
    pools = trained.get("samplerpools", "-n", NAMESPACE)["items"]
    kl = {p["metadata"]["name"]: p.get("status", {}).get("kl") for p in pools}
    assert len(kl) == 2 and all(value is not None and value >= 0 for value in kl.values()), kl


def test_the_held_out_evaluation_runs_in_the_cluster(trained: Bed) -> None:
    (record,) = [e for e in evaluations(trained) if e["step"] == 10]
    # evaluation.sampler: pools evaluates on what the pools serve at that step: trained weights,
    # none newer than the step's (the sidecars follow the trainer a version or two behind)
    assert 1 <= record["weight_version"] <= 10, record
    assert set(record["pass_at_k"]) == {"1", "4"}
    assert 0.0 <= record["pass_at_k"]["1"] <= record["pass_at_k"]["4"] <= 1.0, record
