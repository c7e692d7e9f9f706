"""One launch table: the command line that starts each component of a run, in a pod or on a laptop.

:func:`component_command` is the only place that spells a component's command line; the operator's
builders put it into each container, and ``mixrl run`` starts it as a local process.  What
legitimately differs between the two is not a second code path but an input, :class:`Where`:

- the addresses: servers listen on every interface in a pod and on loopback on a laptop, clients
  reach the buffer and the router by cluster DNS or by loopback URL;
- the ports: a pod owns its network namespace, so each server takes its fixed port
  (:data:`~mixrl.api.resolve.ROUTER_PORT`...); on a laptop each listens on port 0 and writes the
  port it bound to a file, which the supervisor reads back (no race for a "free" port);
- the files: where the resolved run, the run's token, the buffer's logs, the trainer's run
  directory and the engines' first checkpoint lie;
- how the router finds each pool's replicas: the pool's headless Service (DNS) in a cluster, a
  replicas file on a laptop;
- how new weights reach the engines: the weight-sync sidecar of every engine pod in a cluster,
  the trainer's reload through the router on a laptop (every engine there reads the store as is).

Pure: no I/O, no import of the components (``mixrl.api`` sits below them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from mixrl.api.resolve import BUFFER_PORT, ENGINE_PORT, ROUTER_PORT, ResolvedPool, ResolvedRun

Component = Literal[
    "trainer",
    "buffer",
    "router",
    "rollout",
    "engine",
    "weight-sync",
    "weights-init",
    "evaluator",
    "model-init",
]
"""What a run starts: four services, one engine per pool replica, and beside each engine in a pod the
weight-sync sidecar and its init container (``weights-init``: the starting checkpoint, then exit);
with ``evaluation.sampler: bf16`` also the evaluator and its own engine (pool ``evaluator``); in a
trainer pod of a ``tiny:`` model, the init container that builds it (``model-init``: ``mixrl run``
builds it itself, before any component starts)."""
COMPONENTS: tuple[Component, ...] = get_args(Component)
SERVER_PORTS: dict[str, int] = {"buffer": BUFFER_PORT, "router": ROUTER_PORT, "engine": ENGINE_PORT}
"""The fixed port of each server where it owns its network namespace (a pod)."""

LABELLED_FILE = "labelled"
"""In an engine pod's weights directory: written by the weight-sync sidecar while its engine is up
and labels its tokens with a version (the file holds it), removed while the engine is down or
unlabelled.  The pod's readiness gate (mixrl.operator.builders.pools), so no request reaches an engine
that would label its tokens ``default``."""

SANDBOX_TEMPLATE_FILE = "sandbox-pod.json"
"""Beside the resolved run in its ConfigMap (``spec.rollout.sandbox``): the sandbox pod every rollout
worker creates for its warm pool (mixrl.operator.builders.sandbox builds it, the worker reads it)."""

AUTH_TOKEN_FLAG = "--auth-token-file"
"""How every mixrl component is given the run's token (docs/auth.md)."""
AUTH_TOKEN_ENV = "MIXRL_AUTH_TOKEN"
"""SGLang takes its key on the command line only: a pod sets this variable from the run's Secret and
the kubelet expands ``$(MIXRL_AUTH_TOKEN)`` in the command, so the pod spec never holds the token."""


ONE_MACHINE = "standalone"
"""``Where.rendezvous`` for a trainer whose ranks all run on this machine (torchrun ``--standalone``)."""


TORCHRUN_STOP_MARGIN = 10
"""Seconds of ``trainer.stopGraceSeconds`` that torchrun keeps for itself."""


def ranks_stop_seconds(stop_grace_seconds: int) -> int:
    """How long a stopped trainer's ranks have to end their step and save a checkpoint: torchrun
    waits this long for them (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` on the pods, not its own 30 s)."""
    return stop_grace_seconds - TORCHRUN_STOP_MARGIN


@dataclass(frozen=True)
class Where:
    """Everything about a component's command line that depends on where the run's processes live."""

    program: tuple[str, ...]
    """How ``mixrl`` is run: ``("mixrl",)`` in an image, the interpreter with ``-m mixrl.cli`` locally."""
    host: str
    """The address servers listen on: ``0.0.0.0`` in a container, ``127.0.0.1`` on a laptop."""
    config: str
    """Path of the resolved run (``ResolvedRun`` as JSON) that every component reads."""
    auth_token_file: str
    """Path of the run's token."""
    buffer_dir: str
    """The buffer's append-only logs."""
    trainer_run_dir: str
    """The trainer's checkpoints and metrics.jsonl."""
    buffer_url: str | None = None
    """How clients reach the buffer (None until it is known: a laptop's buffer picks its port)."""
    router_url: str | None = None
    engine_model_path: str | None = None
    """What an engine loads when it starts."""
    metrics_port: int | None = None
    """Every mixrl service also serves /metrics here (a pod's metrics port); None: no extra port."""
    port_dir: str | None = None
    """None: each server listens on its fixed port (:data:`SERVER_PORTS`).  A directory: each listens
    on port 0 and writes the port it bound to ``<port_dir>/<process>.port`` (:func:`port_file`)."""
    replicas_file: str | None = None
    """How the router finds each pool's replicas: None resolves the pool's headless Service (cluster
    DNS); a file lists them (``{pool: [url, ...]}``)."""
    reload_through_router: bool = False
    """The trainer tells the engines (through the router) to load each version it publishes; off
    where every engine pod's weight-sync sidecar converts the version and reloads its own engine."""
    rendezvous: str | None = None
    """torchrun's c10d endpoint for a trainer of more than one process, across the trainer's nodes
    (a pod); :data:`ONE_MACHINE` runs all of the trainer's processes on this machine (a laptop)."""
    torchrun: tuple[str, ...] = ("torchrun",)
    """How torchrun is run: the image's ``torchrun``, or this interpreter's ``-m torch.distributed.run``."""
    trainer_model_path: str | None = None
    """The trainer's initial checkpoint; None: the spec's ``model.path``.  Where the run's model is
    ``tiny:<kind>``, the directory it was built into (on a laptop) or the link ``model-init`` points
    at it (in a pod)."""
    buffer_model_path: str | None = None
    """The model directory whose config.json gives the buffer the vocabulary it checks token ids
    against (a laptop: the trainer's); None: the spec's ``model.path`` (a buffer pod mounts no model,
    and the trainer checks the ids)."""
    model_cache: str | None = None
    """Where ``model-init`` keeps the tiny models it builds (only where it runs: a pod)."""
    tokenizer: str | None = None
    """The rollout worker's tokenizer JSON; None: the built-in filetree one."""
    worker_index: str = "0"
    """The rollout worker's index (in a StatefulSet pod ``$(POD_INDEX)``, which the kubelet expands;
    on a laptop each of the ``rollout.workers`` processes' own, 0 to workers - 1)."""
    hold_when_done: bool = False
    """The trainer keeps running (serving its metrics) after its last step instead of exiting: in a
    pod, whose StatefulSet would restart a container that exits; the operator then scales it down."""
    engine_weight_version: int | None = None
    """The version at ``engine_model_path`` when the engine is told it (else the engine's default)."""
    engine_weights_dir: str | None = None
    """Where the weight-sync containers write the pool's conversion (only where they run: a pod)."""
    engine_url: str | None = None
    """The engine the weight-sync sidecar reloads (its own pod's)."""
    engine_node_rank: str | None = None
    """A replica across nodes (``nodes_per_replica`` above 1): this node's rank among them, 0 the
    leader's (in a LeaderWorkerSet pod ``$(LWS_WORKER_INDEX)``, which the kubelet expands)."""
    engine_dist_init_addr: str | None = None
    """A replica across nodes: ``host:port`` of its leader's rendezvous, which every node dials."""
    evaluator_engine_url: str | None = None
    """The evaluator's own engine (``evaluation.sampler: bf16``), which only the evaluator reloads."""


def process_name(
    component: Component, pool: ResolvedPool | None = None, replica: int = 0, workers: int = 1
) -> str:
    """The process's name among the run's (its log and port files on a laptop).  For ``rollout``,
    ``replica`` is the worker's index among ``workers`` (``rollout.workers``): ``rollout`` when
    there is one, ``rollout-<index>`` when there are several."""
    if component == "engine":
        assert pool is not None, "an engine belongs to a pool"
        return f"engine-{pool.name}-{replica}"
    if component == "rollout" and workers > 1:
        assert 0 <= replica < workers, f"rollout worker {replica} of {workers}"
        return f"rollout-{replica}"
    return component


def port_file(where: Where, component: Component, pool: ResolvedPool | None = None, replica: int = 0) -> str:
    assert where.port_dir is not None, "servers listen on their fixed ports"
    return f"{where.port_dir}/{process_name(component, pool, replica)}.port"


def weights_volume_path(store: str) -> str | None:
    """The filesystem path of the weight store, or None when it is an object store URL."""
    if store.startswith("file://"):
        return store.removeprefix("file://") or "/"
    if store.startswith("/"):
        return store
    return None


def _listen(
    where: Where, component: Component, pool: ResolvedPool | None, replica: int, metrics: bool
) -> list[str]:
    if where.port_dir is None:
        args = ["--host", where.host, "--port", str(SERVER_PORTS[component])]
    else:
        args = [
            "--host",
            where.host,
            "--port",
            "0",
            "--port-file",
            port_file(where, component, pool, replica),
        ]
    if metrics and where.metrics_port is not None:
        args += ["--metrics-port", str(where.metrics_port)]
    return args


def _known(value: str | None, what: str) -> str:
    if value is None:
        raise ValueError(f"{what} is not known yet: start the component it names first")
    return value


def _metrics(where: Where) -> list[str]:
    return [] if where.metrics_port is None else ["--metrics-port", str(where.metrics_port)]


def _auth(where: Where) -> list[str]:
    return [AUTH_TOKEN_FLAG, where.auth_token_file]


def _trainer(resolved: ResolvedRun, where: Where) -> list[str]:
    args = [
        "trainer",
        "--config",
        where.config,
        "--buffer",
        _known(where.buffer_url, "the buffer's URL"),
        *(["--router", _known(where.router_url, "the router's URL")] if where.reload_through_router else []),
        "--run-dir",
        where.trainer_run_dir,
        *(["--model-path", where.trainer_model_path] if where.trainer_model_path is not None else []),
        *_metrics(where),
        *_auth(where),
        *(["--hold-when-done"] if where.hold_when_done else []),
    ]
    spec = resolved.trainer.spec
    nproc = spec.processes_per_node
    if where.rendezvous is None or (spec.nodes == 1 and nproc == 1):
        return [*where.program, *args]
    if where.rendezvous == ONE_MACHINE:  # every rank here: the same world size, one node
        return [
            *where.torchrun,
            "--standalone",
            f"--nproc-per-node={spec.nodes * nproc}",
            "-m",
            "mixrl.cli",
            *args,
        ]
    return [
        *where.torchrun,
        f"--nnodes={spec.nodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={where.rendezvous}",
        f"--rdzv-id={resolved.name}",
        "-m",
        "mixrl.cli",
        *args,
    ]


def _engine(resolved: ResolvedRun, pool: ResolvedPool, where: Where, replica: int) -> list[str]:
    if pool.engine == "sglang":
        return [
            "python3",
            "-m",
            "sglang.launch_server",
            "--model-path",
            _known(where.engine_model_path, "the engines' first checkpoint"),
            *_listen(where, "engine", pool, replica, metrics=False),
            # SGLang's own token check (every route but health and metrics), with the run's token.
            "--api-key",
            f"$({AUTH_TOKEN_ENV})",
            *_nodes(pool, where),
            *pool.engine_args,
        ]
    store = weights_volume_path(resolved.weights.store)
    version = where.engine_weight_version
    return [
        *where.program,
        "engine",
        "--model-path",
        _known(where.engine_model_path, "the engines' first checkpoint"),
        # Weight updates load only from the run's weight store.
        *(["--weight-root", store] if store is not None else []),
        *_listen(where, "engine", pool, replica, metrics=False),
        *(["--weight-version", str(version)] if version is not None else []),
        *_auth(where),
        *pool.engine_args,
    ]


def _nodes(pool: ResolvedPool, where: Where) -> list[str]:
    """SGLang's multi-node flags for a replica across nodes: how many, which one this is, and where
    they meet (the ``--tp-size`` in the pool's arguments is the replica's whole GPU count)."""
    if pool.nodes_per_replica == 1:
        return []
    return [
        "--nnodes",
        str(pool.nodes_per_replica),
        "--node-rank",
        _known(where.engine_node_rank, "this node's rank in its replica"),
        "--dist-init-addr",
        _known(where.engine_dist_init_addr, "the replica leader's address"),
    ]


def _weight_sync(pool: ResolvedPool, where: Where, once: bool) -> list[str]:
    assert where.engine_weights_dir is not None, "weight-sync runs beside an engine in a pod"
    command = [
        *where.program,
        "engine-sync",
        "--config",
        where.config,
        "--pool",
        pool.name,
        "--output",
        where.engine_weights_dir,
    ]
    # --once (the init container) never calls the engine, so it needs no token.
    if once:
        return [*command, "--once"]
    assert where.engine_url is not None, "the sidecar reloads its own engine"
    return [*command, "--engine-url", where.engine_url, *_auth(where)]


def component_command(
    resolved: ResolvedRun,
    component: Component,
    where: Where,
    pool: ResolvedPool | None = None,
    replica: int = 0,
) -> list[str]:
    """The full command line (program first) that starts ``component`` of ``resolved`` at ``where``;
    ``pool`` (and the replica's index) for an engine and its weight-sync containers."""
    if component == "trainer":
        return _trainer(resolved, where)
    if component == "buffer":
        return [
            *where.program,
            "buffer",
            "--config",
            where.config,
            "--dir",
            where.buffer_dir,
            *(["--model-path", where.buffer_model_path] if where.buffer_model_path is not None else []),
            *_listen(where, "buffer", None, 0, metrics=True),
            *_auth(where),
        ]
    if component == "router":
        replicas = [] if where.replicas_file is None else ["--replicas", where.replicas_file]
        # Mismatch-aware routing reads the trainer's per-pool mismatch from the buffer.
        mismatch = (
            ["--buffer", _known(where.buffer_url, "the buffer's URL")] if resolved.health.routing else []
        )
        return [
            *where.program,
            "router",
            "--config",
            where.config,
            *replicas,
            *mismatch,
            *_listen(where, "router", None, 0, metrics=True),
            *_auth(where),
        ]
    if component == "rollout":
        return [
            *where.program,
            "rollout",
            "--config",
            where.config,
            "--router",
            _known(where.router_url, "the router's URL"),
            "--buffer",
            _known(where.buffer_url, "the buffer's URL"),
            *(["--tokenizer", where.tokenizer] if where.tokenizer is not None else []),
            "--worker-index",
            where.worker_index,
            *_metrics(where),
            *_auth(where),
        ]
    if component == "model-init":
        return [
            *where.program,
            "prepare-model",
            "--config",
            where.config,
            "--cache",
            _known(where.model_cache, "the tiny models' cache"),
            "--output",
            _known(where.trainer_model_path, "the trainer's model directory"),
        ]
    if component == "evaluator":
        return [
            *where.program,
            "evaluate",
            "--config",
            where.config,
            "--engine",
            _known(where.evaluator_engine_url, "the evaluator engine's URL"),
            "--buffer",
            _known(where.buffer_url, "the buffer's URL"),
            *(["--tokenizer", where.tokenizer] if where.tokenizer is not None else []),
            *_auth(where),
        ]
    assert pool is not None, f"{component} belongs to a pool"
    if component == "engine":
        return _engine(resolved, pool, where, replica)
    return _weight_sync(pool, where, once=component == "weights-init")
