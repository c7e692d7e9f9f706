"""``mixrl router`` as a real process: run and replicas in, proxy and admin out, clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp

from mixrl.rl.engine.protocol import POOL_HEADER, SESSION_HEADER

from .run_files import write_run


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "router", *args], capture_output=True, text=True, timeout=60
    )


def test_bad_replicas_file_gives_one_line_naming_the_pool(tmp_path: Path) -> None:
    config, replicas = write_run(tmp_path, {"a": ["127.0.0.1:80"]})
    result = run_cli("--config", str(config), "--replicas", str(replicas))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mixrl router: --replicas: a: replica '127.0.0.1:80' is not an http(s)://host:port URL"
    ]
    replicas.write_text(json.dumps({"b": []}))
    assert run_cli("--config", str(config), "--replicas", str(replicas)).stderr.strip() == (
        f"mixrl router: --replicas {replicas}: b: no such pool in run 'r'"
    )
    assert run_cli("--config", str(tmp_path / "none.json")).stderr.strip() == (
        f"mixrl router: --config {tmp_path / 'none.json'}: cannot read it (No such file or directory)"
    )
    assert run_cli("--config", str(config), "--session-ttl", "0").stderr.strip() == (
        "mixrl router: --session-ttl: must be > 0"
    )


async def test_router_process_serves_and_stops_on_sigterm(tmp_path: Path, engines) -> None:  # type: ignore[no-untyped-def]
    engine = await engines("e")
    config, replicas = write_run(tmp_path, {"bf16": [engine.url]})
    port_file = tmp_path / "port"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mixrl.cli",
        "router",
        "--config",
        str(config),
        "--replicas",
        str(replicas),
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--insecure-no-auth",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        for _ in range(600):
            if port_file.exists():
                break
            assert process.returncode is None
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}"
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
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    stderr = (await process.stderr.read()).decode()
    assert "listening on" in stderr and "shutting down" in stderr
    assert engine.sessions_seen == ["s"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_config_mode_discovers_by_dns_and_serves_metrics_on_its_own_port(tmp_path: Path) -> None:
    from mixrl.api.loader import load_rlrun
    from mixrl.api.resolve import resolve

    resolved = resolve(load_rlrun(Path(__file__).parents[2] / "examples" / "rlrun-mixed.yaml"))
    config = tmp_path / "run.json"
    config.write_text(resolved.model_dump_json())
    port_file, metrics_port = tmp_path / "port", free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mixrl.cli",
        "router",
        "--config",
        str(config),
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--metrics-port",
        str(metrics_port),
        "--dns-suffix",
        ".invalid",
        "--insecure-no-auth",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        for _ in range(600):
            if port_file.exists():
                break
            assert process.returncode is None
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port_file.read_text()}/pools") as response:
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
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)
