"""A pool whose replica spans nodes, as a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, LWS v0.9).

One replica is one LWS group of ``nodes_per_replica`` pods, one per node: the leader (worker index
0) and its workers.  Each runs SGLang with the replica's whole ``--tp-size`` and its multi-node
flags, ``--nnodes``, ``--node-rank $(LWS_WORKER_INDEX)`` and ``--dist-init-addr
$(LWS_LEADER_ADDRESS):<port>``; LWS's pod webhook puts both variables into every container (its
``AddLWSVariables``: the leader's address is ``<lws>-<group>.<lws>.<namespace>``, resolved through
the headless Service LWS creates under the LWS's own name, which lists pods that are not ready yet,
as the workers need while the server is still forming).  Only the leader serves HTTP (SGLang's
nodes of rank 1 and above run schedulers only), so only the leader has the serving port, the
probes, the drain hook and the weight-sync sidecar: SGLang's ``/update_weights_from_disk`` on the
leader has every rank of every node load its shard from the path it names in the shared weight
store.  Every member starts from the store's checkpoint through its own ``weights-init``.

The LWS is named ``<run>-<pool>-lws``: the pool's own headless Service keeps ``<run>-<pool>`` (the
router's DNS name for the pool) and selects the leaders alone, and the leaders' pod names,
``<run>-<pool>-lws-<group>``, are the two segments after the pool's name that the autoscaler's
queries already match for a Deployment's pods (mixrl.operator.autoscaling.promql), while the
workers' (``…-<group>-<index>``) never match; the workers serve no metrics either.

The SamplerPool's replicas become the LWS's ``spec.replicas`` (its groups), so the SamplerPool's
scale subresource drives the pool as it drives a Deployment.  Pure: no I/O.
"""

from __future__ import annotations

from mixrl.api.kube_types import Obj
from mixrl.api.resolve import ResolvedPool, ResolvedRun
from mixrl.api.rules import LWS_NAME_SUFFIX
from mixrl.operator.builders.objects import Owner, metadata

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"

# Names fixed by LWS v0.9's API (api/leaderworkerset/v1/leaderworkerset_types.go).
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
"""Set by LWS's pod webhook on every pod of a group: ``0`` on the leader."""
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"

LEADER_LABELS = {WORKER_INDEX_LABEL: "0"}
"""What the pool's Service adds to its selector: leaders only (the workers serve no HTTP)."""

STARTUP_POLICY = "LeaderCreated"
"""Workers are created with their leader, not after it is Ready: the leader's SGLang becomes ready
only once every node has joined its rendezvous (``LeaderReady`` would wait forever)."""
RESTART_POLICY = "RecreateGroupOnPodRestart"
"""A member that restarts leaves its peers' collective communicators broken: the whole group is
recreated (LWS's default, spelled out)."""


def lws_name(pool: ResolvedPool) -> str:
    """``<run>-<pool>-lws``: the LeaderWorkerSet of a pool whose replica spans nodes."""
    return f"{pool.object_name}{LWS_NAME_SUFFIX}"


def leader_worker_set(
    resolved: ResolvedRun,
    pool: ResolvedPool,
    labels: dict[str, str],
    replicas: int,
    leader: Obj,
    worker: Obj,
    owner: Owner,
) -> Obj:
    """The pool's LeaderWorkerSet: ``replicas`` groups of ``pool.nodes_per_replica`` pods, the leader
    from the pod template ``leader``, the others from ``worker``.  Rolled one group at a time with
    no surge, as a GPU pool's Deployment is (a spare group of whole nodes is rarer still)."""
    if pool.nodes_per_replica < 2:
        raise ValueError(f"pool {pool.name}: a LeaderWorkerSet is for replicas across nodes")
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": metadata(lws_name(pool), resolved.namespace, labels, owner),
        "spec": {
            "replicas": replicas,
            "startupPolicy": STARTUP_POLICY,
            "leaderWorkerTemplate": {
                "size": pool.nodes_per_replica,
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
        },
    }
