"""The distributed trainer's topology on the real control plane: examples/rlrun-mixed.yaml's
4 nodes × 8 GPUs as the operator builds them, and what the real StatefulSet and EndpointSlice
controllers make of it.

torchrun's c10d rendezvous runs on pod 0, and every rank finds it by the DNS name on the command
line, ``<run>-trainer-0.<run>-trainer.<namespace>.svc``.  Cluster DNS serves that name from the
headless Service's EndpointSlices: an endpoint whose ``hostname`` is the pod's ``spec.hostname``,
which the StatefulSet controller sets (with ``spec.subdomain``) from the pod's ordinal.  The test
bed runs no DNS server and KWOK runs no container, so this checks every record DNS would serve
and the ranks' command lines, not a rendezvous itself (tests/local/test_run.py runs torchrun's
rendezvous and a dead rank's restart on one machine).
"""

from __future__ import annotations

from typing import Any

from mixrl.operator.builders.podspec import RDZV_PORT

from .conftest import Bed, OperatorProcess, wait_for
from .test_mixed_run import RUN, example, pods, running

TRAINER = f"{RUN}-trainer"
POD_INDEX = "apps.kubernetes.io/pod-index"


def flag(command: list[str], name: str) -> str:
    return next(arg.split("=", 1)[1] for arg in command if arg.startswith(f"{name}="))


def test_every_trainer_rank_can_reach_the_rendezvous_on_pod_zero(
    cluster: Bed, operator: OperatorProcess, namespace: str
) -> None:
    doc = example(namespace)
    nodes, gpus = doc["spec"]["trainer"]["nodes"], doc["spec"]["trainer"]["gpusPerNode"]
    cluster.apply(doc)
    selector = "app.kubernetes.io/component=trainer"
    trainers = wait_for(
        lambda: (found := running(pods(cluster, namespace, selector))) and len(found) == nodes and found,
        120,
        what=f"{nodes} Running trainer pods",
    )
    service = cluster.get("service", TRAINER, "-n", namespace)
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS record per pod
    assert service["spec"]["publishNotReadyAddresses"] is True  # records before readiness
    statefulset = cluster.get("statefulset", TRAINER, "-n", namespace)
    assert statefulset["spec"]["serviceName"] == TRAINER
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"  # all ranks start together

    # The pod identity the StatefulSet controller gave each rank: name, DNS hostname and subdomain,
    # index; every rank runs the same torchrun command line, pointing at pod 0.
    by_index: dict[int, dict[str, Any]] = {}
    for pod in trainers:
        index = int(pod["metadata"]["labels"][POD_INDEX])
        assert pod["metadata"]["name"] == f"{TRAINER}-{index}"
        assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (f"{TRAINER}-{index}", TRAINER)
        by_index[index] = pod
    assert sorted(by_index) == list(range(nodes))
    commands = [
        next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")["command"] for pod in trainers
    ]
    assert all(command == commands[0] for command in commands)
    command = commands[0]
    assert (flag(command, "--nnodes"), flag(command, "--nproc-per-node")) == (str(nodes), str(gpus))
    assert flag(command, "--rdzv-backend") == "c10d" and flag(command, "--rdzv-id") == RUN
    zero = by_index[0]["spec"]
    rendezvous = f"{zero['hostname']}.{zero['subdomain']}.{namespace}.svc:{RDZV_PORT}"
    assert flag(command, "--rdzv-endpoint") == rendezvous

    # The records cluster DNS would serve for that name: pod 0's address under its hostname, in
    # the headless Service's EndpointSlices, with the rendezvous port named.
    def endpoints() -> dict[str, str]:
        slices = cluster.get(
            "endpointslices", "-n", namespace, "-l", f"kubernetes.io/service-name={TRAINER}"
        )["items"]
        found = {}
        for endpoint_slice in slices:
            assert {"name": "rdzv", "port": RDZV_PORT, "protocol": "TCP"} in endpoint_slice["ports"]
            for endpoint in endpoint_slice.get("endpoints") or []:
                if endpoint.get("hostname"):
                    found[endpoint["hostname"]] = endpoint["addresses"][0]
        return found

    records = wait_for(lambda: len(found := endpoints()) == nodes and found, 60, what="trainer endpoints")
    assert records == {pod["spec"]["hostname"]: pod["status"]["podIP"] for pod in by_index.values()}
