"""Version-aware requests: token staleness with and without a per-request minimum weight version.

    .venv/bin/python bench/version_aware.py [--seconds 15] [--episodes 8] [--turns 4] [--tokens 8]
        [--step-seconds 1.0] [--lags 0.1,2.5] [--max-staleness 1] [--max-backoff 0.25]

Real: two torch engines (a tiny random Qwen3, one process each on loopback, one torch thread),
the router in front of them (one pool per engine, capacity 1 each, health probes every 0.2 s,
which read each replica's ``/get_weight_version``), and the rollout's own ``RouterClient`` with its
409 waits and the worker's ``min_weight_version``.

Stand-ins, named as such:
- the trainer is a clock: every ``--step-seconds`` it commits the next step;
- the weight sync relabels each engine to that version (``/update_weight_version``, requests not
  aborted) after the engine's own lag (``--lags``: a fast and a slow sidecar, e.g. an SGLang pool
  whose checkpoint must be converted), instead of loading new weights: staleness depends on when a
  version arrives, not on what it holds, and a relabel costs nothing;
- an episode is ``--turns`` turns of ``--tokens`` new tokens in one router session, its context
  growing by the reply and four "tool" ids per turn; ``--episodes`` run at once, a group of one.

Two conditions, one after the other in this run, each for ``--seconds`` on the same clock and the
same engines (reset to version 0 between them): **unbounded** (today: no minimum) and **bounded**
(each turn asks ``min_weight_version(committed, --max-staleness)``, as the worker does with
``algorithm.maxStaleness``).  Reported per condition:

- staleness of every generated token, in versions, at the step that would consume it: the
  committed step when its episode ends, plus one (the buffer's reading, ``N − weight_version``),
  as p50, p95 and max; the share of tokens, and of groups (their oldest token), above
  ``--max-staleness``: what the buffer would drop;
- generated tokens per second and the bounded/unbounded ratio (what the bound costs);
- the 409 rate (refused attempts / all attempts), the retries per turn and the turn latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from mixrl.api.resolve import SamplingParams
from mixrl.local.processes import EngineProcess
from mixrl.rl.rollout.router_client import RouterClient
from mixrl.rl.rollout.worker import min_weight_version
from mixrl.rl.router.config import PoolConfig, RouterConfig
from mixrl.rl.router.server import Router, RouterSettings
from mixrl.rl.tiny_models import create_tiny_checkpoint

VOCAB = 512
PROMPT_TOKENS = 8
TOOL_TOKENS = 4


@dataclass
class Condition:
    """What one condition measured."""

    name: str
    bounded: bool
    staleness: list[int] = field(default_factory=list)
    """Per generated token: consuming step − its version."""
    group_staleness: list[int] = field(default_factory=list)
    """Per episode (a group of one): its oldest token's staleness."""
    turn_seconds: list[float] = field(default_factory=list)
    turns: int = 0
    tokens: int = 0
    refusals: int = 0
    """Attempts answered 409 (each followed by a wait and a retry)."""
    retries: int = 0
    """Attempts that failed otherwise (502/503/504, refused connections)."""
    gave_up: int = 0
    seconds: float = 0.0


class Clock:
    """The stand-in trainer and weight sync: commits a step every ``step_s``; each engine is told
    the new version after its own lag."""

    def __init__(self, http: aiohttp.ClientSession, engines: list[tuple[str, float]], step_s: float) -> None:
        self.http, self.engines, self.step_s = http, engines, step_s
        self.committed = 0
        self._syncs: set[asyncio.Task[None]] = set()

    async def reset(self) -> None:
        self.committed = 0
        await asyncio.gather(*(self._relabel(url, 0) for url, _ in self.engines))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self.committed += 1
            for url, lag in self.engines:
                task = asyncio.create_task(self._sync(url, lag, self.committed))
                self._syncs.add(task)
                task.add_done_callback(self._syncs.discard)

    async def stop(self) -> None:
        for task in list(self._syncs):
            task.cancel()
        await asyncio.gather(*self._syncs, return_exceptions=True)

    async def _sync(self, url: str, lag: float, version: int) -> None:
        await asyncio.sleep(lag)
        await self._relabel(url, version)

    async def _relabel(self, url: str, version: int) -> None:
        body = {"new_version": version, "abort_all_requests": False}
        async with self.http.post(f"{url}/update_weight_version", json=body) as response:
            assert response.status == 200, await response.text()


async def episode(
    client: RouterClient, clock: Clock, result: Condition, turns: int, tokens: int, max_staleness: int
) -> None:
    """One episode of ``turns`` turns in its own session; its tokens' staleness at its consuming step."""
    session = f"bench-{uuid.uuid4().hex[:12]}"
    context = [1 + (i * 37) % (VOCAB - 1) for i in range(PROMPT_TOKENS)]
    versions: list[int] = []
    try:
        for _ in range(turns):
            minimum = min_weight_version(clock.committed, max_staleness) if result.bounded else None
            started = time.perf_counter()
            answer = await client.generate(session, context, tokens, minimum)
            result.turn_seconds.append(time.perf_counter() - started)
            result.turns += 1
            versions += [record.weight_version for record in answer.records]
            context += [record.token_id for record in answer.records] + [2] * TOOL_TOKENS
    finally:
        await client.end_session(session)
    consuming_step = clock.committed + 1
    staleness = [consuming_step - version for version in versions]
    result.staleness += staleness
    result.group_staleness.append(max(staleness))
    result.tokens += len(versions)


async def run_condition(
    router_url: str, clock: Clock, name: str, bounded: bool, args: argparse.Namespace
) -> Condition:
    result = Condition(name, bounded)
    sampling = SamplingParams(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=args.tokens,
        top_logprobs_num=1,
        return_sampling_mask=False,
    )
    client = RouterClient(
        router_url,
        sampling,
        [],
        backoff_s=0.05,
        max_backoff_s=0.2,
        max_version_backoff_s=args.max_backoff,
        version_wait_s=60,
    )
    await clock.reset()
    await asyncio.sleep(0.5)  # the router's probes read version 0 again
    deadline = time.perf_counter() + args.seconds
    started = time.perf_counter()

    async def player() -> None:
        while time.perf_counter() < deadline:
            await episode(client, clock, result, args.turns, args.tokens, args.max_staleness)

    ticking = asyncio.create_task(clock.run())
    progress = asyncio.create_task(report(result, client, clock, started))
    try:
        await asyncio.gather(*(player() for _ in range(args.episodes)))
    finally:
        result.seconds = time.perf_counter() - started
        for task in (ticking, progress):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await clock.stop()
        result.refusals, result.retries, result.gave_up = (
            client.version_waits,
            client.retries,
            client.versions_unavailable,
        )
        await client.close()
    return result


async def report(result: Condition, client: RouterClient, clock: Clock, started: float) -> None:
    while True:
        await asyncio.sleep(5.0)
        print(
            f"  {result.name}: {time.perf_counter() - started:.0f}s, {len(result.group_staleness)} episodes, "
            f"{result.tokens} tokens, committed step {clock.committed}, 409s {client.version_waits}",
            flush=True,
        )


def percentile(values: list[int] | list[float], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))]) if ordered else float("nan")


def row(result: Condition, limit: int) -> list[str]:
    attempts = result.turns + result.refusals + result.retries
    return [
        result.name,
        str(len(result.group_staleness)),
        str(result.tokens),
        f"{result.tokens / result.seconds:.0f}",
        f"{percentile(result.staleness, 0.5):.0f}",
        f"{percentile(result.staleness, 0.95):.0f}",
        f"{max(result.staleness, default=0)}",
        f"{100 * sum(s > limit for s in result.staleness) / max(len(result.staleness), 1):.1f}%",
        f"{100 * sum(s > limit for s in result.group_staleness) / max(len(result.group_staleness), 1):.1f}%",
        f"{100 * result.refusals / max(attempts, 1):.1f}%",
        f"{result.refusals / max(result.turns, 1):.2f}",
        f"{1000 * statistics.median(result.turn_seconds):.0f}/{1000 * percentile(result.turn_seconds, 0.95):.0f}",
    ]


HEADER = [
    "condition",
    "episodes",
    "tokens",
    "tok/s",
    "stale p50",
    "p95",
    "max",
    "tokens > S",
    "groups > S",
    "409 rate",
    "409s/turn",
    "turn ms p50/p95",
]


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    for r in [HEADER, *rows]:
        print("  ".join(cell.rjust(width) for cell, width in zip(r, widths, strict=True)))


@contextlib.contextmanager
def engines(model: str, count: int) -> Iterator[list[EngineProcess]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(EngineProcess(model, pool=f"p{i}")) for i in range(count)]


async def bench(urls: list[str], args: argparse.Namespace) -> list[Condition]:
    lags = [float(lag) for lag in args.lags.split(",")]
    names = [f"lag{lag:g}s" for lag in lags]
    config = RouterConfig(
        run="bench",
        pools=tuple(
            PoolConfig(name=name, capacity=1.0, replicas=(url,))
            for name, url in zip(names, urls, strict=True)
        ),
    )
    router = Router(config, RouterSettings(run="bench", health_interval=0.2))
    runner = web.AppRunner(router.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    router_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http:
            clock = Clock(http, list(zip(urls, lags, strict=True)), args.step_seconds)
            results = []
            for name, bounded in (("unbounded", False), ("bounded", True)):
                print(f"{name}: {args.seconds:g}s of load ...", flush=True)
                results.append(await run_condition(router_url, clock, name, bounded, args))
            return results
    finally:
        await runner.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="load per condition")
    parser.add_argument("--episodes", type=int, default=8, help="concurrent episodes")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per turn")
    parser.add_argument("--step-seconds", type=float, default=1.0, help="the stand-in trainer's step time")
    parser.add_argument("--lags", default="0.1,2.5", help="each engine's weight-sync lag in seconds")
    parser.add_argument("--max-staleness", type=int, default=1, help="algorithm.maxStaleness S")
    parser.add_argument("--max-backoff", type=float, default=0.25, help="longest wait between 409 retries")
    args = parser.parse_args()
    lags = args.lags.split(",")
    with tempfile.TemporaryDirectory(prefix="mixrl-bench-") as tmp:
        model = create_tiny_checkpoint(Path(tmp) / "qwen3", "qwen3", vocab_size=VOCAB, seed=0)
        print(f"starting {len(lags)} tiny engines ...", flush=True)
        with engines(model, len(lags)) as started:
            results = asyncio.run(bench([engine.url for engine in started], args))
    print(
        f"\n{args.episodes} episodes at once x {args.turns} turns x {args.tokens} tokens, a step every "
        f"{args.step_seconds:g}s, sync lags {args.lags}s, S = {args.max_staleness}, {args.seconds:g}s each:"
    )
    print_table([row(result, args.max_staleness) for result in results])
    unbounded, bounded = results
    print(
        f"bounded / unbounded: tok/s {bounded.tokens / bounded.seconds / (unbounded.tokens / unbounded.seconds):.2f}, "
        f"staleness p95 {percentile(bounded.staleness, 0.95):.0f} vs {percentile(unbounded.staleness, 0.95):.0f}; "
        f"gave up after the version wait: {bounded.gave_up}; other retries {bounded.retries}/{unbounded.retries}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
