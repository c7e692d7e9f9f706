"""Sandbox benchmark: sandboxed tool calls per second, and the sandbox's overhead against the same
command run without one.

    .venv/bin/python bench/sandbox.py [--calls 400] [--concurrency 2] [--quick]

For each command, ``--calls`` calls at ``--concurrency`` at once, in the same process and the same
run, two ways:

- sandboxed: :meth:`mixrl.rl.sandbox.Sandbox.run` with a generated coding task's files (bubblewrap,
  fresh namespaces and tmpfs per call, the files copied in and read back);
- baseline: the same ``/bin/sh -c command`` as a plain subprocess in a temporary directory holding
  the same files, written fresh for every call (what an unsandboxed tool call costs at least).

The commands: ``true`` (the pure cost of a call) and ``python3 test_solution.py`` (a realistic tool
call: an interpreter starts and runs the task's examples).  Prints calls/s, p50/p95 latency and the
ratio sandboxed/baseline.  Only benign commands written here run unsandboxed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial

from mixrl.rl.environments.coding.tasks import SOLUTION_FILE, generate_tasks
from mixrl.rl.sandbox import Limits, Sandbox, SandboxConfig
from mixrl.rl.sandbox.files import write_tree

COMMANDS = ("true", "python3 test_solution.py")


class Progress:
    """One line per tenth of the work: done/total, rate, ETA."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
        self.started = time.perf_counter()

    def step(self) -> None:
        self.done += 1
        if self.done % max(self.total // 10, 1) == 0 or self.done == self.total:
            elapsed = time.perf_counter() - self.started
            rate = self.done / elapsed if elapsed else 0.0
            eta = (self.total - self.done) / rate if rate else 0.0
            print(
                f"  {self.what}: {self.done}/{self.total} calls, {rate:.1f} calls/s, eta {eta:.0f} s",
                flush=True,
            )


async def unsandboxed(command: str, files: Mapping[str, str]) -> int:
    """The baseline: the same command in a fresh directory with the same files, no isolation."""
    directory = tempfile.mkdtemp(prefix="mixrl-bench-")
    try:
        write_tree(directory, files)
        # the sandbox's own environment (PATH: the same python3), with HOME and TMPDIR here
        env = dict(SandboxConfig().base_env) | {"HOME": directory, "TMPDIR": directory}
        process = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            command,
            cwd=directory,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        await process.communicate()
        return process.returncode or 0
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def measure(
    what: str, call: Callable[[], Awaitable[int]], calls: int, concurrency: int
) -> tuple[float, list[float]]:
    """calls/s and each call's latency (s); every call must exit 0."""
    progress = Progress(what, calls)
    latencies: list[float] = []
    remaining = calls

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            status = await call()
            latencies.append(time.perf_counter() - started)
            if status != 0:
                raise RuntimeError(f"{what}: a call exited {status}")
            progress.step()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return calls / (time.perf_counter() - started), latencies


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[min(int(q * len(values)), len(values) - 1)]


async def bench(calls: int, concurrency: int) -> list[tuple[str, float, float, float, float, float, float]]:
    task = generate_tasks("train", 1, seed=0, levels=(1,))[0]
    files = {**task.files, **task.reference}  # the examples pass: a call exits 0
    sandbox = Sandbox(SandboxConfig(max_concurrent=concurrency))
    limits = Limits(wall_s=30.0)

    async def sandboxed_call(command: str) -> int:
        result = await sandbox.run(command, files, limits)
        return result.exit_code if result.finish_reason == "ok" and result.exit_code is not None else 1

    rows = []
    for command in COMMANDS:
        print(f"{command!r}: {calls} calls at concurrency {concurrency}", flush=True)
        await measure("warm-up", partial(sandboxed_call, command), max(calls // 20, 2), concurrency)
        base_rate, base_lat = await measure(
            "baseline ", partial(unsandboxed, command, files), calls, concurrency
        )
        box_rate, box_lat = await measure("sandboxed", partial(sandboxed_call, command), calls, concurrency)
        rows.append(
            (
                command,
                box_rate,
                base_rate,
                statistics.median(box_lat),
                percentile(box_lat, 0.95),
                statistics.median(base_lat),
                percentile(base_lat, 0.95),
            )
        )
    assert SOLUTION_FILE in files
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="calls per command and way (default 400)")
    parser.add_argument("--concurrency", type=int, default=2, help="calls at once (default 2: two cores)")
    parser.add_argument("--quick", action="store_true", help="40 calls per command and way")
    args = parser.parse_args()
    if args.calls <= 0 or args.concurrency <= 0:
        parser.error("--calls and --concurrency must be positive")
    calls = 40 if args.quick else args.calls
    print(
        f"{os.cpu_count()} CPUs, concurrency {args.concurrency}, {calls} calls per command and way",
        flush=True,
    )
    rows = asyncio.run(bench(calls, args.concurrency))
    print(
        "\ncommand                    sandboxed calls/s  baseline calls/s  ratio   p50 sandboxed/baseline  p95 sandboxed/baseline"
    )
    for command, box, base, box50, box95, base50, base95 in rows:
        print(
            f"{command:<26} {box:>17.1f} {base:>17.1f} {box / base:>6.2f}   "
            f"{box50 * 1000:>7.1f} / {base50 * 1000:.1f} ms  {box95 * 1000:>10.1f} / {base95 * 1000:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
