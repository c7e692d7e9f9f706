"""The buffer's HTTP side (aiohttp) over :class:`~mixrl.rl.buffer.store.TrajectoryBuffer`.

- ``POST /trajectories[?group=<prompt_id>]``: a JSON list of Trajectory objects, all or none:
  each checked against the run (:mod:`mixrl.api.trajectory_check`; a bad one gets 400 naming it,
  its field and the position), logged (fsync) before the answer ``{"accepted",
  "groups_completed", "duplicates"}``.  Idempotent: a trajectory already stored with the same
  content is acknowledged again and stored once; the same (``prompt_id``, ``sample_index``) with
  other content gets 409.  With ``group``, the post must be that whole group: every trajectory of
  that prompt, each sample index once (what the rollout worker posts).
- ``POST /batch?step=N&timeout=S``: the trainer takes the batch of its next step N (the one after
  the last committed step), long-polling up to S seconds (default 30) until enough groups are
  waiting; 200 with the batch, 204 if not ready in time.  Asking again for a step that has a batch
  returns the same batch.  Any other step gets 409 and changes nothing.  It is a POST because it
  may change state (the first answer assigns groups to the step, durably).
- ``GET /batch?step=N&timeout=S``: the same answers without ever assigning anything (a step's
  batch once it has one; it long-polls for the next step's until the trainer has taken it): how
  a trainer's ranks other than the main one read each step's batch, so only the main rank's
  ``POST`` moves the trainer's clock (``mixrl_buffer_trainer_*``).
- ``POST /commit?step=N``: only the step just served (or again one already committed).
- ``POST /quarantine?step=N``: ``{"prompt_ids": [...], "reason": "..."}`` from the trainer for a
  served, uncommitted batch it cannot train: the batch is taken back for good (kept on disk,
  listed in ``/stats``), the step's next request gets the next full groups; 409 if the prompts
  are not the step's batch.
- ``POST /evaluations``; ``GET /evaluations``.
- ``POST /mismatch``: the trainer's per-pool fresh mismatch of one step (kept in memory, newest
  step wins), returned by ``GET /stats`` for the router's mismatch-aware routing.
- ``POST /trainer-metrics``: one record of the trainer's metrics.jsonl, logged (fsync) before the
  answer; ``GET /trainer-metrics``: those records as JSON lines, one per step.
- ``GET /stats``; ``GET /health``; ``GET /metrics`` (``mixrl_buffer_*``).
File I/O runs in worker threads; the store's own lock keeps its state consistent.

Authentication (docs/auth.md): with a token, every route outside :data:`OPEN_ROUTES` (every POST:
trajectories, taking a batch, commits, quarantines, evaluations, mismatch reports, trainer
records; and any route added later) needs ``Authorization: Bearer <token>`` and answers 401
without it, having changed nothing; the GET reads, ``/health`` and ``/metrics`` stay open.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mixrl.api.resolve import ResolvedRun
from mixrl.api.trajectory import Trajectory, largest_json_bytes
from mixrl.api.trajectory_check import TrajectoryLimits, group_problem, trajectory_problem
from mixrl.rl import metrics
from mixrl.rl.auth import AuthToken, refusal_counter
from mixrl.rl.buffer.grouping import StepError
from mixrl.rl.buffer.store import ConflictError, Evaluation, TrajectoryBuffer
from mixrl.rl.health.routing import MismatchReport
from mixrl.rl.serving import ClientGone, component_app, metrics_handler, read_body

log = logging.getLogger("mixrl.buffer")
Body = TypeVar("Body", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class QuarantineReport(BaseModel):
    """The trainer's report of a batch it cannot train (``POST /quarantine``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt_ids: list[str] = Field(min_length=1)
    reason: str = Field(min_length=1, max_length=2000)


OPEN_ROUTES = frozenset(
    {
        ("GET", "/batch"),
        ("GET", "/evaluations"),
        ("GET", "/stats"),
        ("GET", "/trainer-metrics"),
        ("GET", "/health"),
        ("GET", "/metrics"),
    }
)
"""Routes that answer without the run's token: reads only (``GET /batch`` never assigns)."""

DEFAULT_POLL_TIMEOUT = 30.0
MAX_POLL_TIMEOUT = 600.0


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


def _shown(raw: str, limit: int = 200) -> str:
    """repr() of a client's value for an error message, cut short: never echo megabytes back."""
    text = repr(raw)
    return text if len(text) <= limit else text[:limit] + f"… ({len(raw)} characters)"


def _json_body(raw: bytes) -> Any:
    """The JSON of a request body; ValueError with one line (``body: not JSON (...)``) otherwise."""
    try:
        return json.loads(raw)
    except RecursionError:  # the decoder recurses per nesting level; 100,000 '[' would exhaust it
        raise ValueError("body: not JSON (nested too deeply)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"body: not JSON ({exc})") from None


def _error_location(exc: ValidationError, prefix: str) -> str:
    """One line naming the first invalid field, e.g. ``trajectories[2].loss_mask: ...``."""
    error = exc.errors()[0]
    where = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
    return f"{where}: {str(error['msg']).removeprefix('Value error, ')}"


async def _body_as(request: web.Request, model: type[Body], where: str) -> Body | web.Response:
    """The request's JSON body as ``model``, or the 400 that names what is wrong with it."""
    try:
        return model.model_validate(_json_body(await read_body(request, log)))
    except ValidationError as exc:
        return _bad_request(_error_location(exc, where))
    except ValueError as exc:
        return _bad_request(str(exc))
    except ClientGone:
        return _bad_request("body: the connection closed before the body arrived")


def parse_trajectories(body: Any, limits: TrajectoryLimits, group: str | None = None) -> list[Trajectory]:
    """Validate a POST /trajectories body against the run; ValueError with one line naming the bad field.

    ``group``: the body must be exactly that prompt's group (every sample index once)."""
    if not isinstance(body, list):
        raise ValueError("body: expected a JSON list of trajectories")
    if not body:
        raise ValueError("body: no trajectories")
    parsed = []
    for index, item in enumerate(body):
        where = f"trajectories[{index}]"
        try:
            trajectory = Trajectory.model_validate(item)
        except ValidationError as exc:
            raise ValueError(_error_location(exc, where)) from None
        if trajectory.split != "train":
            raise ValueError(
                f"{where}.split: {trajectory.split!r} is not trained on; post held-out results "
                "to /evaluations"
            )
        parsed.append(trajectory)
    if group is not None:
        problem = group_problem(group, parsed, limits)
    else:
        problems = (
            f"trajectories[{i}].{p}" for i, t in enumerate(parsed) if (p := trajectory_problem(t, limits))
        )
        problem = next(problems, None)
    if problem is not None:
        raise ValueError(problem)
    return parsed


def _int_param(request: web.Request, name: str, default: int | None = None) -> int:
    raw = request.query.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"{name}: required query parameter")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {_shown(raw)}") from None
    if value < 0:
        raise ValueError(f"{name}: must be ≥ 0, got {value}")
    return value


def _timeout_param(request: web.Request) -> float:
    raw = request.query.get("timeout")
    if raw is None:
        return DEFAULT_POLL_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"timeout: expected seconds, got {_shown(raw)}") from None
    if not 0 <= value <= MAX_POLL_TIMEOUT or math.isnan(value):
        raise ValueError(f"timeout: must be within [0, {MAX_POLL_TIMEOUT:.0f}] seconds, got {_shown(raw)}")
    return value


@web.middleware
async def _disk_failures(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A log the buffer cannot write or read (a full disk, an I/O error): 503 with one line naming
    the reason, and one ERROR line here, instead of aiohttp's bare 500 and a traceback.  The store
    cuts a failed write from its log before raising, so nothing of the request was stored."""
    try:
        return await handler(request)
    except ConnectionError:  # the client's connection, not the disk: aiohttp's business
        raise
    except OSError as exc:
        message = f"the buffer cannot write or read its logs ({exc}); nothing of this request was stored"
        log.error("%s %s: %s", request.method, request.path, message)
        return web.json_response({"error": message}, status=503)


class BufferCollector(Collector):
    """``mixrl_buffer_*`` series read from the store at scrape time (names in mixrl.rl.metrics)."""

    def __init__(self, buffer: TrajectoryBuffer, run: str) -> None:
        self.buffer = buffer
        self.run = run

    def collect(self) -> Iterator[Metric]:
        with self.buffer._lock:
            yield from self._collect()

    def _collect(self) -> Iterator[Metric]:
        state, telemetry, run = self.buffer.state, self.buffer.telemetry, self.run
        waiting = state.waiting_by_pool()
        pools = sorted(set(telemetry.received) | set(waiting))

        def per_pool(kind: type, spec: metrics.MetricSpec, counts: Any) -> Metric:
            family = kind(spec.name, spec.help, labels=spec.labels)
            for pool in pools:
                family.add_metric([run, *pool], float(counts.get(pool, 0)))
            return family

        def whole(kind: type, spec: metrics.MetricSpec, value: float | None) -> Metric:
            family = kind(spec.name, spec.help, labels=spec.labels)
            if value is not None:
                family.add_metric([run], float(value))
            return family

        yield per_pool(GaugeMetricFamily, metrics.MIXRL_BUFFER_TRAJECTORIES, waiting)
        yield per_pool(
            CounterMetricFamily, metrics.MIXRL_BUFFER_TRAJECTORIES_RECEIVED_TOTAL, telemetry.received
        )
        yield per_pool(CounterMetricFamily, metrics.MIXRL_BUFFER_DROPPED_TOTAL, telemetry.dropped)
        yield whole(CounterMetricFamily, metrics.MIXRL_BUFFER_DROPPED_GROUPS_TOTAL, state.dropped_groups)
        yield whole(GaugeMetricFamily, metrics.MIXRL_BUFFER_GROUPS_READY, len(state.ready))
        yield whole(GaugeMetricFamily, metrics.MIXRL_BUFFER_GROUPS_PARTIAL, len(state.partial))
        # A quarantined batch was served too: the counter never goes back when its step is re-batched.
        served = len(state.assigned) + len(state.quarantined)
        yield whole(CounterMetricFamily, metrics.MIXRL_BUFFER_BATCHES_TOTAL, served)
        quarantined = metrics.MIXRL_BUFFER_QUARANTINED_BATCHES_TOTAL
        yield whole(CounterMetricFamily, quarantined, len(state.quarantined))
        duplicates = metrics.MIXRL_BUFFER_DUPLICATE_TRAJECTORIES_TOTAL
        yield whole(CounterMetricFamily, duplicates, self.buffer.duplicates)
        yield whole(GaugeMetricFamily, metrics.MIXRL_BUFFER_STEP, self.buffer.latest_requested_step)
        yield whole(GaugeMetricFamily, metrics.MIXRL_BUFFER_COMMITTED_STEP, state.last_committed)
        spec = metrics.MIXRL_BUFFER_STALENESS
        histogram = HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
        for pool, counts in sorted(telemetry.staleness_tokens.items()):
            bounds = spec.buckets or ()
            buckets = [(str(b), float(sum(n for s, n in counts.items() if s <= b))) for b in bounds]
            buckets.append(("+Inf", float(sum(counts.values()))))
            total = float(sum(s * n for s, n in counts.items()))
            histogram.add_metric([run, *pool], buckets, total)
        yield histogram
        spec = metrics.MIXRL_BUFFER_EVAL_PASS_AT_K
        family = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
        if self.buffer.evaluations:
            for k, rate in sorted(self.buffer.evaluations[-1]["pass_at_k"].items()):
                family.add_metric([run, k], float(rate))
        yield family


def body_limit(run: ResolvedRun) -> int:
    """The largest request body the buffer reads: one group (``samplesPerPrompt`` trajectories, the
    rollout posts a group at a time) at ``model.maxContextTokens`` with K candidates on every token.
    A real group always fits; a body beyond it gets 413 before it is read whole."""
    largest = largest_json_bytes(run.model.max_context_tokens, run.sampling.top_logprobs_num)
    return run.trainer.samples_per_prompt * largest


class BufferServer:
    """``limits``: what every posted trajectory is checked against (the run's name, group size,
    candidates, context and, where known, vocabulary; versions are bounded by the trainer's next
    step, the newest version that can be published); ``auth_token``: required on every route
    outside :data:`OPEN_ROUTES` (None: no check); ``max_body_bytes``: 413 beyond it
    (:func:`body_limit` of the run)."""

    def __init__(
        self,
        buffer: TrajectoryBuffer,
        limits: TrajectoryLimits,
        auth_token: AuthToken | None = None,
        *,
        max_body_bytes: int,
    ) -> None:
        if limits.samples_per_prompt != buffer.state.samples_per_prompt:
            raise ValueError(
                f"limits: {limits.samples_per_prompt} samples per prompt, the buffer groups "
                f"{buffer.state.samples_per_prompt}"
            )
        self.buffer = buffer
        self.limits = limits
        self.run = limits.run
        self.auth_token = auth_token
        self.max_body_bytes = max_body_bytes
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(BufferCollector(buffer, limits.run))
        # Collected off the event loop: the collector reads the buffer's state under its lock.
        self.metrics = metrics_handler(self.registry, in_thread=True)
        self._arrivals = asyncio.Condition()
        self._closing = False
        # The trainer's clock, for the autoscaler (objective: trainer): waits and compute per step,
        # from POST /batch alone (the trainer's main rank; its other ranks read with GET).
        self._trainer_wait = metrics.create(metrics.MIXRL_BUFFER_TRAINER_WAIT_SECONDS_TOTAL, self.registry)
        self._trainer_busy = metrics.create(metrics.MIXRL_BUFFER_TRAINER_BUSY_SECONDS, self.registry)
        self._handed_at: float | None = None
        self.mismatch: MismatchReport | None = None
        """The trainer's latest per-pool fresh mismatch (in memory: the next step brings another)."""

    def app(self) -> web.Application:
        refused = refusal_counter(self.registry, self.run, "buffer")
        app = component_app(self.metrics, self.auth_token, OPEN_ROUTES, log, self.max_body_bytes, refused)
        app.middlewares.append(_disk_failures)
        app.router.add_post("/trajectories", self._post_trajectories)
        app.router.add_post("/batch", self._take_batch)
        app.router.add_get("/batch", self._read_batch)
        app.router.add_post("/commit", self._commit)
        app.router.add_post("/quarantine", self._quarantine)
        app.router.add_post("/evaluations", self._post_evaluation)
        app.router.add_get("/evaluations", self._get_evaluations)
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/mismatch", self._post_mismatch)
        app.router.add_post("/trainer-metrics", self._post_trainer_record)
        app.router.add_get("/trainer-metrics", self._get_trainer_records)
        app.router.add_get("/health", self._health)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_shutdown(self, app: web.Application) -> None:
        # Wake long polls so they answer (204) instead of holding the shutdown.
        self._closing = True
        async with self._arrivals:
            self._arrivals.notify_all()

    def _limits_now(self) -> TrajectoryLimits:
        """The run's limits with versions bounded by the trainer's next step: the trainer publishes
        version s before it commits step s, so no sampler can hold a newer one."""
        return replace(self.limits, latest_version=self.buffer.state.next_step)

    async def _post_trajectories(self, request: web.Request) -> web.Response:
        try:
            body = _json_body(await read_body(request, log))
            # Off the event loop: a group at the context limit is hundreds of thousands of entries.
            group, limits = request.query.get("group"), self._limits_now()
            trajectories = await asyncio.to_thread(parse_trajectories, body, limits, group)
        except ValueError as exc:
            return _bad_request(str(exc))
        except ClientGone:
            return _bad_request("body: the connection closed before the body arrived")
        try:
            completed, stored = await asyncio.to_thread(self._append, trajectories)
        except ConflictError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        async with self._arrivals:
            self._arrivals.notify_all()
        duplicates = len(trajectories) - stored
        return web.json_response(
            {"accepted": len(trajectories), "groups_completed": completed, "duplicates": duplicates}
        )

    def _append(self, trajectories: list[Trajectory]) -> tuple[int, int]:
        """(groups completed, trajectories newly stored) of one post, under the store's lock."""
        with self.buffer._lock:
            before = self.buffer.state.received
            completed = self.buffer.append(trajectories)
            return completed, self.buffer.state.received - before

    async def _take_batch(self, request: web.Request) -> web.Response:
        return await self._batch(request, reserve=True)

    async def _read_batch(self, request: web.Request) -> web.Response:
        return await self._batch(request, reserve=False)

    async def _batch(self, request: web.Request, reserve: bool) -> web.Response:
        try:
            step = _int_param(request, "step")
            timeout = _timeout_param(request)
        except ValueError as exc:
            return _bad_request(str(exc))
        asked = asyncio.get_running_loop().time()
        deadline = asked + timeout
        if reserve and self._handed_at is not None:
            self._trainer_busy.labels(self.run).set(asked - self._handed_at)  # type: ignore[union-attr]
            self._handed_at = None
        while True:
            async with self._arrivals:
                try:
                    payload = await asyncio.to_thread(self.buffer.batch, step, reserve)
                except StepError as exc:
                    return web.json_response({"error": str(exc)}, status=409)
                now = asyncio.get_running_loop().time()
                if payload is not None:
                    if reserve:  # wake readers (GET) waiting for this step to be taken
                        self._arrivals.notify_all()
                        self._trainer_wait.labels(self.run).inc(now - asked)  # type: ignore[union-attr]
                        self._handed_at = now
                    return web.Response(body=payload.body, content_type="application/json")
                remaining = deadline - now
                if remaining <= 0 or self._closing:
                    if reserve:
                        self._trainer_wait.labels(self.run).inc(now - asked)  # type: ignore[union-attr]
                    return web.Response(status=204)
                try:
                    await asyncio.wait_for(self._arrivals.wait(), remaining)
                except TimeoutError:
                    if reserve:
                        waited = asyncio.get_running_loop().time() - asked
                        self._trainer_wait.labels(self.run).inc(waited)  # type: ignore[union-attr]
                    return web.Response(status=204)

    async def _commit(self, request: web.Request) -> web.Response:
        try:
            step = _int_param(request, "step")
        except ValueError as exc:
            return _bad_request(str(exc))
        try:
            first = await asyncio.to_thread(self.buffer.commit, step)
        except StepError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        return web.json_response({"step": step, "committed": True, "already": not first})

    async def _quarantine(self, request: web.Request) -> web.Response:
        try:
            step = _int_param(request, "step")
        except ValueError as exc:
            return _bad_request(str(exc))
        report = await _body_as(request, QuarantineReport, "quarantine")
        if isinstance(report, web.Response):
            return report
        try:
            entry = await asyncio.to_thread(self.buffer.quarantine, step, report.prompt_ids, report.reason)
        except StepError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        async with self._arrivals:  # the step's next batch may be waiting already
            self._arrivals.notify_all()
        return web.json_response({"quarantined": entry})

    async def _post_evaluation(self, request: web.Request) -> web.Response:
        evaluation = await _body_as(request, Evaluation, "evaluation")
        if isinstance(evaluation, web.Response):
            return evaluation
        await asyncio.to_thread(self.buffer.add_evaluation, evaluation)
        return web.json_response({"accepted": True})

    async def _get_evaluations(self, request: web.Request) -> web.Response:
        return web.json_response({"evaluations": list(self.buffer.evaluations)})

    async def _stats(self, request: web.Request) -> web.Response:
        stats = await asyncio.to_thread(self.buffer.stats)
        stats["mismatch"] = self.mismatch.model_dump() if self.mismatch is not None else None
        return web.json_response(stats)

    async def _post_trainer_record(self, request: web.Request) -> web.Response:
        """One step's record of the trainer's metrics.jsonl, kept durably (docs/health.md#the-end-of-a-run)."""
        try:
            record = _json_body(await read_body(request, log))
        except ValueError as exc:  # "body: not JSON (...)", like every other route
            return _bad_request(str(exc))
        except ClientGone:
            return _bad_request("body: the connection closed before the body arrived")
        try:
            step = await asyncio.to_thread(self.buffer.add_trainer_record, record)
        except ValueError as exc:
            return _bad_request(f"record: {exc}")
        return web.json_response({"accepted": True, "step": step})

    async def _get_trainer_records(self, request: web.Request) -> web.Response:
        """The trainer's records as JSON lines, one per step in step order (a redone step's last)."""
        records = dict(self.buffer.trainer_records)
        body = "".join(json.dumps(records[step]) + "\n" for step in sorted(records))
        return web.Response(text=body, content_type="application/x-ndjson")

    async def _post_mismatch(self, request: web.Request) -> web.Response:
        """The trainer's per-pool fresh mismatch of one step, which the router reads back from
        ``GET /stats`` (docs/health.md#mismatch-aware-routing).  An older step than the one held is
        ignored, so a trainer redoing a step after a crash cannot move the router back."""
        report = await _body_as(request, MismatchReport, "mismatch")
        if isinstance(report, web.Response):
            return report
        if self.mismatch is None or report.step >= self.mismatch.step:
            self.mismatch = report
        return web.json_response({"accepted": True, "step": self.mismatch.step})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})
