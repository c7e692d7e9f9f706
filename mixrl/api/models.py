"""The RLRun and SamplerPool resources (group ``mixrl.dev``, version ``v1alpha1``).

These pydantic models are the single source of truth: ``mixrl crds`` generates the CRD schemas from
them, their field descriptions become ``kubectl explain`` text, and the same models load a local
YAML file for ``mixrl run``.  YAML and Kubernetes use camelCase; Python uses snake_case.

Validators only check and raise.  Anything derived from a spec (defaults that depend on other
fields, per-component settings) is computed by :func:`mixrl.api.resolve.resolve`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Annotated, Any, Final, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from mixrl.api import names, quantity, rules
from mixrl.api.base import (
    INT32_MAX,
    MAX_CAPACITY,
    MAX_GPUS_PER_POD,
    MAX_SECONDS,
    Bool,
    Float,
    Int,
    Model,
)
from mixrl.api.corrections import PAPER_MIS_RANGE
from mixrl.api.gpus import GPU_TABLE, GPU_TYPES, default_gpus
from mixrl.api.memory import pool_memory_problem, trainer_memory_problem
from mixrl.api.status import (
    RLRunStatus,
    SamplerPoolStatus,
)
from mixrl.api.tiny import TINY_KINDS as TINY_KINDS
from mixrl.api.tiny import TINY_PREFIX as TINY_PREFIX
from mixrl.api.tiny import tiny_kind as tiny_kind

GROUP = "mixrl.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "mixrl.dev/v1alpha1"
assert f"{GROUP}/{VERSION}" == API_VERSION

WeightPrecision = Literal["bf16", "fp8", "mxfp4", "nvfp4"]
KvCacheDtype = Literal["bf16", "fp8"]
# The cross-field rules (their fields, messages and CEL twins) live in mixrl.api.rules; these names
# stay importable from here.
LOW_PRECISIONS = rules.LOW_PRECISIONS
RESERVED_POOL_NAMES = rules.RESERVED_POOL_NAMES
field_error = rules.field_error

# ----------------------------------------------------------------------------- value types and bounds


def _checked_by(check: Callable[[Any], str | None]) -> Callable[[Any], Any]:
    """An after-validator from a check returning None or a one-line reason."""

    def validate(value: Any) -> Any:
        problem = check(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    return validate


_labels = _checked_by(names.labels_problem)
"""Label keys and values (metadata.labels, node selectors), checked as one map for one line."""

INT64_RANGE = (-(2**63), 2**63 - 1)


def _json_numbers_problem(value: Any, where: str = "") -> str | None:
    """Free-form JSON (an environment's arguments) as Kubernetes stores it: integers in 64 bits and
    finite numbers; a larger integer would pass here and be refused by the API server."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    elif isinstance(value, bool) or not isinstance(value, int | float):
        return None
    elif isinstance(value, int) and not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
        return f"{where or 'value'}: integer out of range (Kubernetes stores integers in 64 bits)"
    elif isinstance(value, float) and not math.isfinite(value):
        return f"{where or 'value'}: must be a finite number"
    else:
        return None
    for key, item in items:
        problem = _json_numbers_problem(item, _key_path(where, key))
        if problem is not None:
            return problem
    return None


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,59}")


def _key_path(where: str, key: Any) -> str:
    """``where.key``, or ``where['a pasted key...']`` cut short, so the reason after it is seen."""
    if isinstance(key, int):
        return f"{where}[{key}]"
    if _PLAIN_KEY.fullmatch(key):
        return f"{where}.{key}".lstrip(".")
    return f"{where}[{names.shown(key)}]"


def _schema(**schema: Any) -> Any:
    """The CRD's twin of a Python check (pattern, maxLength), so the API server refuses the same strings."""
    return Field(json_schema_extra=schema)


def _quantity_problem(value: str) -> str | None:
    try:
        quantity.positive_quantity(value)
    except quantity.QuantityError as exc:
        return str(exc)
    return None


def _image_problem(value: str) -> str | None:
    if not value or len(value) > 512 or any(c.isspace() for c in value):
        return f"{names.shown(value)} is not an image reference (1 to 512 characters, no whitespace)"
    return None


Quantity = Annotated[
    str,
    AfterValidator(_checked_by(_quantity_problem)),
    _schema(pattern=quantity.POSITIVE_PATTERN, maxLength=quantity.MAX_LENGTH),
]
"""A positive Kubernetes quantity (``500Gi``, ``1.5``, ``100m``, ``1e3``), parsed by Kubernetes' rules."""
LabelValue = Annotated[
    str,
    AfterValidator(_checked_by(names.label_value_problem)),
    _schema(pattern=names.LABEL_VALUE_PATTERN, maxLength=names.LABEL_VALUE_MAX),
]
QualifiedName = Annotated[
    str,
    AfterValidator(_checked_by(names.qualified_name_problem)),
    _schema(pattern=names.QUALIFIED_NAME_PATTERN, maxLength=names.QUALIFIED_NAME_MAX),
]
DnsSubdomain = Annotated[
    str,
    AfterValidator(_checked_by(names.dns_subdomain_problem)),
    _schema(pattern=names.DNS_SUBDOMAIN_PATTERN, maxLength=names.DNS_SUBDOMAIN_MAX),
]
Image = Annotated[
    str, AfterValidator(_checked_by(_image_problem)), _schema(pattern=r"^\S+$", minLength=1, maxLength=512)
]
"""A container image reference: Kubernetes refuses an image with leading or trailing spaces, and one
inside is never a valid reference."""
Location = Annotated[str, Field(min_length=1, max_length=4096)]
"""A path or URL (PATH_MAX)."""
Word = Annotated[str, Field(min_length=1, max_length=63)]
"""A short name: an environment, a tool."""


# ----------------------------------------------------------------------------- model and trainer


class ModelSpec(Model):
    path: Location
    """Base checkpoint: a directory the trainer can read (in a cluster, on a mounted volume), or
    ``tiny:<kind>`` for a tiny model built locally from a config (``tiny:qwen3``, ``tiny:qwen3_moe``;
    CPU runs). URLs (``s3://``…) are refused: nothing downloads the model."""
    tokenizer: Location | None = None
    """Tokenizer location; defaults to the checkpoint's own (tiny models use mixrl's built-in one)."""
    chat_template: str | None = Field(default=None, max_length=65536)
    """Jinja chat template overriding the tokenizer's, if any."""
    max_context_tokens: Int = Field(default=32768, gt=0, le=INT32_MAX)
    """Longest context (prompt plus all turns) an episode may reach."""
    parameters_billions: Float | None = Field(default=None, gt=0, le=1e6)
    """Parameter count in billions, every expert of an MoE included (e.g. 30 for Qwen3-30B-A3B).
    When set, validation refuses a pool or trainer whose GPUs cannot hold the weights, and the
    operator sizes the memory of the containers that load whole checkpoints from it."""


class Parallelism(Model):
    tp: Int = Field(default=1, ge=1, le=INT32_MAX)
    """Tensor-parallel size (the vocabulary is sharded across it)."""
    pp: Int = Field(default=1, ge=1, le=INT32_MAX)
    """Pipeline-parallel size."""
    ep: Int = Field(default=1, ge=1, le=INT32_MAX)
    """Expert-parallel size (MoE)."""
    cp: Int = Field(default=1, ge=1, le=INT32_MAX)
    """Context-parallel size."""


class OptimizerSpec(Model):
    name: Literal["adamw"] = "adamw"
    """Optimizer; AdamW is what every large-model RL stack uses."""
    lr: Float = Field(default=1e-6, gt=0, le=1)
    """Learning rate (at most 1: AdamW moves each weight by about lr per step)."""
    betas: tuple[Float, Float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: Float = Field(default=0.0, ge=0, le=1)
    """Decoupled weight decay (at most 1, so that the decay factor 1 - lr * weightDecay stays in [0, 1])."""
    grad_clip: Float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value; null disables clipping."""


class ResourceRequirements(Model):
    cpu: Quantity | None = None
    """CPU request and limit, a positive Kubernetes quantity (e.g. ``"16"``, ``"500m"``)."""
    memory: Quantity | None = None
    """Memory request and limit, a positive Kubernetes quantity (e.g. ``"256Gi"``)."""


class TrainerSpec(Model):
    backend: Literal["torch", "megatron"] = "torch"
    """Training backend: ``torch`` (one process, or FSDP2 data parallelism over nodes x gpusPerNode
    processes; on GPUs or CPUs). ``megatron``: megatron-core's GPTModel with tensor, pipeline and
    expert parallelism from ``parallelism`` and the distributed optimizer, on CUDA GPUs only (no
    context parallelism yet); docs/api.md#trainer-backends."""
    gpu_type: str = Field(default="H100", json_schema_extra={"enum": list(GPU_TYPES)})
    """GPU type of the trainer nodes (a key of the GPU table, or ``cpu``)."""
    nodes: Int = Field(default=1, ge=1, le=INT32_MAX)
    """Number of trainer nodes."""
    gpus_per_node: Int = Field(default=8, ge=0, le=MAX_GPUS_PER_POD)
    """GPUs per trainer node (at least 1 on a GPU type), one trainer process each; on gpuType cpu the
    number of trainer processes per node (0 or 1: one)."""
    parallelism: Parallelism = Field(default_factory=Parallelism)
    """Model parallelism of the trainer (megatron backend only; the torch backend needs all sizes 1):
    tp x pp x cp and tp x pp x ep must divide the trainer's world size, nodes x gpusPerNode."""
    precision: Literal["bf16"] = "bf16"
    """Trainer precision: every published version is BF16, and master weights, gradients, reductions
    and the optimizer are FP32. The torch backend computes in BF16 on GPUs (autocast; FSDP2's
    mixed precision with several ranks) and in FP32 on CPUs, whose BF16 matmuls are far slower."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    """Optimizer settings."""
    total_steps: Int | None = Field(default=None, gt=0, le=INT32_MAX)
    """Stop after this many policy updates; null trains until stopped."""
    micro_batch_tokens: Int = Field(default=16384, gt=0, le=INT32_MAX)
    """Tokens per forward/backward micro-batch (gradient accumulation fills the update)."""
    checkpoint_every: Int = Field(default=50, gt=0, le=INT32_MAX)
    """Save a resumable checkpoint every this many steps."""
    stop_grace_seconds: Int = Field(default=120, ge=20, le=86400)
    """Seconds a stopped trainer (SIGTERM: its pod deleted, evicted or preempted; mixrl run stopped)
    has before SIGKILL to end its step and save a checkpoint of its last step: the trainer pods'
    terminationGracePeriodSeconds (torchrun waits for its ranks all but 10 s of it)."""
    image: Image | None = None
    """Container image; defaults to mixrl's trainer image for the backend."""
    resources: ResourceRequirements | None = None
    """CPU and memory for each trainer pod (GPUs come from gpusPerNode)."""
    scheduling: Scheduling = Field(default_factory=lambda: Scheduling())
    """Node selection (GPU products), tolerations and priority class of the trainer pods, as for a
    sampler pool."""

    @field_validator("gpu_type")
    @classmethod
    def _known_gpu(cls, gpu_type: str) -> str:
        return _known_gpu_type(gpu_type)

    @property
    def processes_per_node(self) -> int:
        """Trainer processes on each node: one per GPU; on gpuType cpu ``gpusPerNode`` of them, 0
        meaning one."""
        return max(self.gpus_per_node, 1)


def _known_gpu_type(gpu_type: str) -> str:
    if gpu_type not in GPU_TABLE:
        raise ValueError(f"unknown GPU type {names.shown(gpu_type)}; known: {', '.join(GPU_TYPES)}")
    return gpu_type


# ----------------------------------------------------------------------------- sampler pools


class Toleration(Model):
    key: QualifiedName | None = None
    """Taint key to tolerate (a label key); empty, with ``Exists``, tolerates every taint."""
    operator: Literal["Exists", "Equal"] = "Exists"
    """``Exists`` or ``Equal``."""
    value: LabelValue | None = None
    """Taint value (with ``Equal`` only)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect; empty tolerates all effects."""


class Scheduling(Model):
    """Where the trainer's pods, or a pool's, may run, beyond the GPU table's placement."""

    gpu_products: list[LabelValue] | None = Field(default=None, max_length=64)
    """Override of the GPU table: ``nvidia.com/gpu.product`` values these pods may run on."""
    node_selector: Annotated[dict[str, LabelValue], AfterValidator(_labels)] = Field(
        default_factory=dict, max_length=64
    )
    """Extra node labels these pods require (label keys and values)."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    """Extra tolerations (the ``nvidia.com/gpu`` taint is always tolerated)."""
    priority_class_name: DnsSubdomain | None = None
    """PriorityClass of these pods; in a Kueue queue also their Workload's priority when the
    operator runs with ``--kueue-workload-priority`` (docs/operator.md)."""


class SamplerPoolTemplate(Model):
    """One pool of identical sampler replicas: one GPU type, one precision, one engine."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=24)
    """Pool name (DNS label, at most 24 characters); the SamplerPool is named ``<run>-<name>``. Not a
    name the run uses itself: its components' suffixes (trainer, router, rollout, buffer, config,
    weights, evaluator), nor run or all, which name the whole run's figures."""
    gpu_type: str = Field(json_schema_extra={"enum": list(GPU_TYPES)})
    """GPU type (a key of the GPU table, or ``cpu`` for local emulation)."""
    gpus_per_replica: Int | None = Field(default=None, ge=0, le=MAX_GPUS_PER_POD)
    """GPUs per engine replica (its tensor-parallel size): at least 1 on a GPU type. Null (the
    default): 1 on a GPU type, 0 on gpuType cpu, whose pods request no GPU (the validator puts the
    number in). More than one node of the GPU type holds (docs/gpus.md, GPUs per node; 8 for every
    type): the replica spans gpusPerReplica / GPUs-per-node whole nodes, a multiple of them, as a
    LeaderWorkerSet group with SGLang's multi-node launch (engine sglang only; the cluster must serve
    leaderworkerset.x-k8s.io/v1; docs/operator.md#multi-node-engine-pools)."""
    weight_precision: WeightPrecision = "bf16"
    """Precision the engine serves the weights in: bf16, fp8 (128x128 blocks), mxfp4 or nvfp4."""
    kv_cache_dtype: KvCacheDtype | None = None
    """KV-cache dtype; default fp8 for low-precision pools (fp8, mxfp4, nvfp4), else bf16."""
    engine: Literal["sglang", "torch"] = "sglang"
    """Engine implementation: SGLang on GPUs, or mixrl's torch engine (CPU, emulated precisions)."""
    capacity: Float | None = Field(default=1.0, gt=0, le=MAX_CAPACITY)
    """Relative serving capacity of one replica (e.g. tokens/s relative to a reference GPU). The
    router measures every pool: a trusted measurement more than 1.5x off the declared value replaces
    it (a CapacityMismatch condition names both). null: measured; the router and the built-in
    autoscaler use the measurement, KEDA sizes the pool as capacity 1.0."""
    min_replicas: Int = Field(default=1, ge=0, le=INT32_MAX)
    """Fewest replicas the autoscaler keeps (0 allows scale to zero)."""
    max_replicas: Int = Field(default=1, ge=0, le=INT32_MAX)
    """Most replicas the autoscaler may request."""
    cost_per_gpu_hour: Float | None = Field(default=None, ge=0, le=MAX_CAPACITY)
    """Price of one GPU-hour of this GPU type, for cost reports and budget-aware scaling."""
    engine_args: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list, max_length=256)
    """Extra command-line arguments passed to the engine."""
    image: Image | None = None
    """Container image; defaults to the stock SGLang image (engine sglang; mixrl's weight-sync
    sidecar runs beside it from mixrl's components image) or mixrl's torch engine image."""
    scheduling: Scheduling = Field(default_factory=Scheduling)
    """Node selection and tolerations beyond the GPU-table defaults."""

    @field_validator("gpu_type")
    @classmethod
    def _known_gpu(cls, gpu_type: str) -> str:
        return _known_gpu_type(gpu_type)

    @model_validator(mode="after")
    def _default_gpus(self) -> Self:
        if self.gpus_per_replica is None:  # the CRD's rules read the same default (rules.DERIVED_DEFAULTS)
            self.gpus_per_replica = default_gpus(self.gpu_type)
        return self

    @property
    def replica_gpus(self) -> int:
        """``gpusPerReplica`` with its default put in (as the validator does)."""
        return default_gpus(self.gpu_type) if self.gpus_per_replica is None else self.gpus_per_replica


# ----------------------------------------------------------------------------- algorithm


class TopPSpec(Model):
    p: Float = Field(default=1.0, gt=0, le=1)
    """Nucleus mass; 1.0 disables top-p truncation."""
    k: Int = Field(default=-1, ge=-1, le=INT32_MAX)
    """Top-k cut (-1 = whole vocabulary; with top-p below 1 the torch engine still samples from at
    most its ``--sampling-mask-max-tokens``, 4,096, docs/engine.md). SGLang needs a finite top-k to
    return the sampling mask."""
    mask_replay: Bool = True
    """Replay the sampler's top-p set in the trainer (renormalize π on the same support)."""


class CorrectionsSpec(Model):
    mis: tuple[Float, Float] | None = PAPER_MIS_RANGE
    """Masked importance sampling: a token whose ratio π/μ lies outside [lo, hi] gets weight 0 (with
    score centering its centering term still counts); null disables."""
    tis: Float | None = Field(default=None, gt=0)
    """Truncated importance sampling cap C (weight min(r, C)); null disables."""
    score_centering: Bool = True
    """Subtract E_{b~μ}[w(b) ∇log π(b)] from each token's score (score centering)."""


class AdvantageSpec(Model):
    estimator: Literal["grpo"] = "grpo"
    """Advantage estimator: GRPO (reward minus the group mean)."""
    normalize_std: Bool = True
    """Divide by the group's reward standard deviation."""


class AlgorithmSpec(Model):
    prompts_per_update: Int = Field(default=128, gt=0, le=INT32_MAX)
    """Prompts (groups) per policy update."""
    samples_per_prompt: Int = Field(default=8, gt=0, le=INT32_MAX)
    """Trajectories sampled per prompt (the GRPO group size)."""
    advantage: AdvantageSpec = Field(default_factory=AdvantageSpec)
    """How advantages are computed."""
    corrections: CorrectionsSpec = Field(default_factory=CorrectionsSpec)
    """Off-policy corrections for the sampler–trainer mismatch."""
    top_p: TopPSpec = Field(default_factory=TopPSpec)
    """Sampling truncation and whether the trainer replays it."""
    temperature: Float = Field(default=1.0, ge=1e-3, le=100)
    """Sampling temperature; the trainer divides its logits by the same value (at least 0.001: far
    below that the divided logits overflow to inf)."""
    max_staleness: Int | None = Field(default=None, ge=1, le=INT32_MAX)
    """Drop a group holding a token of version v when step N would train it with N − v above this
    (the trainer's logged staleness, (N − 1) − v, then stays below it; docs/api.md#bounded-staleness);
    at least 1, as 0 would drop every group (the freshest token is one behind its step); null =
    unbounded (fully async)."""
    max_new_tokens: Int = Field(default=1024, gt=0, le=INT32_MAX)
    """Most tokens one assistant turn may generate."""
    top_candidates: Int = Field(default=20, ge=0, le=INT32_MAX)
    """K: candidates (id, log q) recorded per token, used for score centering."""


# ----------------------------------------------------------------------------- rollout, weights, scaling


class DatasetSpec(Model):
    seed: Int = Field(default=0, ge=0, le=INT32_MAX)
    """Seed of the generated task set (non-negative, as numpy's generators require)."""
    train_size: Int = Field(default=4096, gt=0, le=INT32_MAX)
    """Number of training tasks."""
    heldout_size: Int = Field(default=256, gt=0, le=INT32_MAX)
    """Number of held-out tasks (never trained on)."""
    train: Location | None = None
    """Training tasks from a file instead of the environment's generator: a local ``.jsonl`` (one
    JSON object per line) or ``.parquet`` file, one task per row, read by the rollout worker (in a
    cluster: a path inside its image or on a mounted volume); the first ``trainSize`` rows are used."""
    heldout: Location | None = None
    """Held-out tasks from a file (as ``train``); the first ``heldoutSize`` rows are used."""


_CODING_TOOLS = ("list_files", "read_file", "write_file", "run", "submit")
ENVIRONMENT_TOOLS: dict[str, tuple[str, ...]] = {
    "filetree": ("ls", "cat", "submit"),
    "coding": _CODING_TOOLS,
    "coding-plain": _CODING_TOOLS,
}
"""The built-in environments and the tools each offers (implemented in
:mod:`mixrl.rl.environments.filetree` and :mod:`mixrl.rl.environments.coding`, whose ``TOOLS`` a
test keeps equal to these)."""
SUBMIT_TOOL = "submit"
"""The tool that ends a filetree episode with an answer: the only way to earn a reward there."""
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
"""``package.module:ClassName``: an environment of the user's own (docs/rollout.md)."""


class SandboxPodsSpec(Model):
    """Sandbox pods in a cluster (docs/sandbox.md#sandbox-pods-in-a-cluster): each rollout worker
    keeps a warm pool of them and runs each sandboxed command in a pod of its own, deleted after it."""

    pool_size: Int = Field(default=4, gt=0, le=1024)
    """Warm sandbox pods each rollout worker keeps ready; a command waits for one when all are busy."""
    runtime_class_name: DnsSubdomain | None = None
    """RuntimeClass of the sandbox pods (``gvisor``, ``kata``: a kernel of their own); null = the
    cluster's default runtime."""
    image: Image | None = None
    """Image of the sandbox pods (it must hold mixrl and whatever the tasks' commands need);
    defaults to mixrl's components image."""
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(cpu="1", memory="1Gi")
    )
    """CPU and memory of each sandbox pod (request = limit)."""
    ready_timeout_seconds: Int = Field(default=120, gt=0, le=86400)
    """A pod not ready this long after it was created is deleted and replaced."""


class RolloutSpec(Model):
    environment: str = Field(default="filetree", min_length=1, max_length=255)
    """Task family: built in, ``filetree`` (inspect a virtual file tree with tools, submit an
    answer), ``coding`` (the agentic coding task in a sandbox, JSON tool calls for chat models) or
    ``coding-plain`` (the same with plain-text calls, for tiny models); or your own as
    ``package.module:ClassName``, a subclass of ``mixrl.rl.environments.base.Environment`` importable by the rollout worker (``mixrl validate``
    and ``mixrl run`` import it and check it; the operator checks only this form)."""
    environment_args: Annotated[dict[str, Any], AfterValidator(_checked_by(_json_numbers_problem))] = Field(
        default_factory=dict, max_length=64
    )
    """Keyword arguments for the environment's constructor (any JSON values)."""
    dataset: DatasetSpec = Field(default_factory=DatasetSpec)
    """Where tasks come from."""
    tools: list[Word] | None = Field(default=None, min_length=1, max_length=64)
    """Tools offered to the agent, among the environment's; null = all of them."""
    max_turns: Int = Field(default=16, gt=0, le=INT32_MAX)
    """Most assistant turns per episode."""
    max_observation_tokens: Int = Field(default=1024, gt=0, le=INT32_MAX)
    """Longest observation (a tool's output) in tokens; a longer one is cut to this many."""
    format_error_limit: Int = Field(default=3, gt=0, le=INT32_MAX)
    """End an episode after this many consecutive replies without a tool call (the paper uses 3)."""
    concurrency: Int = Field(default=64, gt=0, le=INT32_MAX)
    """Agent sessions run at once by each rollout worker."""
    workers: Int = Field(default=1, gt=0, le=INT32_MAX)
    """Rollout worker replicas (``mixrl run``: as many local processes), each playing its own shard of
    the training split; worker 0 alone runs the held-out evaluation on the pools."""
    max_steps_ahead: Int = Field(default=2, ge=0, le=INT32_MAX)
    """Back-pressure: a worker starts no new group while the buffer holds this many trainer steps of
    data (ready plus in flight; several workers each keep their share); 0 = never wait. It drops nothing and bounds no staleness (that is
    algorithm.maxStaleness, which does drop stale groups); it only keeps samplers from running far
    ahead of the trainer."""
    sandbox: SandboxPodsSpec | None = None
    """In a cluster: run the environment's sandboxed commands in sandbox pods
    (docs/sandbox.md#sandbox-pods-in-a-cluster); null = the local sandbox inside the worker's pod.
    ``mixrl run`` refuses it (sandbox pods exist only in a cluster)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if ":" in self.environment:
            # The user's own: only its form is checked here (the operator cannot import it);
            # mixrl validate, mixrl run and the rollout worker import it and check its tools.
            if not IMPORT_PATH.match(self.environment):
                reason = f"{names.shown(self.environment)} is not an import path package.module:ClassName"
                raise field_error("environment", reason)
            return self
        offered = ENVIRONMENT_TOOLS.get(self.environment)
        if offered is None:
            reason = (
                f"unknown environment {names.shown(self.environment)}; built in: {', '.join(ENVIRONMENT_TOOLS)}"
                " (or your own as package.module:ClassName)"
            )
            raise field_error("environment", reason)
        tools = offered if self.tools is None else self.tools
        unknown = [tool for tool in tools if tool not in offered]
        if unknown:
            reason = f"{unknown} not offered by {self.environment} (it has {', '.join(offered)})"
            raise field_error("tools", reason)
        if self.environment == "filetree" and SUBMIT_TOOL not in tools:
            raise field_error("tools", f"without {SUBMIT_TOOL} no episode can earn a reward")
        return self


class WeightsSpec(Model):
    store: Location = "file:///var/lib/mixrl/weights"
    """Weight store: an absolute path or a ``file:///`` URL, where the trainer's and the engines' pods
    mount the weights volume (``mixrl run`` keeps its store in the run directory instead)."""
    keep_versions: Int = Field(default=4, gt=0, le=INT32_MAX)
    """Old versions kept before pruning."""
    snapshot_every: Int = Field(default=10, gt=0, le=INT32_MAX)
    """Every how many versions the trainer publishes a full snapshot; the versions in between are
    stored as deltas on the one before (the changed BF16 words, compressed), which loaders rebuild
    from the chain back to the last snapshot. 1: every version whole."""
    volume_size: Quantity | None = None
    """Size of the weights volume the operator creates when the store is a local path (a positive
    Kubernetes quantity), and of a one-node trainer's own volume. Null (the default): derived from
    the run, from the model's size (``model.parametersBillions``, or a ``tiny:`` model's) times the
    versions kept and the pools' precisions, with headroom; 200Gi for a model of unknown size
    (docs/operator.md#sizes-derived-from-the-run)."""
    storage_class_name: str | None = Field(
        default=None, pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$", max_length=253
    )
    """StorageClass of that volume; it must offer ReadWriteMany (the trainer writes, engines on other
    nodes read: NFS, CephFS, EFS, Filestore, Azure Files…). Null: the operator's default (the chart's
    weights.storageClassName), else the cluster's default class."""
    broadcast: Bool = False
    """Also broadcast each new version from the trainer to the engines of its own precision (BF16
    pools) over a process group (SGLang's ``update_weights_from_distributed``) instead of their
    reading it from the store; the store keeps every version and any failure falls back to it.
    ``mixrl run`` only: the operator refuses it (docs/engine.md#broadcast)."""


class AutoscalingSpec(Model):
    engine: Literal["builtin", "keda", "none"] = "builtin"
    """Who scales pools: mixrl's own loop, KEDA ScaledObjects, or ``none``: a new pool starts with
    minReplicas replicas, at least 1 and never above maxReplicas (the operator's seed, and the engines
    ``mixrl run`` starts), and then ``replicas`` is left to ``kubectl scale`` or an HPA."""
    prometheus_url: Annotated[str, Field(max_length=2048, pattern=r"^https?://\S+$")] = (
        "http://prometheus-operated.monitoring.svc:9090"
    )
    """Prometheus HTTP API base URL."""
    query: str | None = Field(default=None, max_length=4096)
    """PromQL per pool (``{pool}``, ``{namespace}``, ``{run}`` and ``{object}`` are substituted); default: queued plus running
    requests summed over the pool's engine pods."""
    target_per_replica: Float = Field(default=8.0, gt=0, le=MAX_CAPACITY)
    """Desired load (queued + running requests) per ready replica of capacity 1.0 (a pool's target
    is this times its capacity, since the router sends load in proportion to capacity)."""
    tolerance: Float = Field(default=0.1, ge=0, lt=1)
    """Ignore load ratios within this fraction of 1 (as the HPA does)."""
    poll_interval_seconds: Float = Field(default=30.0, gt=0, le=MAX_SECONDS)
    """How often the load is read."""
    scale_down_window_seconds: Float = Field(default=300.0, ge=0, le=MAX_SECONDS)
    """Scale down to the highest recommendation of this window (stabilization)."""
    scale_up_limit: Int = Field(default=4, gt=0, le=INT32_MAX)
    """Most replicas added per poll (beyond doubling)."""
    activation_threshold: Float = Field(default=1.0, ge=0, le=MAX_CAPACITY)
    """Load that wakes a pool scaled to zero."""
    fallback_replicas: Int | None = Field(default=None, ge=0, le=INT32_MAX)
    """Replicas to hold when metrics are unavailable; null keeps the current count."""
    gpu_budget: Int | None = Field(default=None, gt=0, le=INT32_MAX)
    """Total GPUs all pools may use together, filled by cost per token; null = no shared budget. It
    must cover the pools' minimums (the sum of minReplicas x gpusPerReplica). Engine builtin only
    (KEDA scales each pool on its own)."""
    pending_timeout_seconds: Float | None = Field(default=600.0, gt=0, le=MAX_SECONDS)
    """Replicas the cluster reports as unable to start (unschedulable with no node on its way, an
    image that cannot be pulled, a crash loop) are released at once, and the pool may not grow for
    this long (a spot pool that lost its nodes): another pool takes the load. A cold start is waited
    for however long it takes. Only where the operator cannot read the pool's pods, replicas not
    ready this long, with none becoming ready, count as stuck. null = no growth block and no clock."""
    objective: Literal["queue", "trainer"] = "queue"
    """``queue``: each pool keeps targetPerReplica requests per replica (web-serving style). ``trainer``:
    size the whole fleet to the trainer: the cheapest sampler capacity that keeps the trainer's idle
    share under trainerIdleTarget and the buffered plus in-flight data within
    [minStepsAhead, rollout.maxStepsAhead] steps (docs/autoscaling.md)."""
    trainer_idle_target: Float = Field(default=0.05, ge=0, lt=1)
    """``objective: trainer``: the largest share of time the trainer may wait for data."""
    min_steps_ahead: Float = Field(default=1.0, ge=0, le=MAX_CAPACITY)
    """``objective: trainer``: the low end of the band of buffered plus in-flight data, in steps; the
    high end is rollout.maxStepsAhead (the rollout's own back-pressure)."""
    cost_budget_per_hour: Float | None = Field(default=None, gt=0, le=MAX_CAPACITY)
    """``objective: trainer`` only: most dollars per hour all pools may cost together (costPerGpuHour,
    or the default price table); null = none."""
    stall_after_seconds: Float = Field(default=600.0, gt=0, le=MAX_SECONDS)
    """``objective: trainer``: a trainer idle beyond trainerIdleTarget this long while the fleet holds
    (its estimates say the supply covers the demand) gets one more replica of the cheapest pool that
    can grow; when none can, a TrainerStarved Warning event on the run says why (every pool at its
    maximum, a budget, the rollout's concurrency, replicas the cluster cannot start)."""


class EvaluationSpec(Model):
    every_steps: Int = Field(default=10, gt=0, le=INT32_MAX)
    """Evaluate on the held-out tasks every this many steps (and at step 0 and trainer.totalSteps)."""
    sampler: Literal["pools", "bf16"] = "pools"
    """Who plays the held-out episodes. ``pools``: the rollout worker, on the training pools with the
    run's sampling, while training goes on (an evaluation names the oldest version that produced a
    token). ``bf16``: the stability study's protocol (docs/rollout.md#the-bf16-evaluator), ``mixrl
    evaluate`` with its own torch engine holding BF16 weights: it loads exactly version N for the evaluation of step N (nothing updates it meanwhile),
    samples the full vocabulary at the run's temperature (no top-p, no top-k), and goes on from the
    buffer's evaluations after a restart; the trainer keeps each evaluation step's version until it
    is evaluated. ``bf16`` runs with ``mixrl run``; the operator does not start an evaluator yet and
    refuses it."""
    pass_k: list[Annotated[Int, Field(le=INT32_MAX)]] = Field(
        default_factory=lambda: [1], max_length=rules.MAX_PASS_K
    )
    """The k of pass@k to report."""
    samples_per_task: Int = Field(default=1, gt=0, le=INT32_MAX)
    """Samples per held-out task (at least max(passK))."""
    tasks: Int | None = Field(default=None, gt=0, le=INT32_MAX)
    """Held-out tasks per evaluation; null = the whole held-out split."""


# ----------------------------------------------------------------------------- run health


class CollapseSpec(Model):
    """Thresholds of the three signs of collapse (docs/health.md).  The defaults are the seed's and
    also the chart's Prometheus alert rules' (mixrl.operator.builders.monitoring reads them from here)."""

    kl_growth: Float = Field(default=3.0, gt=1, le=MAX_CAPACITY)
    """Raise the KL sign when a pool's (or the run's) sampler-trainer KL (k3) reaches this many times
    its early-run baseline."""
    kl_floor: Float = Field(default=1e-4, ge=0, le=MAX_CAPACITY)
    """KL below this is noise and never raises the sign (a KL of 1e-6 may triple without meaning)."""
    reward_drop: Float = Field(default=0.3, gt=0, lt=1)
    """Raise the reward sign when the smoothed reward falls this fraction below its best."""
    format_error_share: Float = Field(default=0.5, gt=0, lt=1)
    """Raise the format sign when more than this share of episodes ends on repeated format errors."""
    baseline_steps: Int = Field(default=10, gt=0, le=100_000)
    """The KL baseline is the median of the first this many steps with data.  Not fewer by default:
    the first steps train on fresher tokens than the steady asynchronous pipeline does (step 1 on
    staleness 0), so a short baseline understates the KL that staleness alone will bring."""
    window: Int = Field(default=5, gt=0, le=100_000)
    """The KL and format-error signs are judged on the last this many steps (the KL's median, so a
    one-step spike raises nothing; the format-error share's mean)."""
    reward_window: Int = Field(default=15, gt=0, le=100_000)
    """The reward is smoothed by the mean of this many steps: a step's mean reward is noisy (about
    ±16 % on the quickstart), and a shorter window's lows would read as a fall from its highs."""


HEALTH_ACTIONS_NOT_IMPLEMENTED = {
    "pause": "pause is not implemented yet (only none: raised signs are reported, not acted on)"
}
"""Actions a later version may take, refused with their reason (no field that does nothing)."""


class RoutingHealthSpec(Model):
    """Mismatch-aware routing (docs/health.md#mismatch-aware-routing): the router's traffic shares
    become capacity × health, where a pool's health falls while its fresh (staleness-0) mismatch
    stays above a threshold.  No default thresholds: what counts as a bad mismatch depends on the
    model and the precisions (the tiny quickstart's pools start near 0.02 and settle near 0.003)."""

    kl_threshold: Float = Field(gt=0, le=MAX_CAPACITY)
    """A step's fresh KL (k3) of a pool above this is a bad observation."""
    extreme_share_threshold: Float = Field(gt=0, le=1)
    """A step's share of a pool's fresh tokens with a ratio outside [0.2, 5] above this is bad."""
    recover_fraction: Float = Field(default=0.5, gt=0, le=1)
    """An observation is good when both figures are below this fraction of their thresholds."""
    degrade_after: Int = Field(default=3, ge=1, le=100_000)
    """The health falls at this many bad observations in a row (and at each one after)."""
    recover_after: Int = Field(default=3, ge=1, le=100_000)
    """The health rises at this many good observations in a row (and at each one after)."""
    step: Float = Field(default=0.5, gt=0, lt=1)
    """Factor the health is multiplied by per further bad observation (divided by per good one)."""
    floor: Float = Field(default=0.1, gt=0, le=1)
    """Lowest health: a degraded pool keeps this fraction of its capacity's traffic (and is still measured)."""


class HealthSpec(Model):
    collapse: CollapseSpec = Field(default_factory=CollapseSpec)
    """Thresholds of the signs of collapse."""
    routing: RoutingHealthSpec | None = None
    """Mismatch-aware routing; null = traffic by capacity alone."""
    action: Literal["none"] = "none"
    """What a raised sign does: ``none`` (shown in ``mixrl run``'s progress line and report)."""

    @field_validator("action", mode="before")
    @classmethod
    def _not_implemented(cls, value: Any) -> Any:
        if isinstance(value, str) and value in HEALTH_ACTIONS_NOT_IMPLEMENTED:
            raise ValueError(HEALTH_ACTIONS_NOT_IMPLEMENTED[value])
        return value


# ----------------------------------------------------------------------------- RLRun


class RunScheduling(Model):
    queue: str | None = Field(default=None, pattern=names.DNS_LABEL_PATTERN, max_length=names.DNS_LABEL_MAX)
    """Kueue LocalQueue, in the run's namespace, that admits the run: the trainer and every pool's
    starting replicas (minReplicas, at least 1) are admitted together or not at all (one Kueue Workload), and until then the run is
    Queued with Kueue's reason and creates nothing that runs. Each replica a pool scales to above its
    starting ones has a Workload of its own and starts once Kueue admits it (its quota allowing; the
    others wait). null: the
    operator's default queue (the chart's kueue.defaultQueue), and without one the run starts at
    once (docs/operator.md#gang-admission-with-kueue)."""


class RLRunSpec(Model):
    model: ModelSpec
    """The policy's base checkpoint and tokenizer."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    """The one BF16 trainer."""
    sampler_pools: list[SamplerPoolTemplate] = Field(min_length=1, max_length=rules.MAX_SAMPLER_POOLS)
    """Sampler pools: one per GPU type and precision."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """Batch sizes, advantages, corrections, sampling."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """Environment and agent loop."""
    weights: WeightsSpec = Field(default_factory=WeightsSpec)
    """Weight store."""
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    """Pool autoscaling from Prometheus."""
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    """Held-out evaluation."""
    health: HealthSpec = Field(default_factory=HealthSpec)
    """Run health: thresholds of the signs of collapse and what a raised sign does."""
    scheduling: RunScheduling = Field(default_factory=RunScheduling)
    """How the cluster admits the run as a whole (Kueue)."""

    @model_validator(mode="after")
    def _weights_fit(self) -> Self:
        # mixrl.api.memory: do the weights fit the GPUs they land on?  Only for a model of known size.
        size = self.model.parameters_billions
        if size is None:
            return self
        for index, pool in enumerate(self.sampler_pools):
            problem = pool_memory_problem(
                size, pool.weight_precision, pool.gpu_type, pool.replica_gpus, pool.scheduling.gpu_products
            )
            if problem is not None:
                raise field_error(f"samplerPools[{index}].gpusPerReplica", problem)
        trainer = self.trainer
        gpus = trainer.nodes * trainer.gpus_per_node
        problem = trainer_memory_problem(size, trainer.gpu_type, gpus, trainer.scheduling.gpu_products)
        if problem is not None:
            raise field_error("trainer.gpusPerNode", problem)
        return self


OBJECT_META_FIELDS = frozenset(
    {"name", "namespace", "labels", "annotations", "generateName", "uid", "resourceVersion", "generation",
     "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "ownerReferences", "finalizers",
     "managedFields", "selfLink"}
)  # fmt: skip
"""The fields of Kubernetes' ObjectMeta (meta/v1)."""


class ObjectMeta(BaseModel):
    """The subset of Kubernetes metadata a manifest file carries; the rest is kept as is."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=names.DNS_LABEL_PATTERN, max_length=names.DNS_LABEL_MAX)
    """Object name (DNS label)."""
    namespace: Annotated[str, AfterValidator(_checked_by(names.dns_label_problem))] | None = None
    """Namespace (DNS label)."""
    labels: Annotated[dict[str, str], AfterValidator(_labels)] = Field(default_factory=dict)
    """Labels (Kubernetes label keys and values)."""
    annotations: Annotated[dict[str, str], AfterValidator(_checked_by(names.annotations_problem))] = Field(
        default_factory=dict
    )
    """Annotations (label keys; 256 KiB in all)."""

    @model_validator(mode="after")
    def _kubernetes_fields_only(self) -> Self:
        # Extra fields are kept (the operator reads objects the API server filled in: uid,
        # resourceVersion, managedFields...), but only ObjectMeta's: anything else is a typo.
        unknown = [key for key in self.model_extra or {} if key not in OBJECT_META_FIELDS]
        if unknown:
            raise ValueError(
                f"unknown field {names.shown(str(unknown[0]))} (metadata takes Kubernetes' ObjectMeta fields)"
            )
        return self


class RLRun(Model):
    """An RL run: one trainer, several sampler pools, the corrections that keep it stable."""

    api_version: Literal["mixrl.dev/v1alpha1"] = Field(default=API_VERSION, alias="apiVersion")
    """mixrl.dev/v1alpha1"""
    kind: Literal["RLRun"] = "RLRun"
    """RLRun"""
    metadata: ObjectMeta
    """Object metadata."""
    spec: RLRunSpec
    """Desired run."""
    status: RLRunStatus | None = None
    """Observed state, written by the operator or the local runtime."""


# ----------------------------------------------------------------------------- SamplerPool


class SamplerPoolSpec(Model):
    run: str = Field(pattern=names.DNS_LABEL_PATTERN, max_length=rules.MAX_RUN_NAME)
    """Owning RLRun."""
    pool: str = Field(pattern=names.DNS_LABEL_PATTERN, max_length=24)
    """Pool name within the run (``samplerPools[].name``)."""
    gpu_type: str = Field(json_schema_extra={"enum": list(GPU_TYPES)})
    """GPU type."""
    weight_precision: WeightPrecision
    """Weight precision."""
    kv_cache_dtype: KvCacheDtype
    """KV-cache dtype."""
    engine: Literal["sglang", "torch"]
    """Engine implementation."""
    replicas: Int = Field(ge=0, le=INT32_MAX)
    """Desired replicas: written by the autoscaler, ``kubectl scale``, HPA or KEDA."""
    min_replicas: Int = Field(default=0, ge=0, le=INT32_MAX)
    """Lower bound the built-in autoscaler respects."""
    max_replicas: Int = Field(default=1, ge=0, le=INT32_MAX)
    """Upper bound the built-in autoscaler respects."""
    capacity: Float | None = Field(default=1.0, gt=0, le=MAX_CAPACITY)
    """Relative capacity per replica; a trusted measurement more than 1.5x off it replaces it (docs/router.md).
    null: measured (the router's shares and the built-in autoscaler; KEDA sizes the pool as 1.0)."""

    @field_validator("gpu_type")
    @classmethod
    def _known_gpu(cls, gpu_type: str) -> str:
        return _known_gpu_type(gpu_type)


class SamplerPool(Model):
    """One sampler pool of an RLRun, with the scale subresource so HPA or KEDA can drive it."""

    api_version: Literal["mixrl.dev/v1alpha1"] = Field(default=API_VERSION, alias="apiVersion")
    """mixrl.dev/v1alpha1"""
    kind: Literal["SamplerPool"] = "SamplerPool"
    """SamplerPool"""
    metadata: ObjectMeta
    """Object metadata."""
    spec: SamplerPoolSpec
    """Desired pool."""
    status: SamplerPoolStatus | None = None
    """Observed pool."""
