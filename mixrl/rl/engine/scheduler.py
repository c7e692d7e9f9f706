"""The scheduler: one asyncio task that owns the model runner and drives it step by step.

Every model operation (prefill, decode step, weight swap) runs on one worker thread, one at a time,
so HTTP handlers stay responsive while the model computes and nothing races on the weights or the
batch.  Each loop turn:

1. runs queued control operations (weight updates) — so an update lands *between* decode steps and
   every token after it reports the new version;
2. drops requests whose client went away (the HTTP handler of a disconnected client is cancelled,
   which marks its sequences here; they leave the batch before the next decode step);
3. unless paused, admits waiting requests up to ``max_running`` (prefill + first token) and runs one
   decode step for the whole running batch.

Pausing (SGLang's ``/pause_generation``): ``abort`` finishes every request with an abort reason;
``in_place`` and ``retract`` stop stepping and keep the running batch and its KV cache as they are
(the torch engine treats ``retract`` like ``in_place``: it has no memory pressure to relieve).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mixrl.rl.engine.runner import ModelRunner, Sequence
from mixrl.rl.engine.stats import EngineStats

log = logging.getLogger(__name__)
T = TypeVar("T")

PAUSE_MODES = ("abort", "in_place", "retract")


@dataclass
class _Waiting:
    seq: Sequence
    future: asyncio.Future[Sequence]
    arrival: float
    admitted: float | None = None


@dataclass
class _Control:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]


@dataclass
class _Book:
    """Per-request bookkeeping for futures and latency metrics."""

    entries: dict[int, _Waiting] = field(default_factory=dict)

    def add(self, w: _Waiting) -> None:
        self.entries[id(w.seq)] = w

    def pop(self, seq: Sequence) -> _Waiting | None:
        return self.entries.pop(id(seq), None)


class Scheduler:
    def __init__(self, runner: ModelRunner, stats: EngineStats, *, max_running: int) -> None:
        self.runner = runner
        self.stats = stats
        self.max_running = max_running
        self.paused = False
        self._waiting: deque[_Waiting] = deque()
        self._controls: deque[_Control] = deque()
        self._cancelled: set[int] = set()
        self._book = _Book()
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mixrl-engine")
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._tokens_counted = 0
        self._admitting: list[Sequence] = []  # handed to the model thread, not yet in the running batch

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="mixrl-engine-scheduler")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self._finish_all("server shutting down")
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ requests
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.runner.running)

    async def generate(self, seq: Sequence) -> Sequence:
        """Queue ``seq`` and wait until it finishes; cancelling the caller aborts it."""
        if self._stopping:
            seq.abort("server shutting down")
            return seq
        future: asyncio.Future[Sequence] = asyncio.get_running_loop().create_future()
        entry = _Waiting(seq=seq, future=future, arrival=time.perf_counter())
        self._book.add(entry)
        self._waiting.append(entry)
        self._wake.set()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self._cancelled.add(id(seq))
            self._wake.set()
            raise

    async def control(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the model thread between two steps (never during one)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._controls.append(_Control(fn, future))
        self._wake.set()
        return await future

    async def pause(self, mode: str) -> None:
        """Stop stepping; returns once no step is in flight (so nothing is generated after it returns)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.paused = True
        if mode == "abort":
            self.abort_all("aborted by pause_generation")
        await self.control(lambda: None)

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    def abort_all(self, message: str) -> None:
        """Finish every waiting and running request with an abort reason (effective before the next step)."""
        for entry in list(self._waiting):
            entry.seq.abort(message)
        for seq in [*self._admitting, *self.runner.running]:
            seq.abort(message)
        self._wake.set()

    def abort(self, rid: str, message: str) -> int:
        count = 0
        for entry in list(self._waiting):
            if entry.seq.rid == rid:
                entry.seq.abort(message)
                count += 1
        for seq in [*self._admitting, *self.runner.running]:
            if seq.rid == rid:
                seq.abort(message)
                count += 1
        self._wake.set()
        return count

    # ------------------------------------------------------------------ the loop
    async def _on_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _loop(self) -> None:
        while not self._stopping:
            await self._run_controls()
            await self._collect_aborted()
            progressed = False
            if not self.paused:
                try:
                    progressed = await self._admit() or progressed
                    if self.runner.running:
                        self._resolve(await self._on_thread(self.runner.step))
                        progressed = True
                except Exception as exc:  # a model failure must not hang every open request
                    log.exception("model step failed; aborting the running batch")
                    reset = functools.partial(self.runner.reset, f"engine error: {exc}")
                    self._resolve(await self._on_thread(reset))
                    progressed = True
            self._publish_load()
            if not progressed and not self._controls and not self._has_aborted():
                self._wake.clear()
                await self._wake.wait()

    async def _run_controls(self) -> None:
        while self._controls:
            op = self._controls.popleft()
            try:
                result = await self._on_thread(op.fn)
            except Exception as exc:  # handed to the caller, who reports it
                if not op.future.done():
                    op.future.set_exception(exc)
            else:
                if not op.future.done():
                    op.future.set_result(result)

    def _has_aborted(self) -> bool:
        return any(e.seq.finished for e in self._waiting) or any(s.finished for s in self.runner.running)

    async def _collect_aborted(self) -> None:
        if self._cancelled:
            for seq in [*(e.seq for e in self._waiting), *self._admitting, *self.runner.running]:
                if id(seq) in self._cancelled and not seq.finished:
                    seq.abort("client disconnected")
                    # One line, no traceback: a client going away is routine (a router or rollout
                    # worker giving up on a session), not an engine error.
                    log.info(
                        "request %s: client disconnected; aborted after %d tokens", seq.rid, len(seq.tokens)
                    )
            self._cancelled.clear()
        dropped = [e for e in self._waiting if e.seq.finished]
        for entry in dropped:
            self._waiting.remove(entry)
            self._resolve([entry.seq])
        if any(s.finished for s in self.runner.running):
            self._resolve(await self._on_thread(self.runner.drop_finished))

    async def _admit(self) -> bool:
        room = self.max_running - len(self.runner.running)
        batch: list[_Waiting] = []
        while self._waiting and len(batch) < room:
            batch.append(self._waiting.popleft())
        if not batch:
            return False
        now = time.perf_counter()
        for entry in batch:
            entry.admitted = now
            self.stats.admitted(len(entry.seq.prompt_ids), now - entry.arrival)
        seqs = [e.seq for e in batch]
        self._admitting = seqs
        try:
            self._resolve(await self._on_thread(lambda: self.runner.add(seqs)))
        except Exception as exc:
            for seq in seqs:
                seq.abort(f"engine error: {exc}")
            self._resolve(seqs)
            raise
        finally:
            self._admitting = []
        return True

    def _resolve(self, finished: list[Sequence]) -> None:
        for seq in finished:
            entry = self._book.pop(seq)
            if entry is None:
                continue
            # per-request series (latencies, counts by is_streaming) are recorded by the service
            if not entry.future.done():
                entry.future.set_result(seq)
        self._count_new_tokens()

    def _count_new_tokens(self) -> None:
        total = self.runner.tokens_generated
        self.stats.tokens_generated(total - self._tokens_counted)
        self._tokens_counted = total

    def _publish_load(self) -> None:
        running = len(self.runner.running)
        self.stats.set_load(
            queued=len(self._waiting),
            running=0 if self.paused else running,
            paused=running if self.paused else 0,
            used_tokens=self.runner.kv_used_tokens(),
        )

    def _finish_all(self, message: str) -> None:
        for entry in list(self._book.entries.values()):
            entry.seq.abort(message)
            if not entry.future.done():
                entry.future.set_result(entry.seq)
        self._book.entries.clear()
        self._waiting.clear()
