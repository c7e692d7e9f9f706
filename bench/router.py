"""Router benchmark: share accuracy against random assignment, and proxy overhead against direct calls.

    .venv/bin/python bench/router.py [--sessions 10000] [--seeds 20] [--requests 2000] [--concurrency 32]

1. Share accuracy (pure): four pools shaped like the paper's mix; over ``--sessions`` sessions the
   worst pool's |observed share − target| in percentage points, for the router's deficit
   scheduler and for the baseline of independent random draws with the same probabilities
   (``--seeds`` runs each; the deterministic scheduler varies only through session ends).
2. Proxy overhead (real HTTP on loopback): ``--requests`` /generate calls at ``--concurrency``
   against a minimal stand-in engine (an aiohttp app answering a fixed SGLang-shaped body),
   once directly and once through the router; prints requests/s and the ratio.  Both the client
   and the servers share this process's event loop, so the ratio is the honest cost of one extra
   hop with session bookkeeping, not a production throughput figure.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import aiohttp
from aiohttp import web

from mixrl.rl.engine.protocol import SESSION_HEADER
from mixrl.rl.router.config import PoolConfig, RouterConfig
from mixrl.rl.router.server import Router, RouterSettings
from mixrl.rl.router.state import RouterState

POOLS = {"b200-nvfp4": (3.2, 2), "h200-fp8": (1.8, 3), "h100-bf16": (1.0, 4), "a100-bf16": (0.5, 5)}


def share_error_deficit(sessions: int, seed: int) -> float:
    configs = [
        PoolConfig(name=name, capacity=cap, replicas=tuple(f"http://{name}-{i}:1" for i in range(n)))
        for name, (cap, n) in POOLS.items()
    ]
    state = RouterState(configs)
    for config in configs:
        for url in config.replicas:
            state.set_ready(config.name, url, True)
    rng = random.Random(seed)
    counts = dict.fromkeys(POOLS, 0)
    for i in range(sessions):
        counts[state.route(f"s{i}", now=float(i)).pool] += 1
        if rng.random() < 0.5:
            state.end_session(f"s{i}")
    return max_error(counts, sessions)


def share_error_random(sessions: int, seed: int) -> float:
    rng = random.Random(seed)
    names = list(POOLS)
    weights = [cap * n for cap, n in POOLS.values()]
    counts = dict.fromkeys(POOLS, 0)
    for name in rng.choices(names, weights, k=sessions):
        counts[name] += 1
    return max_error(counts, sessions)


def max_error(counts: dict[str, int], sessions: int) -> float:
    total = sum(cap * n for cap, n in POOLS.values())
    return max(abs(counts[name] / sessions - cap * n / total) * 100 for name, (cap, n) in POOLS.items())


async def stand_in_engine() -> tuple[web.AppRunner, str]:
    """Stand-in engine: answers every /generate with a fixed SGLang-shaped body (no model)."""
    body = b'{"text": "", "output_ids": [1, 2, 3, 4], "meta_info": {"completion_tokens": 4}}'

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    return await serve(app)


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def hammer(url: str, requests: int, concurrency: int) -> float:
    payload = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}'
    next_index = 0

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < requests:
            i = next_index
            next_index += 1
            headers = {SESSION_HEADER: f"s{i % 256}", "Content-Type": "application/json"}
            async with http.post(f"{url}/generate", data=payload, headers=headers) as response:
                await response.read()
                assert response.status == 200

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        started = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        return requests / (time.perf_counter() - started)


async def proxy_overhead(requests: int, concurrency: int) -> tuple[float, float]:
    engine_runner, engine_url = await stand_in_engine()
    config = RouterConfig(run="bench", pools=(PoolConfig(name="p", capacity=1.0, replicas=(engine_url,)),))
    router = Router(config, RouterSettings(run="bench", health_interval=3600))
    router_runner, router_url = await serve(router.app())
    try:
        await hammer(engine_url, min(200, requests), concurrency)  # warm-up
        direct = await hammer(engine_url, requests, concurrency)
        routed = await hammer(router_url, requests, concurrency)
        return direct, routed
    finally:
        await router_runner.cleanup()
        await engine_runner.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()

    deficit = [share_error_deficit(args.sessions, seed) for seed in range(args.seeds)]
    randomized = [share_error_random(args.sessions, seed) for seed in range(args.seeds)]
    print(
        f"share accuracy over {args.sessions} sessions, worst pool, {args.seeds} seeds (percentage points):"
    )
    print(f"  deficit scheduler: max {max(deficit):.4f}  mean {sum(deficit) / len(deficit):.4f}")
    print(f"  random baseline:   max {max(randomized):.4f}  mean {sum(randomized) / len(randomized):.4f}")
    print(
        f"  random / deficit (mean): {sum(randomized) / max(sum(deficit), 1e-12):.0f}x;"
        f" runs over 1 point: deficit {sum(e > 1 for e in deficit)}, random {sum(e > 1 for e in randomized)}"
    )

    direct, routed = asyncio.run(proxy_overhead(args.requests, args.concurrency))
    print(f"proxy, {args.requests} requests at concurrency {args.concurrency} on loopback:")
    print(f"  direct {direct:.0f} req/s, through the router {routed:.0f} req/s, ratio {routed / direct:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
