"""``mixrl router`` as a real process: run and replicas in, proxy and admin out, clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp

from mixrl.rl.engine.protocol import POOL_HEADER, SESSION_HEADER

from ..servers import cli_server, free_port, run_cli, write_example_config
from .run_files import write_run


def test_bad_replicas_file_gives_one_line_naming_the_pool(tmp_path: Path) -> None:
    config, replicas = write_run(tmp_path, {"a": ["127.0.0.1:80"]})
    result = run_cli("router", "--config", str(config), "--replicas", str(replicas))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mixrl router: --replicas: a: replica '127.0.0.1:80' is not an http(s)://host:port URL"
    ]
    replicas.write_text(json.dumps({"b": []}))
    assert run_cli("router", "--config", str(config), "--replicas", str(replicas)).stderr.strip() == (
        f"mixrl router: --replicas {replicas}: b: no such pool in run 'r'"
    )
    assert run_cli("router", "--config", str(tmp_path / "none.json")).stderr.strip() == (
        f"mixrl router: --config {tmp_path / 'none.json'}: cannot read it (No such file or directory)"
    )
    assert run_cli("router", "--config", str(config), "--session-ttl", "0").stderr.strip() == (
        "mixrl router: --session-ttl: must be > 0"
    )
    # Without spec.health.routing the buffer is never read: refused, not silently ignored.
    ignored = ("--replicas", str(replicas), "--buffer", "http://127.0.0.1:1", "--insecure-no-auth")
    replicas.write_text(json.dumps({"a": []}))
    assert run_cli("router", "--config", str(config), *ignored).stderr.strip() == (
        "mixrl router: --buffer: only read for spec.health.routing, which this run does not set"
        " (the router routes by capacity)"
    )


async def test_router_process_serves_and_stops_on_sigterm(tmp_path: Path, engines) -> None:  # type: ignore[no-untyped-def]
    engine = await engines("e")
    config, replicas = write_run(tmp_path, {"bf16": [engine.url]})
    files = ("--config", str(config), "--replicas", str(replicas))
    async with cli_server("router", tmp_path / "port", *files, "--insecure-no-auth") as (process, url):
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/pools") as response:
                pool = (await response.json())["pools"][0]
            assert (pool["name"], pool["ready_replicas"]) == ("bf16", 1)
            body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}
            async with http.post(f"{url}/generate", json=body, headers={SESSION_HEADER: "s"}) as response:
                assert response.status == 200
                assert response.headers[POOL_HEADER] == "bf16"
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    stderr = (await process.stderr.read()).decode()
    assert "listening on" in stderr and "shutting down" in stderr
    assert engine.sessions_seen == ["s"]


async def test_config_mode_discovers_by_dns_and_serves_metrics_on_its_own_port(tmp_path: Path) -> None:
    config, metrics_port = tmp_path / "run.json", free_port()
    resolved = write_example_config(config)
    flags = ("--config", str(config), "--metrics-port", str(metrics_port), "--dns-suffix", ".invalid")
    async with cli_server("router", tmp_path / "port", *flags, "--insecure-no-auth") as (_, url):
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/pools") as response:
                answer = await response.json()
                pools = answer["pools"]
            async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as response:
                text = await response.text()
        assert [p["name"] for p in pools] == [p.name for p in resolved.pools]
        assert answer["discover_dns"] is True  # on by default with --config
        assert pools[0]["service"] == "qwen3-moe-coding-b200-nvfp4.invalid"
        assert all(p["ready_replicas"] == 0 for p in pools)  # no such Services here
        assert (
            'mixrl_router_replicas{gpu_type="B200",pool="b200-nvfp4",precision="nvfp4",run="qwen3-moe-coding"} 0.0'
            in text
        )
