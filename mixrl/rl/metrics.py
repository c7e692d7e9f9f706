"""Every Prometheus metric name mixrl exports or queries, in one place (docs/architecture.md#metrics).

Engines export SGLang's own names, so the router and the autoscaler cannot tell the torch engine
from a real SGLang server.  mixrl's own series are ``mixrl_*`` with the labels ``run``, ``pool``,
``gpu_type``, ``precision`` (:data:`MIXRL_LABELS`).

Counter names are written as exposed, with ``_total``; prometheus-client wants them without it,
which :func:`create` handles.  Colons: prometheus-client writes ``sglang:num_queue_reqs`` as
``sglang_num_queue_reqs`` to a scraper that negotiates OpenMetrics without UTF-8 names, so queries
must accept both spellings (:func:`promql_any_spelling`).

Other components add their metrics to this file: a name is defined here once, as a
:class:`MetricSpec`, and every exporter and query uses the constant.  Names mixrl only queries are
declared the same way: SGLang's (which the torch engine also exports) and the DCGM exporter's
(:data:`DCGM_FI_DEV_GPU_UTIL`), which mixrl never exports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

Kind = Literal["gauge", "counter", "histogram"]
_Collector = TypeVar("_Collector", Gauge, Counter, Histogram)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as exposed (counters end in _total)
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms only


def create(spec: MetricSpec, registry: CollectorRegistry) -> Gauge | Counter | Histogram:
    """The prometheus-client collector for ``spec``, registered in ``registry``."""
    if spec.kind == "gauge":
        return Gauge(spec.name, spec.help, spec.labels, registry=registry)
    if spec.kind == "counter":
        return Counter(spec.name.removesuffix("_total"), spec.help, spec.labels, registry=registry)
    return Histogram(
        spec.name,
        spec.help,
        spec.labels,
        registry=registry,
        buckets=spec.buckets or Histogram.DEFAULT_BUCKETS,
    )


def gauge(spec: MetricSpec, registry: CollectorRegistry) -> Gauge:
    """:func:`create` for a gauge's spec, typed as one."""
    return _created(spec, registry, Gauge)


def counter(spec: MetricSpec, registry: CollectorRegistry) -> Counter:
    """:func:`create` for a counter's spec, typed as one."""
    return _created(spec, registry, Counter)


def histogram(spec: MetricSpec, registry: CollectorRegistry) -> Histogram:
    """:func:`create` for a histogram's spec, typed as one."""
    return _created(spec, registry, Histogram)


def _created(spec: MetricSpec, registry: CollectorRegistry, kind: type[_Collector]) -> _Collector:
    if spec.kind != kind.__name__.lower():  # refused before anything is registered
        raise TypeError(f"{spec.name} is a {spec.kind}, not a {kind.__name__.lower()}")
    collector = create(spec, registry)
    assert isinstance(collector, kind)
    return collector


def promql_any_spelling(name: str, matchers: str = "") -> str:
    """A PromQL expression for the series of ``name`` with its colons kept or turned into
    underscores, each selected by ``matchers`` (label matchers without the braces, e.g.
    ``run="$run"``).

    A name with colons gives ``(a{m} or b{m})``: a parenthesized expression, not a selector, so
    the matchers go on each alternative; ``(a or b){m}`` is not PromQL.  A name without colons
    gives the plain selector ``name{m}``."""
    braces = f"{{{matchers}}}" if matchers else ""
    underscored = name.replace(":", "_")
    if underscored == name:
        return f"{name}{braces}"
    return f"({name}{braces} or {underscored}{braces})"


# ------------------------------------------------------------------------ engine: SGLang's names

ENGINE_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
"""SGLang's scheduler-side series (load, KV cache, queue time) carry these labels (0.5.23; one
engine: ``engine_type="unified"`` and rank 0 everywhere)."""
REQUEST_LABELS = ("model_name", "engine_type")
"""SGLang's tokenizer-side series (per-request counts and latencies) carry these."""
STREAM_LABELS = (*REQUEST_LABELS, "is_streaming")
"""… and those counted separately for streamed requests ("true" / "false")."""
CACHE_SOURCE_LABELS = (*REQUEST_LABELS, "cache_source")

# SGLang 0.5.23's default buckets, each histogram its own (srt/observability/metrics_collector.py;
# tests/sglang/test_engine_histograms.py reads them there): a pool of either engine fills the same
# buckets, so their series aggregate by ``le``, and an RL generation's minutes-long latencies land
# in buckets of their own instead of +Inf.
_TIME_TO_FIRST_TOKEN_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_INTER_TOKEN_LATENCY_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
    0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
_E2E_REQUEST_LATENCY_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400,
)  # fmt: skip
_QUEUE_TIME_BUCKETS = (
    0.000, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60,
    70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500,
    3000,
)  # fmt: skip

SGLANG_NUM_QUEUE_REQS = MetricSpec(
    "sglang:num_queue_reqs", "gauge", "Requests waiting to be scheduled.", ENGINE_LABELS
)
SGLANG_NUM_RUNNING_REQS = MetricSpec(
    "sglang:num_running_reqs", "gauge", "Requests being decoded.", ENGINE_LABELS
)
SGLANG_NUM_PAUSED_REQS = MetricSpec(
    "sglang:num_paused_reqs", "gauge", "Requests held by a pause.", ENGINE_LABELS
)
SGLANG_GEN_THROUGHPUT = MetricSpec(
    "sglang:gen_throughput",
    "gauge",
    "Generated tokens per second over the last 10 s, set as the engine works (held while it idles).",
    ENGINE_LABELS,
)
SGLANG_TOKEN_USAGE = MetricSpec(
    "sglang:token_usage", "gauge", "Fraction of KV-cache token slots in use.", ENGINE_LABELS
)
SGLANG_NUM_USED_TOKENS = MetricSpec(
    "sglang:num_used_tokens", "gauge", "KV-cache tokens in use.", ENGINE_LABELS
)
SGLANG_MAX_TOTAL_NUM_TOKENS = MetricSpec(
    "sglang:max_total_num_tokens", "gauge", "KV-cache token capacity.", ENGINE_LABELS
)
SGLANG_PROMPT_TOKENS_TOTAL = MetricSpec(
    "sglang:prompt_tokens_total", "counter", "Prompt tokens processed.", STREAM_LABELS
)
SGLANG_GENERATION_TOKENS_TOTAL = MetricSpec(
    "sglang:generation_tokens_total", "counter", "Tokens generated.", STREAM_LABELS
)
SGLANG_TIME_TO_FIRST_TOKEN = MetricSpec(
    "sglang:time_to_first_token_seconds",
    "histogram",
    "Arrival to first token.",
    STREAM_LABELS,
    _TIME_TO_FIRST_TOKEN_BUCKETS,
)
SGLANG_INTER_TOKEN_LATENCY = MetricSpec(
    "sglang:inter_token_latency_seconds",
    "histogram",
    "Time between consecutive tokens of a request, one observation per token.",
    REQUEST_LABELS,
    _INTER_TOKEN_LATENCY_BUCKETS,
)
SGLANG_E2E_REQUEST_LATENCY = MetricSpec(
    "sglang:e2e_request_latency_seconds",
    "histogram",
    "Arrival to completion.",
    STREAM_LABELS,
    _E2E_REQUEST_LATENCY_BUCKETS,
)
SGLANG_QUEUE_TIME = MetricSpec(
    "sglang:queue_time_seconds",
    "histogram",
    "Arrival to admission into the batch.",
    ENGINE_LABELS,
    _QUEUE_TIME_BUCKETS,
)

SGLANG_NUM_REQUESTS_TOTAL = MetricSpec(
    "sglang:num_requests_total", "counter", "Requests finished (aborted ones included).", STREAM_LABELS
)
SGLANG_NUM_ABORTED_REQUESTS_TOTAL = MetricSpec(
    "sglang:num_aborted_requests_total", "counter", "Requests that finished with an abort.", REQUEST_LABELS
)
SGLANG_CACHED_TOKENS_TOTAL = MetricSpec(
    "sglang:cached_tokens_total",
    "counter",
    "Prompt tokens served from the prefix cache, by source.",
    CACHE_SOURCE_LABELS,
)
SGLANG_CACHE_HIT_RATE = MetricSpec(
    "sglang:cache_hit_rate",
    "gauge",
    "Prefix-cache hit rate: cached / prompt tokens of recently finished requests.",
    ENGINE_LABELS,
)
SGLANG_KV_USED_TOKENS = MetricSpec(
    "sglang:kv_used_tokens", "gauge", "KV token slots used by running requests.", ENGINE_LABELS
)
SGLANG_KV_AVAILABLE_TOKENS = MetricSpec(
    "sglang:kv_available_tokens", "gauge", "Free KV token slots.", ENGINE_LABELS
)
SGLANG_KV_EVICTABLE_TOKENS = MetricSpec(
    "sglang:kv_evictable_tokens",
    "gauge",
    "KV token slots held by the prefix cache (evictable).",
    ENGINE_LABELS,
)

ENGINE_METRICS: tuple[MetricSpec, ...] = (
    SGLANG_NUM_QUEUE_REQS,
    SGLANG_NUM_RUNNING_REQS,
    SGLANG_NUM_PAUSED_REQS,
    SGLANG_GEN_THROUGHPUT,
    SGLANG_TOKEN_USAGE,
    SGLANG_NUM_USED_TOKENS,
    SGLANG_MAX_TOTAL_NUM_TOKENS,
    SGLANG_PROMPT_TOKENS_TOTAL,
    SGLANG_GENERATION_TOKENS_TOTAL,
    SGLANG_TIME_TO_FIRST_TOKEN,
    SGLANG_INTER_TOKEN_LATENCY,
    SGLANG_E2E_REQUEST_LATENCY,
    SGLANG_QUEUE_TIME,
    SGLANG_NUM_REQUESTS_TOTAL,
    SGLANG_NUM_ABORTED_REQUESTS_TOTAL,
    SGLANG_CACHED_TOKENS_TOTAL,
    SGLANG_CACHE_HIT_RATE,
    SGLANG_KV_USED_TOKENS,
    SGLANG_KV_AVAILABLE_TOKENS,
    SGLANG_KV_EVICTABLE_TOKENS,
)

# ----------------------------------------------------------- external: NVIDIA's DCGM exporter

DCGM_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname", "namespace", "pod", "container")
"""The DCGM exporter's labels: the GPU's index, UUID, device and model, the node, and (with its
Kubernetes pod mapping) the pod using the GPU.  mixrl reads ``modelName``, ``namespace``, ``pod``."""
DCGM_FI_DEV_GPU_UTIL = MetricSpec(
    "DCGM_FI_DEV_GPU_UTIL",
    "gauge",
    "GPU utilization (%), one series per GPU.  Exported by NVIDIA's DCGM exporter, never by mixrl:"
    " the autoscaler queries it for the GPU models under a pool's pods (WrongGpuType).",
    DCGM_LABELS,
)

# ------------------------------------------------------------------------- mixrl's own series

MIXRL_LABELS = ("run", "pool", "gpu_type", "precision")

# router — mixrl.rl.router (labels: MIXRL_LABELS).  Gauges and counters are read from the router's
# state at scrape time.  Queue depth, precisely: requests the router holds without having forwarded
# them, each waiting for an in-flight slot on its session's replica because that replica already has
# --max-inflight-per-replica requests outstanding (0 = no limit: the router queues nothing and the
# engines' sglang:num_queue_reqs is the queue).
# Latency buckets reach past the router's --request-timeout (900 s) plus a wait for a slot: the
# rollout's client gives up at 600 s (499) and the router answers 504 at 900 s, and those slow ends
# are what the histogram is for; a top bucket of 300 s put them all in +Inf.
ROUTER_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0,
)  # fmt: skip
MIXRL_ROUTER_SESSIONS = MetricSpec(
    "mixrl_router_sessions", "gauge", "Live agent sessions pinned to a pool.", MIXRL_LABELS
)
MIXRL_ROUTER_SESSIONS_ASSIGNED_TOTAL = MetricSpec(
    "mixrl_router_sessions_assigned_total",
    "counter",
    "Sessions assigned to a pool (new or moved in).",
    MIXRL_LABELS,
)
MIXRL_ROUTER_SESSIONS_MOVED_TOTAL = MetricSpec(
    "mixrl_router_sessions_moved_total",
    "counter",
    "Sessions that left a pool for another: the pool had no ready replica serving the request's"
    " minimum weight version (none ready, or none new enough), or it held too many sessions after"
    " losing replicas (rebalancing).",
    MIXRL_LABELS,
)
MIXRL_ROUTER_REQUESTS_TOTAL = MetricSpec(
    "mixrl_router_requests_total",
    "counter",
    "Requests forwarded to a pool that ended with a status: the replica's answer (any status), the"
    " router's 504 when the replica did not answer in time, or 499 when the client went away first."
    " Not counted: replica unreachable (in errors only), and requests never forwarded (400, or 503"
    " and 409 because no replica could take them).",
    MIXRL_LABELS,
)
MIXRL_ROUTER_ERRORS_TOTAL = MetricSpec(
    "mixrl_router_errors_total",
    "counter",
    "Requests forwarded to a pool that failed: replica unreachable, an error status (>= 400) from"
    " the engine, the router's 504 (no answer in time), or 499 (the client went away first).",
    MIXRL_LABELS,
)
MIXRL_ROUTER_REQUESTS_IN_FLIGHT = MetricSpec(
    "mixrl_router_requests_in_flight",
    "gauge",
    "Requests forwarded to a pool and not yet answered.",
    MIXRL_LABELS,
)
MIXRL_ROUTER_QUEUE_DEPTH = MetricSpec(
    "mixrl_router_queue_depth",
    "gauge",
    "Requests held by the router, waiting for an in-flight slot on their replica.",
    MIXRL_LABELS,
)
MIXRL_ROUTER_TRAFFIC_SHARE = MetricSpec(
    "mixrl_router_traffic_share",
    "gauge",
    "Share of all session assignments that went to a pool.",
    MIXRL_LABELS,
)
MIXRL_ROUTER_TARGET_SHARE = MetricSpec(
    "mixrl_router_target_share",
    "gauge",
    "Share of new sessions a pool should get: capacity per replica × ready replicas (× the pool's health under spec.health.routing), normalized.",
    MIXRL_LABELS,
)
MIXRL_ROUTER_REPLICAS = MetricSpec(
    "mixrl_router_replicas", "gauge", "Replicas the router knows per pool.", MIXRL_LABELS
)
MIXRL_ROUTER_REPLICAS_READY = MetricSpec(
    "mixrl_router_replicas_ready", "gauge", "Replicas that passed their last health check.", MIXRL_LABELS
)
MIXRL_ROUTER_GENERATED_TOKENS_TOTAL = MetricSpec(
    "mixrl_router_generated_tokens_total", "counter", "Completion tokens returned by a pool.", MIXRL_LABELS
)
MIXRL_ROUTER_POOL_HEALTH = MetricSpec(
    "mixrl_router_pool_health",
    "gauge",
    "A pool's health in [floor, 1] from its fresh mismatch (spec.health.routing); shares are capacity x health.",
    MIXRL_LABELS,
)
MIXRL_ROUTER_CAPACITY_PER_REPLICA = MetricSpec(
    "mixrl_router_capacity_per_replica",
    "gauge",
    "Capacity per replica the shares use, in the declared units: the declared one unless a trusted measurement is off it by more than 1.5x.",
    MIXRL_LABELS,
)
MIXRL_ROUTER_CAPACITY_MEASURED = MetricSpec(
    "mixrl_router_capacity_measured",
    "gauge",
    "A pool's measured capacity per replica in the declared units (its throughput over the fleet's tokens/s per declared unit); absent until measured.",
    MIXRL_LABELS,
)
MIXRL_ROUTER_WEIGHT_VERSION = MetricSpec(
    "mixrl_router_serving_weight_version",
    "gauge",
    "Newest weight version in a pool's answers (meta_info.weight_version): what the pool serves.",
    MIXRL_LABELS,
)
MIXRL_ROUTER_REQUEST_LATENCY = MetricSpec(
    "mixrl_router_request_latency_seconds",
    "histogram",
    "Time from receiving a /generate request to answering it, for requests forwarded to a replica"
    " (time waiting for an in-flight slot included), whatever their end: the replica's answer, 504,"
    " 499 or 503 (replica unreachable).  Not observed: requests never forwarded (400 for a bad"
    " request, 503 with no ready replica, 409 with none serving the minimum weight version).",
    MIXRL_LABELS,
    ROUTER_LATENCY_BUCKETS,
)
MIXRL_ROUTER_METRICS: tuple[MetricSpec, ...] = (
    MIXRL_ROUTER_SESSIONS,
    MIXRL_ROUTER_SESSIONS_ASSIGNED_TOTAL,
    MIXRL_ROUTER_SESSIONS_MOVED_TOTAL,
    MIXRL_ROUTER_REQUESTS_TOTAL,
    MIXRL_ROUTER_ERRORS_TOTAL,
    MIXRL_ROUTER_REQUESTS_IN_FLIGHT,
    MIXRL_ROUTER_QUEUE_DEPTH,
    MIXRL_ROUTER_TRAFFIC_SHARE,
    MIXRL_ROUTER_TARGET_SHARE,
    MIXRL_ROUTER_REPLICAS,
    MIXRL_ROUTER_REPLICAS_READY,
    MIXRL_ROUTER_GENERATED_TOKENS_TOTAL,
    MIXRL_ROUTER_WEIGHT_VERSION,
    MIXRL_ROUTER_POOL_HEALTH,
    MIXRL_ROUTER_CAPACITY_PER_REPLICA,
    MIXRL_ROUTER_CAPACITY_MEASURED,
    MIXRL_ROUTER_REQUEST_LATENCY,
)
# rollout
MIXRL_ROLLOUT_EPISODES_TOTAL = MetricSpec(
    "mixrl_rollout_episodes_total", "counter", "Finished episodes.", (*MIXRL_LABELS, "finish_reason")
)
MIXRL_ROLLOUT_FORMAT_ERROR_EPISODES_TOTAL = MetricSpec(
    "mixrl_rollout_format_error_episodes_total",
    "counter",
    "Episodes ended by repeated replies without a valid tool call.",
    MIXRL_LABELS,
)
MIXRL_ROLLOUT_TOKENS_TOTAL = MetricSpec(
    "mixrl_rollout_tokens_total", "counter", "Generated tokens received by rollout workers.", MIXRL_LABELS
)
MIXRL_ROLLOUT_REWARD = MetricSpec(
    "mixrl_rollout_reward", "gauge", "Mean episode reward (recent).", MIXRL_LABELS
)
MIXRL_ROLLOUT_TIED_SUPPORT_TOKENS_TOTAL = MetricSpec(
    "mixrl_rollout_tied_support_tokens_total",
    "counter",
    "Generated tokens whose sampling support was larger than the returned candidates (ties at the"
    " top-k cut); kept, the unreturned members recorded at the cut's log-prob.",
    MIXRL_LABELS,
)
MIXRL_ROLLOUT_TRAJECTORIES_ACKNOWLEDGED_TOTAL = MetricSpec(
    "mixrl_rollout_trajectories_acknowledged_total",
    "counter",
    "Trajectories the buffer acknowledged (answered 200 to); the buffer's durable count is never"
    " below it, whatever restarts in between.",
    ("run",),
)
# buffer — mixrl.rl.buffer.  Per-pool series use MIXRL_LABELS; whole-buffer series only "run".
# Staleness of a token = trainer step − its weight_version, observed when a batch is handed out.
BUFFER_LABELS = ("run",)
BUFFER_STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0)
MIXRL_BUFFER_TRAJECTORIES = MetricSpec(
    "mixrl_buffer_trajectories",
    "gauge",
    "Trajectories held by the buffer, not yet handed to a step.",
    MIXRL_LABELS,
)
MIXRL_BUFFER_TRAJECTORIES_RECEIVED_TOTAL = MetricSpec(
    "mixrl_buffer_trajectories_received_total", "counter", "Trajectories received and logged.", MIXRL_LABELS
)
MIXRL_BUFFER_STALENESS = MetricSpec(
    "mixrl_buffer_staleness",
    "histogram",
    "Per generated token handed to the trainer: trainer step minus the token's weight version.",
    MIXRL_LABELS,
    BUFFER_STALENESS_BUCKETS,
)
MIXRL_BUFFER_DROPPED_TOTAL = MetricSpec(
    "mixrl_buffer_dropped_total",
    "counter",
    "Trajectories dropped as too stale (in dropped groups).",
    MIXRL_LABELS,
)
MIXRL_BUFFER_DROPPED_GROUPS_TOTAL = MetricSpec(
    "mixrl_buffer_dropped_groups_total",
    "counter",
    "Groups dropped as older than maxStaleness.",
    BUFFER_LABELS,
)
MIXRL_BUFFER_GROUPS_READY = MetricSpec(
    "mixrl_buffer_groups_ready", "gauge", "Full groups waiting for a trainer step.", BUFFER_LABELS
)
MIXRL_BUFFER_GROUPS_PARTIAL = MetricSpec(
    "mixrl_buffer_groups_partial",
    "gauge",
    "Groups with fewer than samplesPerPrompt trajectories.",
    BUFFER_LABELS,
)
MIXRL_BUFFER_BATCHES_TOTAL = MetricSpec(
    "mixrl_buffer_batches_total",
    "counter",
    "Batches served to the trainer, quarantined ones included (a step re-batched after a quarantine counts again).",
    BUFFER_LABELS,
)
MIXRL_BUFFER_QUARANTINED_BATCHES_TOTAL = MetricSpec(
    "mixrl_buffer_quarantined_batches_total",
    "counter",
    "Batches the trainer could not train, taken back from their step and kept for inspection.",
    BUFFER_LABELS,
)
MIXRL_BUFFER_DUPLICATE_TRAJECTORIES_TOTAL = MetricSpec(
    "mixrl_buffer_duplicate_trajectories_total",
    "counter",
    "Posted trajectories already stored with the same content (retried posts), acknowledged and not stored again.",
    BUFFER_LABELS,
)
MIXRL_BUFFER_STEP = MetricSpec(
    "mixrl_buffer_step", "gauge", "Latest trainer step that asked for a batch.", BUFFER_LABELS
)
MIXRL_BUFFER_COMMITTED_STEP = MetricSpec(
    "mixrl_buffer_committed_step", "gauge", "Latest step whose batch the trainer committed.", BUFFER_LABELS
)
MIXRL_BUFFER_TRAINER_WAIT_SECONDS_TOTAL = MetricSpec(
    "mixrl_buffer_trainer_wait_seconds_total",
    "counter",
    "Seconds the trainer's POST /batch requests (its main rank's; other ranks read with GET) waited"
    " for data (its rate is the trainer's idle share, 0 to 1).",
    BUFFER_LABELS,
)
MIXRL_BUFFER_TRAINER_BUSY_SECONDS = MetricSpec(
    "mixrl_buffer_trainer_busy_seconds",
    "gauge",
    "Seconds from handing the trainer a batch (POST /batch) to its next POST /batch: its compute"
    " time per step.",
    BUFFER_LABELS,
)
MIXRL_BUFFER_EVAL_PASS_AT_K = MetricSpec(
    "mixrl_buffer_eval_pass_at_k",
    "gauge",
    "Latest held-out pass@k posted by the rollout.",
    (*BUFFER_LABELS, "k"),
)
MIXRL_BUFFER_METRICS: tuple[MetricSpec, ...] = (
    MIXRL_BUFFER_TRAJECTORIES,
    MIXRL_BUFFER_TRAJECTORIES_RECEIVED_TOTAL,
    MIXRL_BUFFER_STALENESS,
    MIXRL_BUFFER_DROPPED_TOTAL,
    MIXRL_BUFFER_DROPPED_GROUPS_TOTAL,
    MIXRL_BUFFER_GROUPS_READY,
    MIXRL_BUFFER_GROUPS_PARTIAL,
    MIXRL_BUFFER_BATCHES_TOTAL,
    MIXRL_BUFFER_QUARANTINED_BATCHES_TOTAL,
    MIXRL_BUFFER_DUPLICATE_TRAJECTORIES_TOTAL,
    MIXRL_BUFFER_STEP,
    MIXRL_BUFFER_COMMITTED_STEP,
    MIXRL_BUFFER_TRAINER_WAIT_SECONDS_TOTAL,
    MIXRL_BUFFER_TRAINER_BUSY_SECONDS,
    MIXRL_BUFFER_EVAL_PASS_AT_K,
)
# trainer
MIXRL_TRAINER_STEP = MetricSpec("mixrl_trainer_step", "gauge", "Optimizer steps taken.", MIXRL_LABELS)
MIXRL_TRAINER_WEIGHT_VERSION = MetricSpec(
    "mixrl_trainer_weight_version", "gauge", "Latest published weight version.", MIXRL_LABELS
)
MIXRL_TRAINER_REWARD = MetricSpec(
    "mixrl_trainer_reward", "gauge", "Mean reward of the last batch.", MIXRL_LABELS
)
MIXRL_TRAINER_KL = MetricSpec(
    "mixrl_trainer_kl", "gauge", "Sampler-trainer KL per token (k3), last batch.", MIXRL_LABELS
)
MIXRL_TRAINER_KL_FRESH = MetricSpec(
    "mixrl_trainer_kl_fresh",
    "gauge",
    "Sampler-trainer KL per token (k3) over fresh tokens only (staleness 0: sampled with the weights"
    " the trainer scored them with), last batch: the precision and kernel mismatch without drift."
    " k3 is unbiased for KL(sampler || trainer) only when the sampler's distribution is the one the"
    " trainer compares with (top-p replay on, or no top-p).",
    MIXRL_LABELS,
)
MIXRL_TRAINER_EXTREME_RATIO_SHARE = MetricSpec(
    "mixrl_trainer_extreme_ratio_share", "gauge", "Share of tokens with ratio outside [0.2, 5].", MIXRL_LABELS
)
MIXRL_TRAINER_GRAD_NORM = MetricSpec(
    "mixrl_trainer_grad_norm", "gauge", "Gradient norm, last step.", MIXRL_LABELS
)
MIXRL_TRAINER_ENTROPY = MetricSpec(
    "mixrl_trainer_entropy", "gauge", "Mean trainer entropy per token.", MIXRL_LABELS
)
MIXRL_TRAINER_STALENESS = MetricSpec(
    "mixrl_trainer_staleness", "gauge", "Mean weight-version lag of trained tokens.", MIXRL_LABELS
)
MIXRL_TRAINER_FORMAT_ERROR_ENDINGS = MetricSpec(
    "mixrl_trainer_format_error_endings",
    "gauge",
    "Share of the last batch's episodes that ended on repeated format errors (a sign of collapse).",
    MIXRL_LABELS,
)
MIXRL_TRAINER_FINISHED = MetricSpec(
    "mixrl_trainer_finished",
    "gauge",
    "1 once the trainer has taken trainer.totalSteps steps and published the last version, else 0.",
    MIXRL_LABELS,
)
MIXRL_TRAINER_TOKENS_TOTAL = MetricSpec(
    "mixrl_trainer_tokens_total", "counter", "Tokens trained on.", MIXRL_LABELS
)
MIXRL_COST_DOLLARS_TOTAL = MetricSpec(
    "mixrl_cost_dollars_total",
    "counter",
    "GPU cost of a pool's replicas the router knows (pods with an address), accrued each monitoring"
    " round: replicas × gpusPerReplica × costPerGpuHour (else the default table of mixrl.api.gpus).",
    MIXRL_LABELS,
)

# authentication — mixrl.rl.auth, in the registry of every server that checks the run's token
MIXRL_AUTH_REFUSED_TOTAL = MetricSpec(
    "mixrl_auth_refused_requests_total",
    "counter",
    "Requests refused for want of the run's token (reason: missing or wrong); a rise means a caller"
    " without the run's Secret keeps trying.",
    ("run", "component", "reason"),
)

MIXRL_METRICS: tuple[MetricSpec, ...] = (
    *MIXRL_ROUTER_METRICS,
    MIXRL_ROLLOUT_EPISODES_TOTAL,
    MIXRL_ROLLOUT_FORMAT_ERROR_EPISODES_TOTAL,
    MIXRL_ROLLOUT_TOKENS_TOTAL,
    MIXRL_ROLLOUT_REWARD,
    MIXRL_ROLLOUT_TIED_SUPPORT_TOKENS_TOTAL,
    MIXRL_ROLLOUT_TRAJECTORIES_ACKNOWLEDGED_TOTAL,
    *MIXRL_BUFFER_METRICS,
    MIXRL_TRAINER_STEP,
    MIXRL_TRAINER_WEIGHT_VERSION,
    MIXRL_TRAINER_REWARD,
    MIXRL_TRAINER_KL,
    MIXRL_TRAINER_KL_FRESH,
    MIXRL_TRAINER_EXTREME_RATIO_SHARE,
    MIXRL_TRAINER_GRAD_NORM,
    MIXRL_TRAINER_ENTROPY,
    MIXRL_TRAINER_STALENESS,
    MIXRL_TRAINER_FORMAT_ERROR_ENDINGS,
    MIXRL_TRAINER_FINISHED,
    MIXRL_TRAINER_TOKENS_TOTAL,
    MIXRL_COST_DOLLARS_TOTAL,
    MIXRL_AUTH_REFUSED_TOTAL,
)
