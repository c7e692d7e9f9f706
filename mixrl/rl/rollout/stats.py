"""What the rollout worker counts: progress lines for people, ``mixrl_rollout_*`` series for Prometheus."""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mixrl.api.trajectory import Trajectory
from mixrl.rl import metrics
from mixrl.rl.engine.protocol import GenerateResult

RECENT_EPISODES = 256
"""Window of the recent reward and format-error share in progress lines."""


class RolloutStats:
    def __init__(self, run: str, clock: Any = time.monotonic) -> None:
        self.run = run
        self.clock = clock
        self.started = clock()
        self.episodes = 0
        self.generated_tokens = 0
        self.finish_reasons: Counter[str] = Counter()
        self.recent: deque[tuple[float, bool]] = deque(maxlen=RECENT_EPISODES)
        self.groups_posted = 0
        self.groups_dropped = 0
        self.last_evaluation: dict[str, Any] | None = None
        self._last_line_at = self.started
        self._last_line_episodes = 0
        self._step_times: list[tuple[float, int]] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self._episodes = metrics.counter(metrics.MIXRL_ROLLOUT_EPISODES_TOTAL, self.registry)
        self._format_errors = metrics.counter(
            metrics.MIXRL_ROLLOUT_FORMAT_ERROR_EPISODES_TOTAL, self.registry
        )
        self._tokens = metrics.counter(metrics.MIXRL_ROLLOUT_TOKENS_TOTAL, self.registry)
        self._reward = metrics.gauge(metrics.MIXRL_ROLLOUT_REWARD, self.registry)
        self._tied = metrics.counter(metrics.MIXRL_ROLLOUT_TIED_SUPPORT_TOKENS_TOTAL, self.registry)
        self._acknowledged = metrics.counter(
            metrics.MIXRL_ROLLOUT_TRAJECTORIES_ACKNOWLEDGED_TOTAL, self.registry
        )
        self.tied_support_tokens = 0
        self._recent_by_pool: dict[tuple[str, ...], deque[float]] = {}

    def episode_ended(self, trajectory: Trajectory) -> None:
        reward = trajectory.reward or 0.0
        self.episodes += 1
        self.generated_tokens += trajectory.num_generated
        self.finish_reasons[trajectory.finish_reason] += 1
        self.recent.append((reward, trajectory.finish_reason == "format_errors"))
        labels = (self.run, trajectory.pool, trajectory.gpu_type, trajectory.precision)
        self._episodes.labels(*labels, trajectory.finish_reason).inc()
        if trajectory.finish_reason == "format_errors":
            self._format_errors.labels(*labels).inc()
        self._tokens.labels(*labels).inc(trajectory.num_generated)
        window = self._recent_by_pool.setdefault(labels, deque(maxlen=RECENT_EPISODES))
        window.append(reward)
        self._reward.labels(*labels).set(sum(window) / len(window))

    def turn_received(self, result: GenerateResult) -> None:
        """One turn's answer: count tokens kept with a support larger than their candidates."""
        if result.tied_support_tokens:
            self.tied_support_tokens += result.tied_support_tokens
            pool = result.pool
            labels = (self.run, pool.pool, pool.gpu_type, pool.precision)
            self._tied.labels(*labels).inc(result.tied_support_tokens)

    def group_acknowledged(self, trajectories: int) -> None:
        """The buffer answered 200 to a group of ``trajectories``."""
        self.groups_posted += 1
        self._acknowledged.labels(self.run).inc(trajectories)

    def evaluation_done(self, result: dict[str, Any]) -> None:
        self.last_evaluation = result

    def progress_line(self, trainer_step: int, total_steps: int | None, final: bool = False) -> str:
        now = self.clock()
        elapsed = max(now - self.started, 1e-9)
        window = max(now - self._last_line_at, 1e-9)
        rate = (self.episodes - self._last_line_episodes) / window
        self._last_line_at, self._last_line_episodes = now, self.episodes
        parts = [
            f"rollout: {self.episodes} episodes ({rate:.1f}/s now, {self.episodes / elapsed:.1f}/s overall)",
            f"{self.generated_tokens / elapsed:.0f} gen tok/s",
        ]
        if self.recent:
            rewards = [r for r, _ in self.recent]
            format_share = sum(1 for _, f in self.recent if f) / len(self.recent)
            parts.append(f"reward {sum(rewards) / len(rewards):.2f} (last {len(rewards)})")
            parts.append(f"format-error endings {100 * format_share:.0f}%")
        parts.append(f"groups {self.groups_posted} posted/{self.groups_dropped} dropped")
        parts.append(self._step_part(trainer_step, total_steps, now))
        if self.last_evaluation is not None:
            scores = " ".join(f"pass@{k} {v:.2f}" for k, v in self.last_evaluation["pass_at_k"].items())
            parts.append(f"held-out {scores} at step {self.last_evaluation['step']}")
        line = ", ".join(parts)
        return line.replace("rollout:", "rollout: done:", 1) if final else line

    def _step_part(self, step: int, total: int | None, now: float) -> str:
        if not self._step_times or self._step_times[-1][1] != step:
            self._step_times.append((now, step))
        text = f"trainer step {step}" + (f"/{total}" if total else "")
        first_at, first_step = self._step_times[0]
        if total and step > first_step and step < total:
            seconds_per_step = (now - first_at) / (step - first_step)
            text += f" (ETA {seconds_per_step * (total - step):.0f}s)"
        return text

    async def serve_metrics(self, port: int, host: str = "0.0.0.0") -> web.AppRunner:
        """Serve ``GET /metrics`` on ``port``; call ``cleanup()`` on the result to stop."""

        async def handle(_: web.Request) -> web.Response:
            response = web.Response(body=generate_latest(self.registry))
            response.headers["Content-Type"] = CONTENT_TYPE_LATEST
            return response

        app = web.Application()
        app.router.add_get("/metrics", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner
