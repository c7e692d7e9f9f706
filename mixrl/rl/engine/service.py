"""The engine service: a loaded model, its runner and scheduler, and the operations the HTTP API exposes.

Kept apart from aiohttp so the operations read plainly and the HTTP layer only translates.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from mixrl import __version__
from mixrl.api.trajectory import TokenRecord
from mixrl.rl import activation_quant
from mixrl.rl.activation_quant import ACTIVATION_MODES
from mixrl.rl.engine import weights_io
from mixrl.rl.engine.attention import ATTENTION_BACKENDS
from mixrl.rl.engine.kv_cache import KV_CACHE_DTYPES
from mixrl.rl.engine.protocol import GenerateItem, RequestError, build_response, clip, get_load_entry
from mixrl.rl.engine.runner import ModelRunner, Sequence
from mixrl.rl.engine.sampling import RowSampling
from mixrl.rl.engine.scheduler import Scheduler
from mixrl.rl.engine.staging import PREPARERS, PreparationRefused, Prepared, StagedWeights
from mixrl.rl.engine.stats import EngineStats, FinishedRequest
from mixrl.rl.engine.text import load_codec
from mixrl.rl.engine.version_gate import parse_version
from mixrl.rl.quant import WEIGHT_FORMATS
from mixrl.rl.tiny_models import load_model
from mixrl.rl.weights import MANIFEST, MAX_VERSION

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ConfigError(ValueError):
    """A bad :class:`EngineConfig` value: ``"<field>: <reason>"``.  The command line reports it
    under the field's flag (``mixrl.rl.engine.server.config_from_args``), so each check is written
    once, here, for both ways of building a config."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    weight_precision: str = "bf16"
    kv_cache_dtype: str = "bf16"
    dtype: str = "float32"
    pool: str = "default"
    weight_version: int = 0
    served_model_name: str = ""
    max_running_requests: int = 64
    context_length: int = 0  # 0: the model's max_position_embeddings
    max_total_tokens: int = 0  # 0: max_running_requests × context_length
    sampling_mask_max_tokens: int = 4096
    random_seed: int = 0
    use_kv_cache: bool = True
    radix_cache: bool = True
    """Keep finished sequences' keys and values for requests that extend them (off: --disable-radix-cache)."""
    prefix_cache_max_tokens: int = 0
    """The prefix cache's budget in tokens, LRU-evicted; 0: the KV budget (max_total_tokens)."""
    weight_root: str = ""
    """Weight updates load only from inside this directory; "": the directory holding --model-path
    (after following links), which is the weight store when the engine starts from a version."""
    max_request_mib: int = 8
    """Largest request body, in MiB (413 beyond it)."""
    tokenizer_path: str = ""
    """The tokenizer for text in and out; "": the model path, if it holds one (as SGLang)."""
    skip_tokenizer_init: bool = False
    """Token-in/token-out only, as SGLang's --skip-tokenizer-init."""
    weight_preparer: str = "auto"
    """Where weight updates are prepared while decoding: process, thread or auto (by model size)."""
    activation_quant: str = "auto"
    """auto: GEMM inputs quantized as the precision's kernels do (W8A8, W4A4); off: weights only."""
    attention_backend: str = "sdpa"
    """sdpa: the trainer's attention order; split_kv: a serving kernel's (engine/attention.py)."""

    def __post_init__(self) -> None:
        if self.weight_precision not in WEIGHT_FORMATS:
            raise ConfigError("weight_precision", f"must be one of {', '.join(WEIGHT_FORMATS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ConfigError("dtype", f"must be one of {', '.join(COMPUTE_DTYPES)}")
        if not 0 <= self.weight_version <= MAX_VERSION:
            raise ConfigError("weight_version", f"must be in [0, {MAX_VERSION}], got {self.weight_version}")
        if self.max_request_mib < 1:
            raise ConfigError("max_request_mib", f"must be >= 1, got {self.max_request_mib}")
        if self.max_running_requests < 1:
            raise ConfigError("max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        # 0 means "derived" for both (see the fields); a negative value would start an engine that
        # refuses every prompt, or one whose prefix cache is silently off and whose capacity gauge
        # is negative
        if self.context_length < 0:
            raise ConfigError(
                "context_length",
                f"must be >= 0 (0: the model's max_position_embeddings), got {self.context_length}",
            )
        if self.max_total_tokens < 0:
            raise ConfigError(
                "max_total_tokens",
                f"must be >= 0 (0: the running-request limit × the context length), got {self.max_total_tokens}",
            )
        if self.sampling_mask_max_tokens < 1:
            raise ConfigError(
                "sampling_mask_max_tokens", f"must be >= 1, got {self.sampling_mask_max_tokens}"
            )
        if self.weight_preparer not in PREPARERS:
            raise ConfigError(
                "weight_preparer", f"must be one of {', '.join(PREPARERS)}, got {self.weight_preparer!r}"
            )
        if self.activation_quant not in ACTIVATION_MODES:
            raise ConfigError(
                "activation_quant",
                f"must be one of {', '.join(ACTIVATION_MODES)}, got {self.activation_quant!r}",
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                "attention_backend",
                f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}",
            )
        if self.prefix_cache_max_tokens < 0:
            raise ConfigError("prefix_cache_max_tokens", f"must be >= 0, got {self.prefix_cache_max_tokens}")


MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


def confined_path(field: str, raw: str, root: Path) -> Path:
    """``raw`` resolved, if it names a place inside ``root``; otherwise RequestError naming ``field``.

    The path must be absolute and free of ``..``, and it is resolved (links followed) before the
    comparison, so a link inside the root that points out of it is outside too.  Nothing is read
    and nothing is said about what lies outside the root.
    """
    if len(raw) > MAX_PATH_CHARS:
        raise RequestError(field, f"is longer than {MAX_PATH_CHARS} characters")
    if "\x00" in raw:
        raise RequestError(field, "contains a NUL character")
    path = Path(raw)
    if not path.is_absolute():
        raise RequestError(field, f"must be an absolute path inside the weight root {root}, got {raw!r}")
    if ".." in path.parts:
        raise RequestError(field, f"must not contain '..' components, got {raw!r}")
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise RequestError(field, f"is outside the weight root {root} (--weight-root), got {raw!r}")
    return resolved


def engine_rid(prefix: str) -> str:
    """An id the engine gives a request itself (one without ``rid``, the health probe): the prefix
    and a random UUID, as SGLang's ``uuid.uuid4().hex``.  The server refuses a client's id only
    against the client ids in flight, and ``/abort_request`` aborts every sequence of an id, so a
    guessable engine id (a counter's ``mixrl-<n>``) could be taken by a client's request, and
    aborting either would abort both."""
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Snapshot:
    """A sequence as it stood between two model steps (what one streamed chunk shows)."""

    rid: str
    prompt_ids: list[int]
    tokens: list[TokenRecord]
    finish_reason: dict[str, Any] | None
    cached_tokens: int
    e2e_latency: float

    @classmethod
    def of(cls, seq: Sequence, e2e_latency: float) -> Snapshot:
        reason = dict(seq.finish_reason) if seq.finish_reason else None
        return cls(seq.rid, seq.prompt_ids, list(seq.tokens), reason, seq.cached_tokens, e2e_latency)


@dataclass
class _Tracked:
    """A request followed by the service: its sequence, and the tokens seen at the last step."""

    seq: Sequence
    streaming: bool
    arrival: float
    log_metrics: bool = True
    seen: int = 0
    last: float = 0.0


def serving_model(config: EngineConfig) -> tuple[PreTrainedModel, dict, activation_quant.ModelInputs | None]:
    """The model as the engine serves it, from ``config.model_path``: its weights at the pool's
    precision in the compute dtype, and its quantized GEMM inputs, calibrated (None: the precision
    has none, or --activation-quant off); plus apply_precision_'s report.  The attention is
    switched by the runner (``config.attention_backend``)."""
    model = load_model(config.model_path, dtype=torch.float32)
    report = weights_io.apply_precision_(model, config.weight_precision, COMPUTE_DTYPES[config.dtype])
    inputs = (
        activation_quant.install_(model, config.weight_precision, report["quantized"])
        if config.activation_quant == "auto"
        else None
    )
    if inputs:
        inputs.calibrated(model)
    return model, report, inputs


class EngineService:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.compute_dtype = COMPUTE_DTYPES[config.dtype]
        model, self.quantization, self.inputs = serving_model(config)
        self.model_config = model.config
        self.num_layers = int(model.config.num_hidden_layers)
        self.context_length = config.context_length or int(model.config.max_position_embeddings)
        self.model_path = config.model_path
        self.weight_root = Path(config.weight_root or Path(config.model_path).resolve().parent).resolve()
        max_total = config.max_total_tokens or config.max_running_requests * self.context_length
        runner = ModelRunner(
            model,
            weight_version=config.weight_version,
            context_length=self.context_length,
            kv_scales=self._kv_scales(weights_io.kv_scale_tensors_in_dir(config.model_path)),
            pad_token_id=int(model.config.pad_token_id or 0),
            use_kv_cache=config.use_kv_cache,
            seed=config.random_seed,
            prefix_cache_tokens=(config.prefix_cache_max_tokens or max_total) if config.radix_cache else 0,
            attention_backend=config.attention_backend,
        )
        self.runner = runner
        self._staging = StagedWeights(
            model.config,
            config.weight_precision,
            self.compute_dtype,
            config.weight_preparer,
            calibrate_inputs=bool(self.inputs and self.inputs.needs_calibration),
        )
        self.codec = load_codec(
            config.model_path, config.tokenizer_path or None, config.skip_tokenizer_init, runner.vocab_size
        )
        self.eos_token_ids = _eos_ids(model)
        self.sampling_defaults = _generation_defaults(model)
        self.served_model_name = config.served_model_name or config.model_path
        self.stats = EngineStats(self.served_model_name, max_total)
        self.scheduler: Scheduler | None = None
        self._update_lock = asyncio.Lock()
        self.last_swap_s = 0.0
        """How long the last update's swap took on the model thread (between two decode steps)."""
        self._live: dict[int, _Tracked] = {}
        self.stats.add_listener(self._on_tokens)

    def _kv_scales(self, tensors: dict[str, torch.Tensor]) -> list[tuple[float, float] | None]:
        if self.config.kv_cache_dtype != "fp8":
            return [None] * self.num_layers
        return list(weights_io.kv_scales_from_tensors(tensors, self.num_layers))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.scheduler = Scheduler(self.runner, self.stats, max_running=self.config.max_running_requests)
        self.scheduler.start()

    async def stop(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.stop()
        await asyncio.to_thread(self._staging.close)

    @property
    def sched(self) -> Scheduler:
        if self.scheduler is None:
            raise RuntimeError("engine not started")
        return self.scheduler

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def weight_version(self) -> int:
        return self.runner.weight_version

    # ------------------------------------------------------------------ generation
    def new_sequence(self, item: GenerateItem) -> Sequence:
        s = item.sampling
        stop_ids = set(s.stop_token_ids)
        if not s.ignore_eos:
            stop_ids |= self.eos_token_ids
        stop_check = None
        if s.stop and self.codec is not None:
            stop_check = self.codec.stop_check(s.stop, s.skip_special_tokens)
        return Sequence(
            rid=item.rid or engine_rid("mixrl"),
            prompt_ids=item.input_ids,
            sampling=RowSampling(
                **asdict(s.rule),
                num_candidates=item.top_logprobs_num if item.return_logprob else 0,
                cover_support=item.return_sampling_mask,
                support_cap=self.config.sampling_mask_max_tokens,
            ),
            max_new_tokens=s.max_new_tokens,
            stop_token_ids=frozenset(stop_ids),
            generator=None if s.sampling_seed is None else torch.Generator().manual_seed(s.sampling_seed),
            stop_check=stop_check,
        )

    def _track(self, item: GenerateItem, streaming: bool) -> _Tracked:
        """A new sequence for ``item``, followed token by token (inter-token latency) until
        :meth:`_done` records it (in the metrics unless the item says ``log_metrics: false``)."""
        seq = self.new_sequence(item)
        tracked = _Tracked(seq, streaming, arrival=time.perf_counter(), log_metrics=item.log_metrics)
        self._live[id(seq)] = tracked
        return tracked

    def _on_tokens(self, now: float) -> None:
        # between two model steps, so the prefix cache is not changing under us
        self.stats.evictable_tokens = self.runner.prefix_cache_tokens()
        for tracked in self._live.values():
            count = len(tracked.seq.tokens)
            if count > tracked.seen:
                if tracked.seen > 0 and tracked.log_metrics:  # the first token's wait is the TTFT
                    self.stats.inter_token(now - tracked.last, count - tracked.seen)
                tracked.seen, tracked.last = count, now

    def _done(self, tracked: _Tracked) -> None:
        """Record a request that ended: finished, or given up by its client (its handler was
        cancelled before the scheduler marked the abort, which it does at the next step)."""
        self._live.pop(id(tracked.seq), None)
        seq = tracked.seq
        if not tracked.log_metrics:
            return
        reason = seq.finish_reason
        self.stats.request_finished(
            FinishedRequest(
                streaming=tracked.streaming,
                arrival=tracked.arrival,
                first_token=seq.first_token_time,
                end=time.perf_counter(),
                prompt_tokens=len(seq.prompt_ids),
                completion_tokens=len(seq.tokens),
                cached_tokens=seq.cached_tokens,
                aborted=reason is None or reason.get("type") == "abort",
            )
        )

    async def run(self, items: list[GenerateItem]) -> list[Sequence]:
        """Generate every item to its end; the finished sequences, in order."""
        tracked = [self._track(item, streaming=False) for item in items]

        async def one(t: _Tracked) -> Sequence:
            try:
                return await self.sched.generate(t.seq)
            finally:
                self._done(t)

        return list(await asyncio.gather(*(one(t) for t in tracked)))

    async def generate(self, items: list[GenerateItem]) -> list[dict[str, Any]]:
        """/generate: one SGLang response per item."""
        start = time.perf_counter()
        seqs = await self.run(items)
        elapsed = time.perf_counter() - start
        return [build_response(item, seq, elapsed, self.codec) for item, seq in zip(items, seqs, strict=True)]

    async def stream(self, items: list[GenerateItem]) -> AsyncGenerator[tuple[int, Snapshot], None]:
        """Streaming: (item index, the item's sequence so far) every ``stream_interval`` tokens of an
        item and once at its end (with its ``finish_reason``), as SGLang streams them.  Closing the
        iterator early aborts the items still running.

        Chunks are built when the scheduler reports a step (on the event loop, between two model
        steps), so each chunk is exactly the tokens of the steps so far.
        """
        start = time.perf_counter()
        tracked = [self._track(item, streaming=True) for item in items]
        tasks = [asyncio.ensure_future(self.sched.generate(t.seq)) for t in tracked]
        chunks: asyncio.Queue[tuple[int, Snapshot]] = asyncio.Queue()
        sent = [0] * len(items)
        final = [False] * len(items)

        def emit(i: int) -> None:
            seq = tracked[i].seq
            if seq.finished:
                final[i] = True
                self._done(tracked[i])
            sent[i] = len(seq.tokens)
            chunks.put_nowait((i, Snapshot.of(seq, time.perf_counter() - start)))

        def on_step(now: float) -> None:
            for i, t in enumerate(tracked):
                due = len(t.seq.tokens) - sent[i] >= items[i].sampling.stream_interval
                if not final[i] and (t.seq.finished or due):
                    emit(i)

        self.stats.add_listener(on_step)
        getter: asyncio.Future[tuple[int, Snapshot]] | None = None
        try:
            while True:
                while not chunks.empty():
                    yield chunks.get_nowait()
                if all(final):
                    break
                getter = asyncio.ensure_future(chunks.get())
                running = [task for task, f in zip(tasks, final, strict=True) if not f and not task.done()]
                await asyncio.wait([getter, *running], return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
                for i, task in enumerate(tasks):
                    if task.done() and not final[i]:  # finished without a step report (shutdown)
                        emit(i)
        finally:
            self.stats.remove_listener(on_step)
            if getter is not None and not getter.done():
                # A client gone mid-wait closes this generator there: a getter left pending would be
                # destroyed pending ("Task was destroyed but it is pending!" in the log).
                getter.cancel()
            for i, (t, task) in enumerate(zip(tracked, tasks, strict=True)):
                if not final[i]:
                    task.cancel()  # the scheduler aborts the sequence before its next step
                    self._done(t)

    # ------------------------------------------------------------------ weights
    async def update_weights_from_disk(
        self, model_path: str, version: int | None, abort_all_requests: bool
    ) -> tuple[bool, str]:
        """Load, check and apply a checkpoint between two decode steps; on any failure keep the old weights.

        ``model_path`` must lie inside the weight root (RequestError naming it otherwise).  The
        update runs to its end even if the caller goes away (it is shielded from the handler's
        cancellation), so the served weights and their version always agree.
        """
        directory = confined_path("model_path", model_path, self.weight_root)
        return await asyncio.shield(self._update(model_path, directory, version, abort_all_requests))

    async def _update(
        self, model_path: str, directory: Path, version: int | None, abort_all_requests: bool
    ) -> tuple[bool, str]:
        shown = clip(model_path)
        async with self._update_lock:
            live = self.runner.model
            try:
                prepared = await asyncio.to_thread(self._staging.prepare_dir, live, str(directory))
            except PreparationRefused as exc:
                return False, f"refused {shown}: {clip(str(exc), 1000)}"
            if version is None:
                if prepared.manifest_version is None:
                    return False, "weight_version: required (the checkpoint does not name its version)"
                try:
                    version = parse_version("weight_version", prepared.manifest_version)
                except RequestError as exc:
                    return False, f"refused {shown}: {MANIFEST} names a bad version: {exc}"
            ok, message = await self._swap(prepared, version, abort_all_requests, shown)
            if ok:
                self.model_path = model_path
                log.info("weights updated to version %d from %s", version, directory.name)
            return ok, message

    async def apply_state(
        self, state: dict[str, torch.Tensor], version: int, source: str, abort_all_requests: bool = False
    ) -> tuple[bool, str]:
        """Serve ``state`` (a BF16 serving-layout state dict received by other means than a
        directory, e.g. a broadcast) as ``version``: checked, prepared while decoding, swapped
        between two decode steps; on any failure the old weights stay."""
        async with self._update_lock:
            try:
                prepared = await asyncio.to_thread(self._staging.prepare_state, self.runner.model, state)
            except PreparationRefused as exc:
                return False, f"refused {clip(source)}: {clip(str(exc), 1000)}"
            return await self._swap(prepared, version, abort_all_requests, clip(source))

    async def _swap(
        self, prepared: Prepared, version: int, abort_all_requests: bool, shown: str
    ) -> tuple[bool, str]:
        """Serve what the preparer made ready, between two decode steps.

        The preparation (reading, checking, rounding to bf16, the pool's quantization, the cast to
        the compute dtype) ran in the preparer (:mod:`mixrl.rl.engine.staging`: a process of its
        own, or a thread of the engine for a small model, ``--weight-preparer``) while the
        scheduler kept stepping the live model; the scheduler runs only the swap: one pointer
        exchange per parameter, the version and the KV-cache scales.  So the pause an update causes
        is the swap (one pointer exchange per parameter; kept as ``last_swap_s``), not the load (``bench/weight_sync.py`` measures both).
        """
        try:
            kv_scales = self._kv_scales(prepared.kv_scale_tensors)
            if self.inputs and self.inputs.needs_calibration:
                self.inputs.check(prepared.input_amax)
        except ValueError as exc:
            return False, f"refused {shown}: {clip(str(exc), 1000)}"
        if abort_all_requests:
            self.sched.abort_all("aborted for a weight update")

        def swap() -> None:
            started = time.perf_counter()
            self._staging.swap_into(self.runner.model)
            if self.inputs and self.inputs.needs_calibration:
                self.inputs.set_amax(prepared.input_amax)
            self.runner.weight_version = version
            self.runner.kv_scales = kv_scales
            self.last_swap_s = time.perf_counter() - started

        await self.sched.control(swap)
        self.quantization = prepared.report
        return True, f"Succeeded to update model weights to version {version}."

    async def set_weight_version(self, version: int, abort_all_requests: bool) -> None:
        if abort_all_requests:
            self.sched.abort_all("aborted for a weight version update")

        def relabel() -> None:
            self.runner.weight_version = version

        await self.sched.control(relabel)

    # ------------------------------------------------------------------ info
    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.codec.path if self.codec else None,
            "is_generation": True,
            "weight_version": str(self.weight_version),
            "served_model_name": self.served_model_name,
            "preferred_sampling_params": self.sampling_defaults or None,
        }

    def load(self) -> list[dict[str, Any]]:
        """SGLang's ``GET /get_load``: one entry per data-parallel rank (the engine has one)."""
        # prompts not yet prefilled: the requests followed by the service that have no token yet
        waiting = sum(len(t.seq.prompt_ids) for t in self._live.values() if not t.seq.tokens)
        return [
            get_load_entry(
                running=self.sched.num_running,
                waiting=self.sched.num_waiting,
                used_tokens=self.runner.kv_used_tokens(),
                pending_tokens=waiting,
                now=time.perf_counter(),
            )
        ]

    def server_info(self) -> dict[str, Any]:
        report = self.quantization
        return {
            **{k: v for k, v in asdict(self.config).items() if k != "model_path"},
            "model_path": self.model_path,
            "weight_root": str(self.weight_root),  # the effective root, also when defaulted
            "engine": "mixrl-torch",
            "version": __version__,
            "weight_version": str(self.weight_version),
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "kv_cache_dtype_sglang": "fp8_e4m3" if self.config.kv_cache_dtype == "fp8" else "auto",
            "max_total_num_tokens": self.stats.max_total_tokens,
            "paused": self.sched.paused,
            "num_running_reqs": self.sched.num_running,
            "num_queue_reqs": self.sched.num_waiting,
            "quantization": {
                "format": report.get("format"),
                "quantized": len(report.get("quantized", [])),
                "kept": report.get("kept", {}),
                "mean_relative_error": report.get("mean_relative_error"),
            },
        }


def _eos_ids(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return ids


def _generation_defaults(model: torch.nn.Module) -> dict[str, Any]:
    """Defaults for the sampling parameters a request omits, on /generate and both /v1 routes:
    generation_config.json's temperature, top_p and top_k (0 there: off, -1), only when it sets
    do_sample (transformers ignores them without it).  SGLang differs (docs/engine.md,
    "/generate"): its /generate uses --preferred-sampling-params, and only its
    /v1/chat/completions reads generation_config.json, without the do_sample check."""
    gen = getattr(model, "generation_config", None)
    if gen is None or not getattr(gen, "do_sample", False):
        return {}
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(gen, name, None)
        if value is not None:
            out[name] = value if name != "top_k" or value > 0 else -1
    return out
