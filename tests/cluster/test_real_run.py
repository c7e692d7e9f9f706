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

from mixrl.api.resolve import BUFFER_PORT, ENGINE_PORT, ROUTER_PORT
from mixrl.operator.builders.labels import selector_labels
from mixrl.rl.engine.weight_sync import POLL_S
from tests.cluster.conftest import Bed, wait_for
from tests.cluster.real_run import (
    EXAMPLE,
    RUN,
    buffer_stats,
    describe,
    evaluations,
    mentions,
    pod_ip,
    pods,
    probe,
    probed,
    weight_version,
)

NAMESPACE = "rl"


def committed_step(bed: Bed) -> int:
    return buffer_stats(bed, NAMESPACE).get("committed_step") or -1


def committed_after(bed: Bed, before: int) -> int | None:
    step = committed_step(bed)
    return step if step > before else None


@pytest.fixture(scope="module")
def stepping(real_chart: Bed) -> Bed:
    """The example applied, its trainer past step 2: the run is stepping (30 steps in all)."""
    real_chart.kubectl("create", "namespace", NAMESPACE)
    real_chart.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLE))
    try:
        wait_for(
            lambda: committed_step(real_chart) >= 2,
            timeout=600,
            interval=2,
            what="the trainer's step to reach 2",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe(real_chart, NAMESPACE)}") from None
    return real_chart


@pytest.fixture(scope="module")
def trained(stepping: Bed) -> Bed:
    """The run past step 10 and its held-out evaluation at step 10 recorded."""
    try:
        wait_for(lambda: committed_step(stepping) >= 10, timeout=600, interval=5,
                 what="the trainer's step to reach 10")  # fmt: skip
        wait_for(lambda: any(e["step"] >= 10 for e in evaluations(stepping, NAMESPACE)), timeout=300, interval=5,
                 what="the held-out evaluation at step 10")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe(stepping, NAMESPACE)}") from None
    for record in evaluations(stepping, NAMESPACE):
        print(f"held-out evaluation in the cluster: step {record['step']}, pass@k {record['pass_at_k']}")
    return stepping


FOLLOW_BOUND_S = POLL_S + 2 * 8.0
"""How long after the trainer publishes a version every engine pod serves it (or a newer one): the
sidecar notices it within one poll, after finishing the reload it was busy with, and reloads (the
NVFP4 pool converts first; 8 s per reload is the margin for a loaded machine). Seconds, not
versions: how many versions that is depends on how fast the trainer steps, which a shared machine
does not keep steady (CI once saw a step every ~2 s, and an engine 4 versions behind)."""


def test_every_engine_follows_the_trainers_versions(stepping: Bed) -> None:
    """First in this module, while the trainer steps: three times, the moment the trainer commits a
    new step, every engine pod serves that version (or a newer one), each through its own
    weight-sync sidecar, within FOLLOW_BOUND_S."""
    trained = stepping
    sampler_pods = pods(trained, NAMESPACE, "app.kubernetes.io/component=sampler")
    engines = {e["metadata"]["name"]: e["status"]["podIP"] for e in sampler_pods}
    assert len(engines) == 2
    delays: dict[str, list[float]] = {name: [] for name in engines}
    committed: list[int] = []
    for _ in range(3):
        before = committed_step(trained)
        newest = wait_for(lambda before=before: committed_after(trained, before), timeout=120, interval=0.5,
                          what=f"the trainer to commit a step after {before}")  # fmt: skip
        published = time.monotonic()
        committed.append(newest)
        waiting = dict(engines)
        while waiting and time.monotonic() - published <= FOLLOW_BOUND_S:
            for name, ip in list(waiting.items()):
                served = weight_version(ip)
                assert served is not None, f"{name} does not answer GET /get_weight_version"
                if served >= newest:
                    delays[name].append(round(time.monotonic() - published, 1))
                    del waiting[name]
            time.sleep(0.5)
        assert not waiting, (
            f"not serving version {newest} {FOLLOW_BOUND_S:.0f} s after it was the newest: {sorted(waiting)}; {delays}"
        )
    print(f"seconds from a committed step to each engine pod serving it (steps {committed}): {delays}")


def test_the_operator_runs_as_the_charts_pod(trained: Bed) -> None:
    (operator,) = trained.get("pods", "-n", "mixrl-system")["items"]
    assert operator["status"]["phase"] == "Running"
    assert operator["spec"]["serviceAccountName"].startswith("mixrl")


def test_kubectl_apply_trains_in_the_cluster(trained: Bed) -> None:
    stats = buffer_stats(trained, NAMESPACE)
    assert stats["committed_step"] >= 10, stats
    for component in ("trainer", "buffer", "router", "rollout"):
        assert pods(trained, NAMESPACE, f"app.kubernetes.io/component={component}"), component


def test_other_pods_cannot_reach_the_runs_apis(trained: Bed) -> None:
    """The run's NetworkPolicies, enforced by the bed (mixrl.devcluster.netpol): a pod of another
    namespace, and one of the run's namespace that is none of its components, reach neither the
    buffer, the router nor an engine, by pod IP or through the router's Service (by name and by
    cluster IP); a pod labelled as
    the run's rollout worker reaches the buffer and the router (and, like the worker, no engine:
    only the router may); the run itself trains through them (the tests above)."""
    ip = {c: pod_ip(trained, NAMESPACE, c) for c in ("buffer", "router")}
    (engine, *_) = pods(trained, NAMESPACE, "app.kubernetes.io/component=sampler")
    targets = [
        f"{ip['buffer']}:{BUFFER_PORT}",
        f"{ip['router']}:{ROUTER_PORT}",
        f"{engine['status']['podIP']}:{ENGINE_PORT}",
        f"{RUN}-router.{NAMESPACE}.svc.cluster.local:{ROUTER_PORT}",
        trained.get("svc", f"{RUN}-router", "-n", NAMESPACE)["spec"]["clusterIP"] + f":{ROUTER_PORT}",
    ]
    trained.kubectl("create", "namespace", "intruder")
    rollout_labels = selector_labels(RUN, "rollout")
    probes = {
        ("intruder", "outsider"): probe("outsider", targets, rollout_labels),
        (NAMESPACE, "bystander"): probe("bystander", targets, {"app": "bystander"}),
        (NAMESPACE, "lookalike"): probe("lookalike", targets, rollout_labels),
    }
    # released once the lookalike is among the buffer's and the router's allowed callers
    try:
        seen = probed(trained, probes, lambda ips, rules: mentions(rules, ips[(NAMESPACE, "lookalike")]) >= 2)
    finally:  # the run's namespace keeps only the run's pods (the last test waits for all to go)
        trained.kubectl("delete", "pod", "-n", NAMESPACE, "bystander", "lookalike", "--wait=false")
        trained.kubectl("delete", "namespace", "intruder", "--wait=false")
    blocked = [f"{target} blocked" for target in targets]
    assert seen[("intruder", "outsider")] == blocked, seen
    assert seen[(NAMESPACE, "bystander")] == blocked, seen
    assert seen[(NAMESPACE, "lookalike")] == [f"{targets[0]} open", f"{targets[1]} open", blocked[2],
                                              f"{targets[3]} open", f"{targets[4]} open"], seen  # fmt: skip


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
