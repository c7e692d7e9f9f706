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

import time

import pytest

from tests.cluster.conftest import Bed, wait_for
from tests.cluster.real_run import EXAMPLE, RUN, buffer_stats, describe, evaluations, pods, weight_version

NAMESPACE = "rl"


@pytest.fixture(scope="module")
def trained(real_chart: Bed) -> Bed:
    real_bed = real_chart
    real_bed.kubectl("create", "namespace", NAMESPACE)
    real_bed.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLE))
    started = time.monotonic()
    try:
        wait_for(lambda: (buffer_stats(real_bed, NAMESPACE).get("committed_step") or -1) >= 10, timeout=600, interval=5,
                 what="the trainer's step to reach 10")  # fmt: skip
        print(f"apply -> step 10 in {time.monotonic() - started:.0f} s")
        wait_for(lambda: any(e["step"] >= 10 for e in evaluations(real_bed, NAMESPACE)), timeout=300, interval=5,
                 what="the held-out evaluation at step 10")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe(real_bed, NAMESPACE)}") from None
    for record in evaluations(real_bed, NAMESPACE):
        print(f"held-out evaluation in the cluster: step {record['step']}, pass@k {record['pass_at_k']}")
    return real_bed


def test_the_operator_runs_as_the_charts_pod(trained: Bed) -> None:
    (operator,) = trained.get("pods", "-n", "mixrl-system")["items"]
    assert operator["status"]["phase"] == "Running"
    assert operator["spec"]["serviceAccountName"].startswith("mixrl")


def test_kubectl_apply_trains_in_the_cluster(trained: Bed) -> None:
    stats = buffer_stats(trained, NAMESPACE)
    assert stats["committed_step"] >= 10, stats
    for component in ("trainer", "buffer", "router", "rollout"):
        assert pods(trained, NAMESPACE, f"app.kubernetes.io/component={component}"), component


LAG_BOUND = 3
"""How many versions an engine pod may serve behind the trainer's newest while the run steps every
~10 s: the sidecar notices a version within its poll, converts it (NVFP4 here) and reloads; measured
1–2 on the real node (docs/benchmarks.md)."""


def test_every_engine_follows_the_trainers_versions(trained: Bed) -> None:
    """Each engine pod, through its own weight-sync sidecar, serves a version at most LAG_BOUND
    behind the trainer's newest, sampled every 2 s for 20 s while the run goes on."""
    engines = pods(trained, NAMESPACE, "app.kubernetes.io/component=sampler")
    assert len(engines) == 2
    lags: dict[str, list[int]] = {e["metadata"]["name"]: [] for e in engines}
    for _ in range(10):
        newest = trained.get("rlrun", RUN, "-n", NAMESPACE).get("status", {}).get("weightVersion")
        newest = max(newest or 0, buffer_stats(trained, NAMESPACE).get("committed_step") or 0)
        for engine in engines:
            served = weight_version(engine["status"]["podIP"])
            assert served is not None and served >= 1, (engine["metadata"]["name"], served)
            lags[engine["metadata"]["name"]].append(newest - served)
        time.sleep(2)
    print(f"engine lag behind the trainer's newest version, per pod: {lags}")
    assert all(max(values) <= LAG_BOUND for values in lags.values()), lags


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
    (record,) = [e for e in evaluations(trained, NAMESPACE) if e["step"] == 10]
    # evaluation.sampler: pools evaluates on what the pools serve at that step: trained weights,
    # none newer than the step's (the sidecars follow the trainer a version or two behind)
    assert 1 <= record["weight_version"] <= 10, record
    assert set(record["pass_at_k"]) == {"1", "4"}
    assert 0.0 <= record["pass_at_k"]["1"] <= record["pass_at_k"]["4"] <= 1.0, record


PRESTOP_SETTLE_S = 7.0
"""The engines' preStop hook (mixrl/rl/engine/drain.py) waits 5 s for the endpoint removal to
spread, then for two idle polls 2 s apart: an engine pod that went faster did not run it."""


def test_kubectl_delete_rlr_drains_the_engines_and_collects_every_child(trained: Bed) -> None:
    """Last in this module: the run goes. Its engine pods stop through their preStop drain (a
    failed hook would be a FailedPreStopHook event), and garbage collection takes every child."""
    engines = {p["metadata"]["name"] for p in pods(trained, NAMESPACE, "app.kubernetes.io/component=sampler")}
    assert len(engines) == 2
    started = time.monotonic()
    trained.kubectl("delete", "rlr", RUN, "-n", NAMESPACE, "--wait=false")
    gone_after: dict[str, float] = {}

    def every_pod_gone() -> bool:
        present = {p["metadata"]["name"] for p in trained.get("pods", "-n", NAMESPACE)["items"]}
        for name in engines - present:
            gone_after.setdefault(name, time.monotonic() - started)
        return not present

    wait_for(every_pod_gone, timeout=300, interval=0.5, what="every pod of the deleted run gone")
    assert all(gone_after[name] >= PRESTOP_SETTLE_S for name in engines), gone_after
    failed_hooks = [e["message"] for e in trained.get("events", "-n", NAMESPACE)["items"] if e.get("reason") == "FailedPreStopHook"]  # fmt: skip
    assert failed_hooks == []
    kinds = "samplerpools,deployments,statefulsets,services,configmaps,secrets,networkpolicies"
    selector = f"app.kubernetes.io/managed-by=mixrl-operator,app.kubernetes.io/instance={RUN}"
    wait_for(lambda: not trained.get(kinds, "-n", NAMESPACE, "-l", selector)["items"], timeout=120,
             what="every child of the run collected")  # fmt: skip
    print(f"kubectl delete rlr: engine pods drained and gone after {sorted(gone_after.values())} s")
