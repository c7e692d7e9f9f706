"""``resolve(run) -> ResolvedRun``: everything derived from a spec, computed in one place.

Validators only check.  Defaults that depend on other fields, the engine command line of each pool,
node selection from the GPU table and the sampling parameters all come from here.  The local
runtime passes each component its own part; the operator writes the whole object into the run's
ConfigMap, so both read the same values.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mixrl.api.corrections import CorrectionConfig
from mixrl.api.gpus import GPU_TABLE, replica_nodes
from mixrl.api.models import (
    LOW_PRECISIONS,
    AutoscalingSpec,
    EvaluationSpec,
    HealthSpec,
    ModelSpec,
    RLRun,
    RolloutSpec,
    SamplerPoolTemplate,
    Toleration,
    TrainerSpec,
    WeightsSpec,
)
from mixrl.api.sampling import SamplingRule

ENGINE_PORT = 30000
ROUTER_PORT = 8000
BUFFER_PORT = 8100
METRICS_PORT = 9400
DIST_INIT_PORT = 20000
"""Where the leader of a multi-node replica serves SGLang's ``--dist-init-addr`` (torch.distributed's
rendezvous of the replica's nodes)."""

SGLANG_VERSION = "0.5.23"
"""The SGLang release mixrl's launch flags are written for and tested against (its own argument
parser, tests/sglang/): it has ``--sampling-mask-max-tokens``, ``--weight-version`` and an
``/update_weights_from_disk`` that refuses a flush under load with ``success: false`` (0.5.6 rejects
the first flag and asserts in its scheduler on the last)."""
SGLANG_IMAGE = f"lmsysorg/sglang:v{SGLANG_VERSION}"
"""The official SGLang release the operator runs by default (its ``--sglang-image``)."""
MIXRL_IMAGE_PREFIX = "ghcr.io/mixrl/mixrl"
"""mixrl's images are ``<prefix>-<name>:<version>`` (images/README.md)."""

# SGLang's --quantization for a checkpoint the weight store converted to each precision.
# fp8: the 128x128 block format carries its quantization_config, "fp8" reads it; nvfp4: ModelOpt's
# layout.  mxfp4: no flag — SGLang's "mxfp4" method covers only gpt-oss-style MoE experts, while
# dense MXFP4 layers are declared in the converted checkpoint's quantization_config (AMD Quark's
# scheme), which SGLang reads by itself.  bf16 serves the trainer's weights as they are.
SGLANG_QUANTIZATION: dict[str, str | None] = {
    "bf16": None,
    "fp8": "fp8",
    "nvfp4": "modelopt_fp4",
    "mxfp4": None,
}
# fp8 KV cache: the converted checkpoints carry no k_scale/v_scale, so SGLang uses its per-layer
# default of 1.0 (keys and values cast as they are, unclamped).  A deliberate, documented choice
# (docs/engine.md, "FP8 KV-cache scales"): mixrl does not calibrate KV scales.
SGLANG_KV_CACHE_DTYPE = {"bf16": "auto", "fp8": "fp8_e4m3"}


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SamplingParams(Frozen):
    """What every engine request sends explicitly (never left to the model's generation config)."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    top_logprobs_num: int
    """K candidates recorded per token; ≥ the largest support when a top-k cut is used."""
    return_sampling_mask: bool
    """Ask for the sampling support S (only meaningful when top-p or top-k truncates)."""

    @property
    def rule(self) -> SamplingRule:
        return SamplingRule(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


class ResolvedPool(Frozen):
    name: str
    object_name: str
    """``<run>-<pool>``: the SamplerPool, Deployment and Service name."""
    gpu_type: str
    gpus_per_replica: int
    weight_precision: str
    kv_cache_dtype: Literal["bf16", "fp8"]
    engine: Literal["sglang", "torch"]
    capacity: float | None
    min_replicas: int
    max_replicas: int
    initial_replicas: int
    """Replicas the pool starts with, in a cluster and under ``mixrl run`` alike
    (:func:`initial_replicas`)."""
    cost_per_gpu_hour: float | None
    gpu_products: tuple[str, ...]
    """Values of nvidia.com/gpu.product the pool may run on (GPU table or the spec's override)."""
    node_selector: dict[str, str]
    tolerations: tuple[Toleration, ...] = ()
    """Extra tolerations from the spec (the operator always adds the ``nvidia.com/gpu`` taint)."""
    priority_class_name: str | None = None
    image: str | None
    """The pool's own ``image``; None runs the operator's image for the engine (chart values, pinned
    to the chart's version), so the image is the platform's choice, not a ``:latest`` default."""
    engine_args: tuple[str, ...]
    """The engine command line without host, port and model path (those depend on where it runs)."""
    nodes_per_replica: int = 1
    """Nodes one replica spans (:func:`mixrl.api.gpus.replica_nodes`): above 1 the replica is a
    LeaderWorkerSet group of this many pods, one per node, whose SGLang processes form one server
    (tensor parallel across them) and whose leader alone serves HTTP."""


class ResolvedTrainer(Frozen):
    spec: TrainerSpec
    image: str | None
    """The spec's ``image``; None runs the operator's trainer image for the backend."""
    world_size: int
    prompts_per_update: int
    samples_per_prompt: int
    normalize_std: bool
    temperature: float
    max_staleness: int | None
    corrections: CorrectionConfig


class ResolvedRun(Frozen):
    name: str
    namespace: str
    model: ModelSpec
    trainer: ResolvedTrainer
    pools: tuple[ResolvedPool, ...]
    sampling: SamplingParams
    rollout: RolloutSpec
    weights: WeightsSpec
    autoscaling: AutoscalingSpec
    evaluation: EvaluationSpec
    health: HealthSpec = Field(default_factory=HealthSpec)
    evaluation_pool: ResolvedPool | None = None
    """``evaluation.sampler: bf16``: the evaluator's own engine (torch, BF16 weights), outside the
    router and the training pools; None when the rollout worker evaluates on the pools."""
    evaluation_sampling: SamplingParams | None = None
    """How the evaluator samples: the run's temperature over the full vocabulary."""

    def pool(self, name: str) -> ResolvedPool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(f"no pool named {name!r} in run {self.name!r}")


def initial_replicas(min_replicas: int, max_replicas: int) -> int:
    """Replicas a new pool starts with: minReplicas, at least 1, never above maxReplicas (a pool with
    maxReplicas 0 starts none).  The one rule for both runtimes: the operator seeds a new
    SamplerPool's ``spec.replicas`` with it, and ``mixrl run`` starts that many engines."""
    return min(max(min_replicas, 1), max_replicas)


def default_kv_cache_dtype(pool: SamplerPoolTemplate) -> Literal["bf16", "fp8"]:
    if pool.kv_cache_dtype is not None:
        return pool.kv_cache_dtype
    return "fp8" if pool.weight_precision in LOW_PRECISIONS else "bf16"


def torch_engine_args(
    pool: str, weight_precision: str, kv_cache_dtype: str, extra: list[str] | tuple[str, ...] = ()
) -> tuple[str, ...]:
    """The torch engine's flags: its emulated precisions and the pool it reports."""
    args = ("--weight-precision", weight_precision, "--kv-cache-dtype", kv_cache_dtype)
    return (*args, "--pool", pool, *extra)


def engine_args(
    pool: SamplerPoolTemplate, kv_cache_dtype: str, sampling: SamplingParams, model: ModelSpec
) -> tuple[str, ...]:
    """Engine flags for one pool: SGLang's launch flags, or the torch engine's equivalents.

    Each SGLang flag, and why: docs/engine.md, "What each generated flag means, and why"."""
    if pool.engine == "torch":
        return torch_engine_args(pool.name, pool.weight_precision, kv_cache_dtype, pool.engine_args)
    args = ["--tp-size", str(max(pool.replica_gpus, 1)), "--enable-metrics"]
    # mixrl sends token ids and reads token ids: the tokenizer stays with the rollout workers, and
    # the published checkpoints need no tokenizer files.
    args += ["--skip-tokenizer-init"]
    # The spec's context bound, not the checkpoint config's (SGLang refuses one above the config's).
    args += ["--context-length", str(model.max_context_tokens)]
    quantization = SGLANG_QUANTIZATION[pool.weight_precision]
    if quantization is not None:
        args += ["--quantization", quantization]
    args += ["--kv-cache-dtype", SGLANG_KV_CACHE_DTYPE[kv_cache_dtype]]
    mask_limit = sampling.rule.mask_limit()
    if sampling.return_sampling_mask and mask_limit is not None:
        # The rule truncates, so every request asks for its support (recorded with each token;
        # the trainer replays it under maskReplay): the server must be able to return it, and
        # aborts a request whose support exceeds the limit (SamplingRule.mask_limit).
        args += ["--sampling-mask-max-tokens", str(mask_limit)]
    return (*args, *pool.engine_args)


def resolve(run: RLRun) -> ResolvedRun:
    spec = run.spec
    algorithm = spec.algorithm
    rule = SamplingRule(temperature=algorithm.temperature, top_p=algorithm.top_p.p, top_k=algorithm.top_p.k)
    truncates = rule.truncates()
    sampling = SamplingParams(
        temperature=rule.temperature,
        top_p=rule.top_p,
        top_k=rule.top_k,
        max_new_tokens=algorithm.max_new_tokens,
        top_logprobs_num=rule.candidates(algorithm.top_candidates),
        return_sampling_mask=truncates,
    )
    corrections = CorrectionConfig(
        mis=algorithm.corrections.mis,
        tis=algorithm.corrections.tis,
        score_centering=algorithm.corrections.score_centering,
        topp_replay=algorithm.top_p.mask_replay and truncates,
    )
    pools = []
    for pool in spec.sampler_pools:
        kv = default_kv_cache_dtype(pool)
        products = pool.scheduling.gpu_products or GPU_TABLE[pool.gpu_type].gfd_products
        pools.append(
            ResolvedPool(
                name=pool.name,
                object_name=f"{run.metadata.name}-{pool.name}",
                gpu_type=pool.gpu_type,
                gpus_per_replica=pool.replica_gpus,
                weight_precision=pool.weight_precision,
                kv_cache_dtype=kv,
                engine=pool.engine,
                capacity=pool.capacity,
                min_replicas=pool.min_replicas,
                max_replicas=pool.max_replicas,
                initial_replicas=initial_replicas(pool.min_replicas, pool.max_replicas),
                cost_per_gpu_hour=pool.cost_per_gpu_hour,
                gpu_products=tuple(products),
                node_selector=dict(pool.scheduling.node_selector),
                tolerations=tuple(pool.scheduling.tolerations),
                priority_class_name=pool.scheduling.priority_class_name,
                image=pool.image,
                engine_args=engine_args(pool, kv, sampling, spec.model),
                nodes_per_replica=replica_nodes(pool.gpu_type, pool.replica_gpus),
            )
        )
    trainer = spec.trainer
    evaluation_pool, evaluation_sampling = None, None
    if spec.evaluation.sampler == "bf16":
        evaluation_sampling = SamplingParams(
            temperature=rule.temperature,
            top_p=1.0,
            top_k=-1,
            max_new_tokens=algorithm.max_new_tokens,
            top_logprobs_num=0,
            return_sampling_mask=False,
        )
        evaluation_pool = evaluator_pool(run.metadata.name)
    return ResolvedRun(
        name=run.metadata.name,
        namespace=run.metadata.namespace or "default",
        model=spec.model,
        trainer=ResolvedTrainer(
            spec=trainer,
            image=trainer.image,
            world_size=trainer.nodes * trainer.processes_per_node,
            prompts_per_update=algorithm.prompts_per_update,
            samples_per_prompt=algorithm.samples_per_prompt,
            normalize_std=algorithm.advantage.normalize_std,
            temperature=algorithm.temperature,
            max_staleness=algorithm.max_staleness,
            corrections=corrections,
        ),
        pools=tuple(pools),
        sampling=sampling,
        rollout=spec.rollout,
        weights=spec.weights,
        autoscaling=spec.autoscaling,
        evaluation=spec.evaluation,
        health=spec.health,
        evaluation_pool=evaluation_pool,
        evaluation_sampling=evaluation_sampling,
    )


EVALUATOR_POOL = "evaluator"
"""The evaluator engine's pool name (reserved: no sampler pool may take it)."""


def evaluator_pool(run_name: str) -> ResolvedPool:
    """The BF16 engine of ``evaluation.sampler: bf16``: one torch replica, BF16 weights and KV cache."""
    return ResolvedPool(
        name=EVALUATOR_POOL,
        object_name=f"{run_name}-{EVALUATOR_POOL}",
        gpu_type="cpu",
        gpus_per_replica=0,
        weight_precision="bf16",
        kv_cache_dtype="bf16",
        engine="torch",
        capacity=None,
        min_replicas=1,
        max_replicas=1,
        initial_replicas=1,
        cost_per_gpu_hour=None,
        gpu_products=(),
        node_selector={},
        image=None,
        engine_args=torch_engine_args(EVALUATOR_POOL, "bf16", "bf16"),
    )
