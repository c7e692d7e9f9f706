"""Faults with real pods on the real node, one run going through them in order: an engine pod, the
trainer pod (it saves a checkpoint of its last step on SIGTERM, and its new pod goes on from it)
and the buffer pod deleted mid-run, the kubelet restarted, a pool scaled up and down.
After each the run goes on, and nothing the buffer acknowledged is lost: the rollout worker counts
the trajectories the buffer answered 200 to (``mixrl_rollout_trajectories_acknowledged_total``),
and the buffer's durable count (``GET /stats`` ``trajectories``, rebuilt from its log on a restart)
is never below it. The trainer's own log (``metrics.jsonl`` on its volume) holds every step once,
and the buffer's copy (``GET /trainer-metrics``) agrees with it.

The run is the cluster example with more steps and no held-out evaluation in between, in a
namespace of its own; the tests run in the order written, each starting from where the last left
the run."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from mixrl.api.pod_dirs import TRAINER_RUN_DIR
from mixrl.api.resolve import METRICS_PORT, ROUTER_PORT
from mixrl.rl.metrics import MIXRL_ROLLOUT_TRAJECTORIES_ACKNOWLEDGED_TOTAL
from tests.cluster.conftest import Bed, wait_for
from tests.cluster.real_run import (
    EXAMPLE,
    RUN,
    buffer_stats,
    buffer_text,
    counter,
    describe,
    http_json,
    pod_ip,
    running,
    weight_version,
)

NAMESPACE = "rl-faults"
ACKNOWLEDGED = MIXRL_ROLLOUT_TRAJECTORIES_ACKNOWLEDGED_TOTAL.name


def committed(bed: Bed) -> int:
    return buffer_stats(bed, NAMESPACE).get("committed_step") or -1


def advances(bed: Bed, steps: int, timeout: float = 240) -> int:
    """Wait until the trainer commits ``steps`` more steps than now; the step reached."""
    wait_for(lambda: buffer_stats(bed, NAMESPACE) or None, timeout=timeout, what="the buffer answering")
    start = committed(bed)
    try:
        wait_for(lambda: committed(bed) >= start + steps, timeout=timeout, interval=2,
                 what=f"{steps} more steps after step {start}")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe(bed, NAMESPACE)}") from None
    return committed(bed)


def acknowledged(bed: Bed) -> float:
    ip = pod_ip(bed, NAMESPACE, "rollout")
    value = counter(ip, METRICS_PORT, ACKNOWLEDGED) if ip else None
    assert value is not None, "the rollout worker's metrics are unreachable"
    return value


def rollout_container(bed: Bed) -> tuple[str, str, int]:
    """The rollout pod's name, uid and restart count: its counter starts again from 0 with either."""
    pod = one(bed, "rollout")
    restarts = sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses", []))
    return pod["metadata"]["name"], pod["metadata"]["uid"], restarts


def still_the_same_rollout(bed: Bed, before: tuple[str, str, int]) -> None:
    """Fail with the previous container's last lines if the rollout worker was restarted."""
    now = rollout_container(bed)
    if now == before:
        return
    name = now[0]
    previous = bed.kubectl("logs", "-n", NAMESPACE, name, "--previous", "--tail=40", check=False)
    raise AssertionError(
        f"the rollout worker was restarted or replaced ({before} -> {now}); its previous log:\n"
        f"{previous.stdout}{previous.stderr}"
    )


def nothing_acknowledged_lost(bed: Bed) -> None:
    sent = acknowledged(bed)
    kept = wait_for(lambda: buffer_stats(bed, NAMESPACE).get("trajectories"), what="the buffer's count")
    assert kept >= sent, f"the buffer holds {kept} trajectories, the rollout had {sent} acknowledged"


def node_ready(bed: Bed, name: str) -> bool:
    conditions = bed.get("node", name)["status"].get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def one(bed: Bed, component: str) -> dict:
    (found,) = wait_for(
        lambda: running(bed, NAMESPACE, component) or None, timeout=180, what=f"a running {component}"
    )
    return found


def replace_pod(bed: Bed, component: str, timeout: float) -> None:
    """Delete the component's one pod and wait until its controller runs a new one."""
    victim = one(bed, component)
    bed.kubectl("delete", "pod", "-n", NAMESPACE, victim["metadata"]["name"], "--wait=false")
    wait_for(lambda: [p for p in running(bed, NAMESPACE, component) if p["metadata"]["uid"] != victim["metadata"]["uid"]] or None,
             timeout=timeout, what=f"the {component}'s new pod")  # fmt: skip


@pytest.fixture(scope="module")
def run(real_chart: Bed) -> Bed:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["trainer"]["totalSteps"] = 400  # never reached: the last test deletes the run
    manifest["spec"]["evaluation"] = {"everySteps": 400, "passK": [1], "samplesPerTask": 1}
    manifest["spec"]["trainer"]["checkpointEvery"] = 400  # no checkpoint but a stopped trainer's
    real_chart.kubectl("create", "namespace", NAMESPACE)
    real_chart.apply(manifest, namespace=NAMESPACE)
    advances(real_chart, 3, timeout=600)
    return real_chart


def test_an_engine_pod_deleted_mid_run(run: Bed) -> None:
    engines = running(run, NAMESPACE, "sampler")
    victim = next(p for p in engines if p["metadata"]["labels"]["mixrl.dev/pool"] == "nvfp4")
    run.kubectl("delete", "pod", "-n", NAMESPACE, victim["metadata"]["name"], "--wait=false")
    step = advances(run, 3)
    fresh = [
        p for p in running(run, NAMESPACE, "sampler") if p["metadata"]["labels"]["mixrl.dev/pool"] == "nvfp4"
    ]
    assert [p["metadata"]["uid"] for p in fresh] != [victim["metadata"]["uid"]]
    (pod,) = fresh
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]

    def explained(*args: Any, **kwargs: Any) -> Any:
        try:
            return wait_for(*args, **kwargs)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{pod_logs(run, pod)}") from None

    # Running is not serving: on a loaded machine the new engine may still be loading its model
    # (the pod's startup probe allows minutes for that)
    explained(lambda: container_ready(run, name, "engine"), timeout=300, what="the new engine ready")
    # its first labelled version: an engine started from a checkpoint reports none (0) until the
    # sidecar labels or updates it
    served = explained(lambda: weight_version(ip), what="the new engine's version")
    assert served >= step - 3, (served, step)  # it started from the latest version, not version 0
    nothing_acknowledged_lost(run)


def container_ready(bed: Bed, pod: str, container: str) -> bool:
    statuses = bed.get("pod", pod, "-n", NAMESPACE)["status"].get("containerStatuses", [])
    return any(c["name"] == container and c.get("ready") for c in statuses)


def pod_logs(bed: Bed, pod: dict, tail: int = 30) -> str:
    """The last lines of each of a pod's containers, init containers first."""
    spec = pod["spec"]
    names = [c["name"] for c in (*spec.get("initContainers", []), *spec["containers"])]
    logs = (bed.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"], "-c", name, f"--tail={tail}", check=False)
            for name in names)  # fmt: skip
    return "\n".join(f"--- {name}:\n{log.stdout}{log.stderr}" for name, log in zip(names, logs, strict=True))


def test_the_trainer_pod_deleted_resumes_at_its_step(run: Bed) -> None:
    before = committed(run)
    replace_pod(run, "trainer", timeout=240)
    advances(run, 3)
    (pod,) = running(run, NAMESPACE, "trainer")
    # The deleted pod's trainer, sent SIGTERM by the kubelet, saved a checkpoint of its last step
    # (a step under way may have ended meanwhile), and the new one goes on from it.
    log = run.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"], "-c", "trainer").stdout
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    assert resumed is not None and int(resumed[1]) >= before, (before, log[-2000:])
    # The trainer's own log on its volume (metrics.jsonl) and the copy the buffer keeps.
    logged = run.kubectl("exec", "-n", NAMESPACE, pod["metadata"]["name"], "-c", "trainer", "--",
                         "cat", f"{TRAINER_RUN_DIR}/metrics.jsonl").stdout  # fmt: skip
    steps = [json.loads(line)["step"] for line in logged.splitlines() if line.strip()]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    assert steps == list(range(1, max(steps) + 1)), f"a step is missing: {steps}"
    assert max(steps) > before
    kept = [json.loads(line)["step"] for line in buffer_text(run, NAMESPACE, "/trainer-metrics").splitlines()]
    # the buffer's copy of each record is posted just after the trainer logs it
    assert kept == steps[: len(kept)] and len(kept) >= len(steps) - 2, (kept, steps)
    nothing_acknowledged_lost(run)


def test_the_buffer_pod_deleted_loses_nothing_acknowledged(run: Bed) -> None:
    rollout = rollout_container(run)
    before = acknowledged(run)
    replace_pod(run, "buffer", timeout=180)
    advances(run, 2)
    still_the_same_rollout(run, rollout)  # the buffer's absence is the rollout worker's to ride out
    assert acknowledged(run) > before  # the rollout worker went on posting to the new pod
    nothing_acknowledged_lost(run)


def test_a_restarted_kubelet_keeps_the_pods(run: Bed) -> None:
    def containers() -> dict[str, tuple[str, int]]:
        found = run.get("pods", "-n", NAMESPACE)["items"]
        return {
            p["metadata"]["name"]: (p["metadata"]["uid"], sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses", [])))
            for p in found if not p["metadata"].get("deletionTimestamp")
        }  # fmt: skip

    before = containers()
    run.handle.restart_node_agent(run.state, "kubelet-0")
    wait_for(lambda: node_ready(run, "mixrl-node-0"), timeout=120, what="the node Ready again")
    advances(run, 2)
    assert containers() == before, "a pod or container was replaced by the kubelet's restart"


def test_a_pool_scaled_up_then_down(run: Bed) -> None:
    pool = f"{RUN}-bf16"

    def bf16_pods() -> list[dict]:
        return [
            p
            for p in running(run, NAMESPACE, "sampler")
            if p["metadata"]["labels"]["mixrl.dev/pool"] == "bf16"
        ]

    def router_ready() -> int:
        """The bf16 replicas the router sends sessions to (``GET /pools``)."""
        ip = pod_ip(run, NAMESPACE, "router")
        pools = http_json(f"http://{ip}:{ROUTER_PORT}/pools")["pools"] if ip else []
        return next((p["ready_replicas"] for p in pools if p["name"] == "bf16"), 0)

    run.kubectl("scale", "samplerpool", pool, "-n", NAMESPACE, "--replicas=2")
    wait_for(lambda: len(bf16_pods()) == 2 or None, timeout=240, what="a second bf16 replica")
    step = committed(run)
    wait_for(lambda: router_ready() == 2 or None, timeout=120, what="the router's two bf16 replicas")
    newest = max(bf16_pods(), key=lambda p: p["metadata"]["creationTimestamp"])
    served = wait_for(lambda: weight_version(newest["status"]["podIP"]), what="the new replica's version")
    assert served >= step - 3, (served, step)
    run.kubectl("scale", "samplerpool", pool, "-n", NAMESPACE, "--replicas=1")
    wait_for(lambda: router_ready() == 1 or None, timeout=180, what="the router down to one bf16 replica")
    wait_for(lambda: len(bf16_pods()) == 1 or None, timeout=180, what="one bf16 replica left")
    failed = [
        e for e in run.get("events", "-n", NAMESPACE)["items"] if e.get("reason") == "FailedPreStopHook"
    ]
    assert failed == []
    advances(run, 2)
    nothing_acknowledged_lost(run)
    run.kubectl("delete", "rlr", RUN, "-n", NAMESPACE, "--wait=false")  # frees the node for what follows
