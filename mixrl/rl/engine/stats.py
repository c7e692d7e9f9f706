"""The engine's Prometheus series, under SGLang's names, types and labels (mixrl/rl/metrics.py), in a
per-server registry.

As in SGLang 0.5.23: scheduler-side series (load, KV cache, cache hit rate, queue time) carry
``model_name, engine_type, tp_rank, pp_rank, moe_ep_rank``; per-request series are recorded when a
request finishes and carry ``model_name, engine_type`` (plus ``is_streaming`` for the token counts,
request count, time to first token and end-to-end latency, and ``cache_source`` for cached tokens);
``inter_token_latency_seconds`` gets one observation per token: a chunk of k new tokens that
arrived t seconds after the previous one counts k observations of t / k, as SGLang's collector does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest

from mixrl.rl import metrics as m

THROUGHPUT_WINDOW_S = 10.0
ENGINE_TYPE = "unified"  # SGLang's value without prefill/decode disaggregation
CACHE_SOURCE = "device"  # the prefix cache lives in the engine's own KV memory (SGLang: device)


@dataclass(frozen=True)
class FinishedRequest:
    """What the per-request series need of one finished request."""

    streaming: bool
    arrival: float
    first_token: float | None
    end: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    aborted: bool


class EngineStats:
    """Collectors for one engine; a fresh registry, so several engines can live in one process."""

    def __init__(self, model_name: str, max_total_tokens: int) -> None:
        self.registry = CollectorRegistry()
        self._request_labels = {"model_name": model_name, "engine_type": ENGINE_TYPE}
        self._engine_labels = {**self._request_labels, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        self._c = {spec.name: m.create(spec, self.registry) for spec in m.ENGINE_METRICS}
        self.max_total_tokens = max_total_tokens
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_prompts: deque[tuple[float, int, int]] = deque()  # (end, cached, prompt tokens)
        self._listeners: list[Callable[[float], None]] = []
        self.evictable_tokens = 0  # held by the prefix cache (EngineService sets it after each step)
        self._get(m.SGLANG_MAX_TOTAL_NUM_TOKENS).set(max_total_tokens)
        self._get(m.SGLANG_KV_AVAILABLE_TOKENS).set(max_total_tokens)
        for spec in m.ENGINE_METRICS:  # expose every series from the start, at 0
            if spec.kind == "histogram":
                continue
            if "is_streaming" in spec.labels:
                for streaming in (False, True):
                    self._get(spec, streaming=streaming)
            elif "cache_source" in spec.labels:
                self._get(spec, cache_source=CACHE_SOURCE)
            else:
                self._get(spec)

    def _get(self, spec: m.MetricSpec, *, streaming: bool | None = None, cache_source: str | None = None):
        labels = dict(self._engine_labels if spec.labels == m.ENGINE_LABELS else self._request_labels)
        if "is_streaming" in spec.labels:
            labels["is_streaming"] = "true" if streaming else "false"
        if "cache_source" in spec.labels:
            labels["cache_source"] = cache_source or CACHE_SOURCE
        return self._c[spec.name].labels(**labels)

    # ------------------------------------------------------------------ the scheduler's hooks
    def set_load(self, queued: int, running: int, paused: int, used_tokens: int) -> None:
        self._get(m.SGLANG_NUM_QUEUE_REQS).set(queued)
        self._get(m.SGLANG_NUM_RUNNING_REQS).set(running)
        self._get(m.SGLANG_NUM_PAUSED_REQS).set(paused)
        self._get(m.SGLANG_NUM_USED_TOKENS).set(used_tokens)
        self._get(m.SGLANG_KV_USED_TOKENS).set(used_tokens)
        self._get(m.SGLANG_KV_EVICTABLE_TOKENS).set(self.evictable_tokens)
        free = self.max_total_tokens - used_tokens - self.evictable_tokens
        self._get(m.SGLANG_KV_AVAILABLE_TOKENS).set(max(0, free))
        self._get(m.SGLANG_TOKEN_USAGE).set(
            used_tokens / self.max_total_tokens if self.max_total_tokens else 0.0
        )
        self._get(m.SGLANG_GEN_THROUGHPUT).set(self.throughput())

    def tokens_generated(self, count: int, now: float | None = None) -> None:
        """Called on the event loop after every model step (prefill or decode), ``count`` tokens
        produced by it; tells the listeners (streams, the inter-token latency) that tokens arrived."""
        now = time.perf_counter() if now is None else now
        if count:
            self._recent.append((now, count))
        for listener in list(self._listeners):
            listener(now)

    def admitted(self, prompt_tokens: int, queue_time: float) -> None:
        self._get(m.SGLANG_QUEUE_TIME).observe(queue_time)

    # ------------------------------------------------------------------ the service's hooks
    def add_listener(self, listener: Callable[[float], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[float], None]) -> None:
        self._listeners.remove(listener)

    def inter_token(self, interval: float, new_tokens: int) -> None:
        """``new_tokens`` tokens of one request arrived ``interval`` seconds after its previous ones."""
        if new_tokens <= 0:
            return
        histogram = self._get(m.SGLANG_INTER_TOKEN_LATENCY)
        for _ in range(new_tokens):
            histogram.observe(interval / new_tokens)

    def request_finished(self, r: FinishedRequest) -> None:
        streaming = r.streaming
        self._get(m.SGLANG_NUM_REQUESTS_TOTAL, streaming=streaming).inc()
        if r.aborted:
            self._get(m.SGLANG_NUM_ABORTED_REQUESTS_TOTAL).inc()
        self._get(m.SGLANG_PROMPT_TOKENS_TOTAL, streaming=streaming).inc(r.prompt_tokens)
        self._get(m.SGLANG_GENERATION_TOKENS_TOTAL, streaming=streaming).inc(r.completion_tokens)
        if r.cached_tokens:
            self._get(m.SGLANG_CACHED_TOKENS_TOTAL).inc(r.cached_tokens)
        self._get(m.SGLANG_E2E_REQUEST_LATENCY, streaming=streaming).observe(r.end - r.arrival)
        if r.first_token is not None:
            self._get(m.SGLANG_TIME_TO_FIRST_TOKEN, streaming=streaming).observe(r.first_token - r.arrival)
        if r.prompt_tokens:
            self._recent_prompts.append((r.end, r.cached_tokens, r.prompt_tokens))
        self._publish_cache_hit_rate(r.end)

    def _publish_cache_hit_rate(self, now: float) -> None:
        while self._recent_prompts and self._recent_prompts[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent_prompts.popleft()
        prompt = sum(p for _, _, p in self._recent_prompts)
        if prompt:
            self._get(m.SGLANG_CACHE_HIT_RATE).set(sum(c for _, c, _ in self._recent_prompts) / prompt)

    # ------------------------------------------------------------------ reading
    def throughput(self, now: float | None = None) -> float:
        """Generated tokens per second over the last THROUGHPUT_WINDOW_S seconds."""
        now = time.perf_counter() if now is None else now
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def last_token_age(self, now: float | None = None) -> float | None:
        now = time.perf_counter() if now is None else now
        return now - self._recent[-1][0] if self._recent else None

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
