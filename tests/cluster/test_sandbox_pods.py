"""Sandbox pods on the real control plane: a run with ``spec.rollout.sandbox`` gets the rollout
workers' account, Role and deny-all policy from the operator (under the chart's RBAC, so the
operator may grant what it grants); a warm pool logged in with that account's token creates,
leases, recycles and deletes its pods; the garbage collector deletes what a crashed worker left
when the run goes.  KWOK's pods run no container, so no command runs here: the executor is tested
on loopback (tests/sandbox/test_kubernetes_executor.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import yaml

from mixrl.operator.builders import sandbox as B
from mixrl.rl.sandbox.kubernetes import KubeConnection, KubePodClient, SandboxPods
from mixrl.rl.sandbox.lease import WORKER_LABEL

from .conftest import ROOT, Bed, OperatorProcess, wait_for


def sandbox_pods(cluster: Bed, namespace: str, worker: str | None = None) -> list[dict[str, Any]]:
    selector = ",".join(f"{k}={v}" for k, v in B.selector("demo").items())
    if worker:
        selector += f",{WORKER_LABEL}={worker}"
    items = cluster.get("pods", "-n", namespace, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def test_sandbox_pods_are_created_leased_recycled_and_cleaned_up(
    cluster: Bed, operator: OperatorProcess, namespace: str
) -> None:
    run = yaml.safe_load((ROOT / "examples" / "rlrun-minimal.yaml").read_text())
    run["metadata"] = {"name": "demo", "namespace": namespace}
    run["spec"].setdefault("rollout", {})["sandbox"] = {"poolSize": 2, "runtimeClassName": "gvisor"}
    # The API server refuses a pod naming a RuntimeClass that does not exist (KWOK runs none anyway).
    cluster.apply(
        {
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": {"name": "gvisor"},
            "handler": "runsc",
        }
    )
    cluster.apply(run)
    config = wait_for(
        lambda: next(
            (c for c in cluster.get("configmaps", "-n", namespace)["items"]
             if B.SANDBOX_TEMPLATE_KEY in c.get("data", {})),
            None,
        ),
        90, what="the sandbox pod template in the run's ConfigMap",
    )  # fmt: skip
    template = json.loads(config["data"][B.SANDBOX_TEMPLATE_KEY])
    account = "demo-rollout"
    wait_for(lambda: cluster.kubectl("get", "rolebinding", account, "-n", namespace, check=False).returncode == 0,
             60, what="the rollout workers' RoleBinding")  # fmt: skip
    policy = cluster.get("networkpolicy", "demo-sandbox", "-n", namespace)
    # an empty list comes back left out: Egress listed with no rule lets nothing out
    assert policy["spec"].get("egress", []) == [] and "Egress" in policy["spec"]["policyTypes"]
    rollout = cluster.get("statefulset", "demo-rollout", "-n", namespace)["spec"]["template"]["spec"]
    assert rollout["serviceAccountName"] == account
    assert not operator.denied(cluster), operator.denied(cluster)

    who = f"system:serviceaccount:{namespace}:{account}"
    for question, allowed in (
        ("create pods", "yes"), ("delete pods", "yes"), ("list pods", "yes"), ("get pods", "yes"),
        ("get secrets", "no"), ("create deployments", "no"), ("patch pods", "no"),
        ("create pods --subresource=exec", "no"), ("create rolebindings", "no"),
    ):  # fmt: skip
        answer = cluster.kubectl(
            "auth", "can-i", *question.split(), "-n", namespace, "--as", who, check=False
        )
        assert answer.stdout.strip() == allowed, (question, answer.stdout)

    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=1h").stdout.strip()
    connection = KubeConnection(
        cluster.state.server, namespace, token=token, ca_file=str(cluster.state.ca_file)
    )

    async def scenario() -> None:
        client = KubePodClient(connection)
        client.check()  # the account may list pods
        pods = SandboxPods(client, template, worker="demo-rollout-0", size=2, ready_timeout_s=60, poll_s=0.2)
        await pods.start()
        try:
            names = await asyncio.to_thread(
                wait_for, lambda: len([s for s in pods.state.slots.values() if s.state == "ready"]) == 2 or None,
                60, what="two ready sandbox pods",
            )  # fmt: skip
            assert names
            live = sandbox_pods(cluster, namespace, "demo-rollout-0")
            assert len(live) == 2
            for pod in live:
                [owner] = pod["metadata"]["ownerReferences"]
                assert (owner["kind"], owner["name"]) == ("RLRun", "demo")
                assert pod["spec"]["runtimeClassName"] == "gvisor"
                assert pod["spec"]["automountServiceAccountToken"] is False
            async with pods.lease(hold_s=30) as (leased, address):
                assert address and leased in {p["metadata"]["name"] for p in live}
            # released: that pod goes, a fresh one takes its place
            await asyncio.to_thread(
                wait_for,
                lambda: (names := {p["metadata"]["name"] for p in sandbox_pods(cluster, namespace, "demo-rollout-0")})
                and leased not in names and len(names) == 2,
                60, what="the leased pod replaced by a fresh one",
            )  # fmt: skip
        finally:
            await pods.close()
        assert sandbox_pods(cluster, namespace, "demo-rollout-0") == []  # shutdown deleted them all

        # A worker that dies without cleaning up: its pods stay until the run goes.
        crashed = SandboxPods(
            client, template, worker="demo-rollout-1", size=2, ready_timeout_s=60, poll_s=0.2
        )
        await crashed.start()
        await asyncio.to_thread(
            wait_for, lambda: len(sandbox_pods(cluster, namespace, "demo-rollout-1")) == 2, 60,
            what="the second worker's pods",
        )  # fmt: skip
        crashed._closing = True  # it stops, and deletes nothing
        assert crashed._loop is not None
        crashed._loop.cancel()
        await client.close()

    asyncio.run(scenario())
    assert len(sandbox_pods(cluster, namespace, "demo-rollout-1")) == 2
    crashed_pods = sandbox_pods(cluster, namespace, "demo-rollout-1")

    # Without sandbox pods in the spec, the operator deletes what they needed, and what was left.
    remove = json.dumps([{"op": "remove", "path": "/spec/rollout/sandbox"}])
    cluster.kubectl("patch", "rlrun", "demo", "-n", namespace, "--type=json", "-p", remove)
    made = (
        "rolebinding/demo-rollout",
        "role/demo-rollout",
        "serviceaccount/demo-rollout",
        "networkpolicy/demo-sandbox",
    )

    def left() -> list[str]:
        found = [m for m in made if cluster.kubectl("get", m, "-n", namespace, check=False).returncode == 0]
        return found + [p["metadata"]["name"] for p in sandbox_pods(cluster, namespace)]

    wait_for(left, 90, what="the sandbox objects deleted", equals=[])
    rollout = cluster.get("statefulset", "demo-rollout", "-n", namespace)["spec"]["template"]["spec"]
    assert rollout.get("serviceAccountName") in (None, "default")
    assert not operator.denied(cluster), operator.denied(cluster)
    # (with the run, the garbage collector would have deleted them: they name it as their owner)
    assert all(p["metadata"]["ownerReferences"][0]["uid"] for p in crashed_pods)
    cluster.kubectl("delete", "rlrun", "demo", "-n", namespace, "--wait=false")
