"""Bounded load test of each server on loopback: buffer, router and engine as real processes.

    .venv/bin/python bench/load.py [--quick] [--clients 16] [--requests 2000] [--generate-requests 300]

The three servers are started exactly as ``mixrl run`` starts them (the launch table,
:func:`mixrl.api.launch.component_command`, and :class:`mixrl.local.processes.Process`): ``mixrl
buffer``, ``mixrl engine`` on a tiny transformers model (random weights, built here) and ``mixrl
router`` in front of it, each on port 0 of 127.0.0.1, each requiring the run's token on its
mutating endpoints (docs/auth.md).  Then, with ``--clients`` concurrent clients in this process
(aiohttp, one event loop) and a fixed number of requests per phase:

- every server's ``GET /health``: the per-request floor of this client, this machine and aiohttp;
  the other figures are also given as ratios to it;
- buffer: ``POST /trajectories`` (one group of trajectories per request) while one more client
  acts as the trainer (``POST /batch?step=N``, then ``POST /commit?step=N``, step after step, as
  ``BufferClient`` does), then ``GET /stats``;
- engine: ``POST /generate`` (``--new-tokens`` tokens, log-probs on);
- router: the same ``/generate`` through the router (a session per client), against the engine
  directly: the ratio is the cost of the extra hop.

Reported per phase: requests/s, p50 and p99 latency, errors (any answer other than the expected
status, or a failed connection; must be 0), and the server's resident memory (VmRSS) before the
phase, half-way and after it: growth that stops (the second half grows no more than the first, and
less than ``--max-rss-growth-mib`` in all) is bounded, a leak is not.  Exit code 1 on any error or
unbounded growth.  Figures: docs/benchmarks.md, "Fuzzing and load".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from mixrl.api.launch import Component, Where, component_command, port_file, process_name
from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.api.trajectory import TokenRecord, Trajectory
from mixrl.local.processes import MIXRL, Process, wait_healthy
from mixrl.rl.auth import AuthToken, write_token_file
from mixrl.rl.engine.protocol import SESSION_HEADER

PROMPTS_PER_UPDATE = 4
SAMPLES_PER_PROMPT = 4
VOCAB = 512
STARTUP_TIMEOUT_S = 180.0

Send = Callable[[aiohttp.ClientSession, int], Awaitable[int]]
"""One request (the i-th of its phase): returns the HTTP status."""


# ----------------------------------------------------------------------------- the servers


def resolved_run(store: Path) -> ResolvedRun:
    """A one-pool run on CPU with the torch engine; its weight store under ``store``."""
    manifest = {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "load"},
        "spec": {
            "model": {"path": "/models/tiny"},
            "trainer": {"gpuType": "cpu", "gpusPerNode": 0},
            "samplerPools": [
                {
                    "name": "p",
                    "gpuType": "cpu",
                    "engine": "torch",
                    "weightPrecision": "bf16",
                    "gpusPerReplica": 0,
                    "engineArgs": ["--torch-threads", "1"],
                }
            ],
            "algorithm": {"promptsPerUpdate": PROMPTS_PER_UPDATE, "samplesPerPrompt": SAMPLES_PER_PROMPT},
            "weights": {"store": f"file://{store}"},
        },
    }
    run = parse_document(manifest)
    assert isinstance(run, RLRun)
    return resolve(run)


@dataclass
class Servers:
    """The run's three servers as local processes, and the token their writes need."""

    buffer: Process
    engine: Process
    router: Process
    token: AuthToken

    @property
    def all(self) -> list[Process]:
        return [self.buffer, self.engine, self.router]

    def stop(self) -> None:
        for process in reversed(self.all):
            process.stop()


def start_servers(work: Path) -> Servers:
    from transformers.utils import logging as hf_logging  # torch: only here, not for --help

    from mixrl.rl.tiny_models import create_tiny_checkpoint

    hf_logging.disable_progress_bar()

    store = work / "weights"
    store.mkdir()
    model = create_tiny_checkpoint(work / "tiny", "qwen3", vocab_size=VOCAB, seed=0)
    run = resolved_run(store)
    (work / "resolved.json").write_text(run.model_dump_json())
    token = AuthToken(secrets.token_urlsafe(32))
    write_token_file(work / "auth-token", token)
    (work / "ports").mkdir()
    where = Where(
        program=MIXRL,
        host="127.0.0.1",
        config=str(work / "resolved.json"),
        auth_token_file=str(work / "auth-token"),
        buffer_dir=str(work / "buffer"),
        trainer_run_dir=str(work),
        port_dir=str(work / "ports"),
        replicas_file=str(work / "replicas.json"),
        engine_model_path=model,
    )
    pool = run.pools[0]

    def process(component: Component) -> Process:
        name = process_name(component, pool if component == "engine" else None)
        command = component_command(run, component, where, pool if component == "engine" else None)
        ports = Path(port_file(where, component, pool if component == "engine" else None))
        return Process(name, [*command, "--log-level", "warning"], work / f"{name}.log", port_file=ports)

    buffer, engine = process("buffer"), process("engine")
    for server in (buffer, engine):
        server.start()
    wait_healthy([buffer, engine], STARTUP_TIMEOUT_S)
    (work / "replicas.json").write_text(json.dumps({pool.name: [engine.url]}))
    router = process("router")
    router.start()
    wait_healthy([router], STARTUP_TIMEOUT_S)
    return Servers(buffer, engine, router, token)


def rss_mib(server: Process) -> float:
    """The server process's resident memory (VmRSS), in MiB."""
    assert server.process is not None
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS line")


# ----------------------------------------------------------------------------- load


@dataclass
class Phase:
    name: str
    server: Process
    requests: int
    clients: int
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    rss: list[float] = field(default_factory=list)
    """VmRSS before, half-way and after (MiB)."""
    first_error: str = ""

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    @property
    def growth(self) -> tuple[float, float]:
        return self.rss[1] - self.rss[0], self.rss[2] - self.rss[1]


class ProgressLine:
    """One line per phase on stderr, rewritten with requests done, rate and ETA."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total, self.done = name, total, 0
        self.start = self.last = time.perf_counter()

    def advance(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last > 0.5 or self.done == self.total:
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate else 0.0
            end = "\n" if self.done == self.total else ""
            print(f"\r  {self.name}: {self.done}/{self.total}, {rate:.0f} req/s, eta {eta:.0f}s   ", end=end,
                  file=sys.stderr, flush=True)  # fmt: skip
            self.last = now


async def run_phase(
    http: aiohttp.ClientSession,
    phase: Phase,
    send: Send,
    expected: int = 200,
    beside: Awaitable[Any] | None = None,
) -> Phase:
    """``phase.requests`` requests by ``phase.clients`` workers (and ``beside``, awaited alongside)."""
    progress = ProgressLine(phase.name, phase.requests)
    next_index = 0
    phase.rss.append(rss_mib(phase.server))

    async def worker() -> None:
        nonlocal next_index
        while next_index < phase.requests:
            i = next_index
            next_index += 1
            started = time.perf_counter()
            try:
                status = await send(http, i)
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, why = -1, f"{type(exc).__name__}: {exc}"
            else:
                why = f"HTTP {status}"
            phase.latencies.append(time.perf_counter() - started)
            if status != expected:
                phase.errors += 1
                phase.first_error = phase.first_error or why
            if i == phase.requests // 2:
                phase.rss.append(rss_mib(phase.server))
            progress.advance()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(phase.clients)), *([beside] if beside else []))
    phase.seconds = time.perf_counter() - started
    phase.rss.append(rss_mib(phase.server))
    return phase


def trajectory(prompt: int, sample: int, tokens: int = 32) -> dict[str, Any]:
    """A finished episode as the rollout posts it: ``tokens`` generated tokens with 8 candidates each."""
    t = Trajectory(
        run="load",
        prompt_id=f"prompt-{prompt}",
        sample_index=sample,
        pool="p",
        gpu_type="cpu",
        precision="bf16",
        prompt_ids=list(range(1, 17)),
        reward=float(sample % 2),
        finish_reason="submitted",
        num_turns=1,
        split="train",
    )
    for k in range(tokens):
        ids = [(k + j) % VOCAB for j in range(8)]
        t.append_generated(
            TokenRecord(
                token_id=ids[0],
                logprob=-0.5,
                cand_ids=ids,
                cand_logprobs=[-0.5 - j for j in range(8)],
                support_size=0,
                weight_version=0,
            )
        )
    return t.model_dump(mode="json")


async def request(http: aiohttp.ClientSession, method: str, url: str, **kwargs: Any) -> int:
    async with http.request(method, url, **kwargs) as response:
        await response.read()
        return response.status


def generate_body(i: int, new_tokens: int) -> bytes:
    ids = [(i * 7 + k) % (VOCAB - 1) + 1 for k in range(8)]
    sampling = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": i}
    return json.dumps({"input_ids": ids, "sampling_params": sampling, "return_logprob": True}).encode()


async def load(servers: Servers, args: argparse.Namespace) -> list[Phase]:
    auth = {"Authorization": f"Bearer {servers.token.reveal()}"}
    buffer, engine, router = servers.buffer.url, servers.engine.url, servers.router.url
    groups = [
        json.dumps([trajectory(p, s) for s in range(SAMPLES_PER_PROMPT)]).encode()
        for p in range(args.requests)
    ]
    steps = args.requests // PROMPTS_PER_UPDATE
    trainer_latencies: list[float] = []
    trainer_errors: list[str] = []

    async def trainer(http: aiohttp.ClientSession) -> None:
        """The trainer's loop: take step N's batch (waiting for it), commit it, go on."""
        for step in range(1, steps + 1):
            started = time.perf_counter()
            params = {"step": str(step), "timeout": "60"}
            taken = await request(http, "POST", f"{buffer}/batch", params=params, headers=auth)
            committed = await request(
                http, "POST", f"{buffer}/commit", params={"step": str(step)}, headers=auth
            )
            trainer_latencies.append(time.perf_counter() - started)
            if (taken, committed) != (200, 200):
                trainer_errors.append(f"step {step}: batch {taken}, commit {committed}")

    def post_group(http: aiohttp.ClientSession, i: int) -> Awaitable[int]:
        headers = {**auth, "Content-Type": "application/json"}
        return request(http, "POST", f"{buffer}/trajectories", data=groups[i], headers=headers)

    def generate_at(url: str) -> Send:
        def send(http: aiohttp.ClientSession, i: int) -> Awaitable[int]:
            headers = {"Content-Type": "application/json", SESSION_HEADER: f"session-{i % args.clients}"}
            return request(
                http, "POST", f"{url}/generate", data=generate_body(i, args.new_tokens), headers=headers
            )

        return send

    def get(url: str) -> Send:
        return lambda http, i: request(http, "GET", url)

    n, c, g = args.requests, args.clients, args.generate_requests
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=c + 1), timeout=timeout) as http:
        await run_phase(http, Phase("warm-up", servers.engine, min(g, 20), c), generate_at(engine))
        phases = [
            await run_phase(http, Phase(f"{s.name} GET /health", s, n, c), get(f"{s.url}/health"))
            for s in servers.all
        ]
        posting = Phase("buffer POST /trajectories (+ trainer)", servers.buffer, n, c)
        await run_phase(http, posting, post_group, beside=trainer(http))
        phases.append(posting)
        phases.append(
            await run_phase(http, Phase("buffer GET /stats", servers.buffer, n, c), get(f"{buffer}/stats"))
        )
        phases.append(
            await run_phase(http, Phase("engine POST /generate", servers.engine, g, c), generate_at(engine))
        )
        phases.append(
            await run_phase(http, Phase("router POST /generate", servers.router, g, c), generate_at(router))
        )
    trainer_phase = Phase("buffer trainer step (POST /batch + /commit)", servers.buffer, steps, 1)
    trainer_phase.latencies, trainer_phase.errors = trainer_latencies, len(trainer_errors)
    trainer_phase.seconds, trainer_phase.rss = posting.seconds, posting.rss
    trainer_phase.first_error = trainer_errors[0] if trainer_errors else ""
    phases.insert(len(servers.all) + 1, trainer_phase)
    return phases


# ----------------------------------------------------------------------------- report


def logged_errors(server: Process) -> int:
    """Lines of the server's log that report an error or a traceback (must be none)."""
    return sum("Traceback" in line or " ERROR " in line for line in server.log_path.read_text().splitlines())


def report(phases: list[Phase], servers: Servers, max_growth: float) -> bool:
    floor = {p.server.name: p for p in phases if p.name.endswith("GET /health")}
    logged = {server.name: logged_errors(server) for server in servers.all}
    print(
        "error or traceback lines in the servers' logs: " + ", ".join(f"{k} {v}" for k, v in logged.items())
    )
    ok = not any(logged.values())
    print(f"{'phase':48} {'requests':>8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'p50/health':>10} {'errors':>6}"
          f"  RSS MiB (before, +1st half, +2nd half)")  # fmt: skip
    for p in phases:
        base = floor[p.server.name]
        growth = p.growth
        bounded = growth[1] <= max(growth[0], 1.0) and sum(growth) < max_growth
        ok = ok and p.errors == 0 and bounded
        print(
            f"{p.name:48} {p.requests:8d} {p.rate:8.0f} {p.percentile(0.5) * 1e3:8.2f} {p.percentile(0.99) * 1e3:8.2f}"
            f" {p.percentile(0.5) / base.percentile(0.5):9.1f}x {p.errors:6d}"
            f"  {p.rss[0]:.0f}, {growth[0]:+.1f}, {growth[1]:+.1f}{'' if bounded else '  UNBOUNDED'}"
            + (f"  first error: {p.first_error}" if p.errors else "")
        )
    routed = next(p for p in phases if p.name == "router POST /generate")
    direct = next(p for p in phases if p.name == "engine POST /generate")
    print(f"router / direct engine /generate: {routed.rate / direct.rate:.2f}x the requests/s,"
          f" {routed.percentile(0.5) / direct.percentile(0.5):.2f}x the p50 latency")  # fmt: skip
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients per phase")
    parser.add_argument("--requests", type=int, default=2000, help="requests per buffer and health phase")
    parser.add_argument("--generate-requests", type=int, default=300, help="requests per /generate phase")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per /generate")
    parser.add_argument(
        "--max-rss-growth-mib", type=float, default=256.0, help="bound on a phase's RSS growth"
    )
    parser.add_argument("--quick", action="store_true", help="200 / 40 requests at 8 clients (a smoke check)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) and print it")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.requests, args.generate_requests = 8, 200, 40
    for name in ("clients", "requests", "generate_requests", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1")
    if args.requests < PROMPTS_PER_UPDATE:
        parser.error(f"--requests: must be at least {PROMPTS_PER_UPDATE} (one trainer step)")
    work = Path(tempfile.mkdtemp(prefix="mixrl-load-"))
    servers = start_servers(work)
    try:
        phases = asyncio.run(load(servers, args))
    finally:
        servers.stop()
    print(f"{args.clients} clients; buffer steps of {PROMPTS_PER_UPDATE} groups of {SAMPLES_PER_PROMPT};"
          f" /generate of {args.new_tokens} tokens on a tiny Qwen3 (CPU, 1 torch thread)")  # fmt: skip
    ok = report(phases, servers, args.max_rss_growth_mib)
    if args.keep:
        print(f"work directory: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
