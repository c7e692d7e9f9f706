"""A pool whose replica spans nodes: validation, its LeaderWorkerSet and the objects around it.

The builders are pure, so this checks the objects they return; tests/sglang checks the SGLang
command lines against SGLang's own parser, tests/cluster/test_multinode_pool.py places and scales
the LeaderWorkerSet with LWS's controller and pod webhook on a real control plane.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from mixrl.api.errors import InvalidSpec
from mixrl.api.gpus import GPU_RESOURCE, replica_nodes
from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import DIST_INIT_PORT, ENGINE_PORT, ResolvedRun, resolve
from mixrl.operator.builders import labels as L
from mixrl.operator.builders.lws import (
    LWS_API_VERSION,
    WORKER_INDEX_LABEL,
    leader_worker_set,
    lws_name,
)
from mixrl.operator.builders.network import network_policies
from mixrl.operator.builders.objects import AUTH_TOKEN_HASH, HASH_ANNOTATION, BuildOptions, Owner, Scrapers
from mixrl.operator.builders.pools import pool_children
from mixrl.operator.controller.reconcile import LWS_MISSING
from mixrl.operator.kube.rbac import LEADERWORKERSETS, RECONCILER, permissions

from .support import DEPLOYMENTS, NAMESPACE, SAMPLERPOOLS, conditions, create, eventually, small_run

Obj = dict[str, Any]
OWNER = Owner("mixrl.dev/v1alpha1", "SamplerPool", "demo-big", "uid-1")


def run_with(**pool: Any) -> RLRun:
    manifest = small_run(pools=[{"name": "big", "gpuType": "H100", "weightPrecision": "fp8", **pool}])
    run = parse_document(manifest)
    assert isinstance(run, RLRun)
    return run


def two_node_run() -> ResolvedRun:
    return resolve(run_with(gpusPerReplica=16, minReplicas=1, maxReplicas=4))


def children(resolved: ResolvedRun, replicas: int = 1) -> dict[str, Obj]:
    pool = resolved.pools[0]
    return {obj["kind"]: obj for obj in pool_children(resolved, pool, replicas, OWNER, BuildOptions())}


def by_name(items: list[Obj]) -> dict[str, Obj]:
    return {item["name"]: item for item in items}


def env_names(container: Obj) -> set[str]:
    return {env["name"] for env in container.get("env", [])}


def test_nodes_per_replica_follow_the_gpu_table() -> None:
    assert [replica_nodes("H100", gpus) for gpus in (1, 8, 16, 64)] == [1, 1, 2, 8]
    assert replica_nodes("cpu", 16) == 1  # emulated: nothing is placed on a GPU node
    assert two_node_run().pools[0].nodes_per_replica == 2
    assert resolve(run_with(gpusPerReplica=8)).pools[0].nodes_per_replica == 1


@pytest.mark.parametrize(
    ("pool", "line"),
    [
        (
            {"gpusPerReplica": 12},
            "spec.samplerPools[0].gpusPerReplica: 12 GPUs per replica span nodes of 8 H100 GPUs: a replica"
            " across nodes takes whole nodes, so use a multiple of 8",
        ),
        (
            {"gpusPerReplica": 16, "engine": "torch", "weightPrecision": "bf16"},
            "spec.samplerPools[0].engine: a replica of 16 H100 GPUs spans nodes, which only engine sglang"
            " does (the torch engine runs on one node)",
        ),
    ],
)
def test_a_replica_across_nodes_that_cannot_be_built_is_refused_in_one_line(pool: Obj, line: str) -> None:
    with pytest.raises(InvalidSpec) as refused:
        run_with(**pool)
    assert refused.value.first_line == line


def test_a_one_node_pool_stays_a_deployment() -> None:
    kinds = children(resolve(run_with(gpusPerReplica=8)))
    assert set(kinds) == {"Service", "Deployment"}
    assert WORKER_INDEX_LABEL not in kinds["Service"]["spec"]["selector"]


def test_a_two_node_pool_is_a_leader_worker_set_of_groups_of_two() -> None:
    resolved = two_node_run()
    pool = resolved.pools[0]
    objects = children(resolved, replicas=3)
    assert set(objects) == {"Service", "LeaderWorkerSet"}
    lws = objects["LeaderWorkerSet"]
    assert (
        (lws["apiVersion"], lws["metadata"]["name"])
        == (LWS_API_VERSION, "demo-big-lws")
        == (
            LWS_API_VERSION,
            lws_name(pool),
        )
    )
    assert lws["metadata"]["ownerReferences"] == [OWNER.reference()]
    spec = lws["spec"]
    assert spec["replicas"] == 3  # the SamplerPool's replicas: groups, not pods
    template = spec["leaderWorkerTemplate"]
    assert template["size"] == 2
    # Workers start with their leader: the leader's server is ready only once every node joined.
    assert spec["startupPolicy"] == "LeaderCreated"
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    for member in ("leaderTemplate", "workerTemplate"):
        pod = template[member]
        assert L.selector_labels("demo", "sampler", "big").items() <= pod["metadata"]["labels"].items()
        engine = by_name(pod["spec"]["containers"])["engine"]
        # Each pod holds one node's share of the replica's 16 GPUs.
        assert engine["resources"]["limits"][GPU_RESOURCE] == "8"
        assert [c["name"] for c in pod["spec"]["initContainers"]] == ["weights-init"]


def test_a_new_token_rolls_both_the_leaders_and_the_workers() -> None:
    """The workers hold the token too (SGLang's environment): both templates carry its hash."""
    resolved = two_node_run()
    pool = resolved.pools[0]
    hashes = []
    for hashed in ("0123456789abcdef", "fedcba9876543210"):
        (lws,) = (
            obj
            for obj in pool_children(resolved, pool, 1, OWNER, BuildOptions(), token_hash=hashed)
            if obj["kind"] == "LeaderWorkerSet"
        )
        group = lws["spec"]["leaderWorkerTemplate"]
        for member in ("leaderTemplate", "workerTemplate"):
            assert group[member]["metadata"]["annotations"][AUTH_TOKEN_HASH] == hashed
        hashes.append(lws["metadata"]["annotations"][HASH_ANNOTATION])
    assert hashes[0] != hashes[1], "the new token is a change to write"


def test_sglangs_multi_node_flags_name_lws_variables_and_the_whole_tensor_parallel_size() -> None:
    template = children(two_node_run())["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    for member in ("leaderTemplate", "workerTemplate"):
        command = by_name(template[member]["spec"]["containers"])["engine"]["command"]
        flags = dict(itertools.pairwise(command))
        assert flags["--tp-size"] == "16"
        assert flags["--nnodes"] == "2"
        # LWS's pod webhook sets both in every container (LWS_WORKER_INDEX: 0 on the leader).
        assert flags["--node-rank"] == "$(LWS_WORKER_INDEX)"
        assert flags["--dist-init-addr"] == f"$(LWS_LEADER_ADDRESS):{DIST_INIT_PORT}"


def test_only_the_leader_serves_and_syncs_weights() -> None:
    objects = children(two_node_run())
    template = objects["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    lead = by_name(leader["spec"]["containers"])
    assert set(lead) == {"engine", "weight-sync"}
    assert lead["engine"]["ports"] == [{"name": "engine", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
    assert {"readinessProbe", "startupProbe", "livenessProbe", "lifecycle"} <= set(lead["engine"])
    assert "readinessProbe" in lead["weight-sync"]  # the gate: labelled with a version
    assert leader["metadata"]["annotations"].get("prometheus.io/scrape") == "true"
    # SGLang's ranks 1+ run schedulers only: no HTTP, so nothing to probe, drain, scrape or reload.
    (engine,) = worker["spec"]["containers"]
    assert engine["name"] == "engine"
    assert not {"ports", "readinessProbe", "startupProbe", "livenessProbe", "lifecycle"} & set(engine)
    assert "prometheus.io/scrape" not in worker["metadata"]["annotations"]
    # Every member reads the shared weight store: SGLang's update has each rank load its shard there.
    for pod in (leader, worker):
        assert any(v["name"] == "weights" for v in pod["spec"]["volumes"])
    # The router's Service (the pool's DNS name) lists the leaders alone.
    service = objects["Service"]
    assert service["metadata"]["name"] == "demo-big"
    assert service["spec"]["selector"] == {
        **L.selector_labels("demo", "sampler", "big"),
        WORKER_INDEX_LABEL: "0",
    }


def test_engine_pods_reach_each_other_on_every_port_only_with_a_replica_across_nodes() -> None:
    def sampler_ingress(resolved: ResolvedRun) -> list[Obj]:
        policies = network_policies(resolved, OWNER, Scrapers())
        (sampler,) = [p for p in policies if p["metadata"]["name"] == "demo-sampler-ingress"]
        ingress: list[Obj] = sampler["spec"]["ingress"]
        return ingress

    peers = {"from": [{"podSelector": {"matchLabels": L.selector_labels("demo", "sampler")}}]}
    assert peers in sampler_ingress(two_node_run())
    assert peers not in sampler_ingress(resolve(run_with(gpusPerReplica=8)))


def test_the_builder_refuses_a_one_node_pool() -> None:
    resolved = resolve(run_with(gpusPerReplica=8))
    with pytest.raises(ValueError, match="across nodes"):
        leader_worker_set(resolved, resolved.pools[0], {}, 1, {}, {}, OWNER)


def test_the_operator_may_write_and_watch_leader_worker_sets() -> None:
    key = (LEADERWORKERSETS.group, LEADERWORKERSETS.plural)
    assert RECONCILER[key] == {"get", "list", "create", "patch", "delete"}  # list: the resync
    assert {"list", "watch"} <= permissions(clusterwide=True)[key]


async def test_a_cluster_without_lws_gets_one_line_and_no_deployment(api: Any, operator: Any) -> None:
    # The emulated API server serves no leaderworkerset.x-k8s.io: the pool says what to install.
    manifest = small_run(
        pools=[{"name": "big", "gpuType": "H100", "weightPrecision": "fp8", "gpusPerReplica": 16}]
    )
    async with operator():
        await create(api, manifest)

        def progressing() -> Obj | None:
            pool = api.live(SAMPLERPOOLS, NAMESPACE, "demo-big")
            condition = conditions(pool or {}).get("Progressing")
            return condition if condition and condition["status"] == "False" else None

        condition = await eventually(progressing, what="the pool's Progressing False")
        assert condition["message"] == f"LeaderWorkerSet/demo-big-lws: {LWS_MISSING}"
        assert api.live(DEPLOYMENTS, NAMESPACE, "demo-big") is None
