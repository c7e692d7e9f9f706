"""The engine's Prometheus series, under SGLang's names (mixrl/rl/metrics.py), in a per-server registry."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, generate_latest

from mixrl.rl import metrics as m

THROUGHPUT_WINDOW_S = 10.0


class EngineStats:
    """Collectors for one engine; a fresh registry, so several engines can live in one process."""

    def __init__(self, model_name: str, max_total_tokens: int) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name}
        self._c = {spec.name: m.create(spec, self.registry) for spec in m.ENGINE_METRICS}
        self.max_total_tokens = max_total_tokens
        self._recent: deque[tuple[float, int]] = deque()
        self._get(m.SGLANG_MAX_TOTAL_NUM_TOKENS).set(max_total_tokens)
        for spec in m.ENGINE_METRICS:
            if spec.kind != "histogram":
                self._get(spec)  # expose every series from the start, at 0

    def _get(self, spec: m.MetricSpec):
        return self._c[spec.name].labels(**self._labels)

    def set_load(self, queued: int, running: int, paused: int, used_tokens: int) -> None:
        self._get(m.SGLANG_NUM_QUEUE_REQS).set(queued)
        self._get(m.SGLANG_NUM_RUNNING_REQS).set(running)
        self._get(m.SGLANG_NUM_PAUSED_REQS).set(paused)
        self._get(m.SGLANG_NUM_USED_TOKENS).set(used_tokens)
        self._get(m.SGLANG_TOKEN_USAGE).set(
            used_tokens / self.max_total_tokens if self.max_total_tokens else 0.0
        )
        self._get(m.SGLANG_GEN_THROUGHPUT).set(self.throughput())

    def tokens_generated(self, count: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if count:
            self._get(m.SGLANG_GENERATION_TOKENS_TOTAL).inc(count)
            self._recent.append((now, count))

    def throughput(self, now: float | None = None) -> float:
        """Generated tokens per second over the last THROUGHPUT_WINDOW_S seconds."""
        now = time.perf_counter() if now is None else now
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def last_token_age(self, now: float | None = None) -> float | None:
        now = time.perf_counter() if now is None else now
        return now - self._recent[-1][0] if self._recent else None

    def admitted(self, prompt_tokens: int, queue_time: float) -> None:
        self._get(m.SGLANG_PROMPT_TOKENS_TOTAL).inc(prompt_tokens)
        self._get(m.SGLANG_QUEUE_TIME).observe(queue_time)

    def finished(
        self, arrival: float, first_token: float | None, token_times: tuple[float, int] | None, end: float
    ) -> None:
        """Record one finished request; ``token_times`` = (decode duration, decoded tokens after the first)."""
        self._get(m.SGLANG_E2E_REQUEST_LATENCY).observe(end - arrival)
        if first_token is not None:
            self._get(m.SGLANG_TIME_TO_FIRST_TOKEN).observe(first_token - arrival)
        if token_times and token_times[1] > 0:
            self._get(m.SGLANG_INTER_TOKEN_LATENCY).observe(token_times[0] / token_times[1])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
