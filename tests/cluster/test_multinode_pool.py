"""A pool whose replica spans two nodes (issue #31), on the bed with LeaderWorkerSet's own manager.

LWS v0.9 (built from its Go module by scripts/k8s-addons.sh) runs beside the control plane with its
CRD applied and its webhooks registered (mixrl.devcluster.addons): its pod webhook is what labels a
group's pods and gives them ``LWS_LEADER_ADDRESS`` and ``LWS_WORKER_INDEX``, which the engines'
SGLang command lines name.  The operator turns a run's 16-GPU H200 pool into a LeaderWorkerSet of
groups of two 8-GPU pods; each group is placed on two nodes; scaling the SamplerPool through its
scale subresource, as the built-in autoscaler and KEDA do, adds a group of two more.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mixrl.api.gpus import GPU_RESOURCE
from mixrl.devcluster.addons import start_addon, stop_addon
from mixrl.operator.builders.lws import LEADER_ADDRESS_ENV, WORKER_INDEX_ENV, WORKER_INDEX_LABEL

from .conftest import Bed, start_operator, stop_operator, wait_for

RUN, POOL = "wide", "h200-tp16"
LWS = f"{RUN}-{POOL}-lws"
SAMPLER = f"app.kubernetes.io/component=sampler,mixrl.dev/pool={POOL}"


@pytest.fixture(scope="module")
def lws(cluster: Bed) -> Iterator[Bed]:
    """LWS's manager on the shared bed, stopped after this module (its webhooks withdrawn), as the
    other add-ons are: left running, they slowed the later tests of the control-plane lane."""
    if not cluster.handle.running().get("lws"):
        start_addon(cluster.handle, cluster.state, "lws", log=lambda line: print(line, file=sys.stderr))
    yield cluster
    stop_addon(cluster.handle, cluster.state, "lws")


def wide_run(namespace: str) -> dict[str, Any]:
    """A CPU trainer (out of the GPU nodes' way) and one pool of 16 H200 GPUs per replica: two of
    the bed's 8-GPU H200 nodes each.  No autoscaler: the test scales the pool itself."""
    return {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": RUN, "namespace": namespace},
        "spec": {
            "model": {"path": "/weights/base/wide-70b", "parametersBillions": 70},
            "trainer": {"gpuType": "cpu", "gpusPerNode": 0},
            "samplerPools": [
                {
                    "name": POOL,
                    "gpuType": "H200",
                    "weightPrecision": "fp8",
                    "gpusPerReplica": 16,
                    "minReplicas": 1,
                    "maxReplicas": 2,
                }
            ],
            "autoscaling": {"engine": "none"},
        },
    }


def placed(cluster: Bed, namespace: str) -> list[dict[str, Any]]:
    return [
        pod
        for pod in cluster.get("pods", "-n", namespace, "-l", SAMPLER)["items"]
        if pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp")
    ]


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
    return {e["name"]: e.get("value", "") for e in engine.get("env", [])}


def check_groups(cluster: Bed, namespace: str, pods: list[dict[str, Any]], groups: int) -> None:
    """``groups`` groups of a leader and a worker, every pod on a node of its own with 8 of its H200
    GPUs, each carrying what LWS's pod webhook adds."""
    h200 = set(cluster.gpu_nodes("H200"))
    nodes = [pod["spec"]["nodeName"] for pod in pods]
    assert len(set(nodes)) == len(nodes) == 2 * groups and set(nodes) <= h200, nodes
    names = sorted(pod["metadata"]["name"] for pod in pods)
    expected = sorted(name for g in range(groups) for name in (f"{LWS}-{g}", f"{LWS}-{g}-1"))
    assert names == expected
    for pod in pods:
        (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
        assert engine["resources"]["limits"][GPU_RESOURCE] == "8"
        env, labels = env_of(pod), pod["metadata"]["labels"]
        group = labels["leaderworkerset.sigs.k8s.io/group-index"]
        # What SGLang's --node-rank and --dist-init-addr expand to in this pod.
        name = pod["metadata"]["name"]
        rank = "0" if name == f"{LWS}-{group}" else name.rsplit("-", 1)[1]
        assert (env.get(WORKER_INDEX_ENV), labels.get(WORKER_INDEX_LABEL), rank) == (rank, rank, rank), name
        assert env[LEADER_ADDRESS_ENV] == f"{LWS}-{group}.{LWS}.{namespace}"
        assert f"$({LEADER_ADDRESS_ENV}):20000" in engine["command"]
        assert f"$({WORKER_INDEX_ENV})" in engine["command"]
    # The leader's address resolves through the headless Service LWS made under its own name.
    assert cluster.get("service", LWS, "-n", namespace)["spec"]["clusterIP"] == "None"


def test_a_two_node_pool_is_placed_and_scaled_through_the_scale_subresource(
    lws: Bed, namespace: str, tmp_path: Path
) -> None:
    cluster = lws
    operator = start_operator(cluster, tmp_path)
    try:
        cluster.apply(wide_run(namespace))
        pods = wait_for(
            lambda: found if len(found := placed(cluster, namespace)) == 2 else None,
            60,
            what="the first group's two pods placed",
        )
        check_groups(cluster, namespace, pods, groups=1)
        # The router's Service (the pool's DNS name) selects the leaders alone.
        service = cluster.get("service", f"{RUN}-{POOL}", "-n", namespace)
        assert service["spec"]["selector"][WORKER_INDEX_LABEL] == "0"
        # Scaled as the autoscaler scales: the SamplerPool's scale subresource.
        cluster.kubectl("scale", "samplerpool", f"{RUN}-{POOL}", "-n", namespace, "--replicas=2")
        wait_for(
            lambda: cluster.get("leaderworkerset", LWS, "-n", namespace)["spec"]["replicas"],
            30,
            what="the LeaderWorkerSet at 2 groups",
            equals=2,
        )
        pods = wait_for(
            lambda: found if len(found := placed(cluster, namespace)) == 4 else None,
            60,
            what="two groups' four pods placed",
        )
        check_groups(cluster, namespace, pods, groups=2)
        path = f"/apis/mixrl.dev/v1alpha1/namespaces/{namespace}/samplerpools/{RUN}-{POOL}/scale"

        def scale() -> tuple[int, int]:
            read = json.loads(cluster.kubectl("get", "--raw", path).stdout)
            return read["spec"]["replicas"], read["status"].get("replicas", 0)

        # status.replicas: the LeaderWorkerSet's groups, through the SamplerPool's status.
        wait_for(scale, 30, what="the scale subresource at 2 groups", equals=(2, 2))
    finally:
        stop_operator(operator)
