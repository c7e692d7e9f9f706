"""Where the router's pools come from: the resolved run (cluster) or a pools file (local runner)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.rl.router.config import RouterConfigError, load_pools_file, load_run_config, parse_pools
from mixrl.rl.router.server import getaddrinfo_resolver, replica_url

EXAMPLE = Path(__file__).parents[2] / "examples" / "rlrun-mixed.yaml"


def test_resolved_run_gives_pools_with_service_names(tmp_path: Path) -> None:
    resolved = resolve(load_rlrun(EXAMPLE))
    path = tmp_path / "run.json"
    path.write_text(resolved.model_dump_json())
    config = load_run_config(path)
    assert config.run == "qwen3-moe-coding"
    assert [p.name for p in config.pools] == [p.name for p in resolved.pools]
    first = config.pools[0]
    assert (first.service, first.gpu_type, first.precision, first.capacity, first.replicas) == (
        "qwen3-moe-coding-b200-nvfp4.rl.svc",
        "B200",
        "nvfp4",
        3.2,
        (),
    )
    assert load_run_config(path, dns_suffix="").pools[0].service == "qwen3-moe-coding-b200-nvfp4"


def test_pools_file_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(RouterConfigError, match=r"pools: pool names must be unique; repeated: a"):
        parse_pools({"pools": [{"name": "a"}, {"name": "a"}]}, "pools")
    with pytest.raises(RouterConfigError, match=r"pools: pools: Tuple should have at least 1 item"):
        parse_pools({"pools": []}, "pools")
    with pytest.raises(RouterConfigError, match=r"pools.0.replicas: replicas are listed twice"):
        parse_pools({"pools": [{"name": "a", "replicas": ["http://h:1", "http://h:1"]}]}, "pools")
    path = tmp_path / "pools.json"
    path.write_text("{")
    with pytest.raises(RouterConfigError, match=r"pools.json: cannot read pools file"):
        load_pools_file(path)
    path.write_text(json.dumps({"pools": [{"name": "a", "replicas": ["http://h:1/"]}]}))
    assert load_pools_file(path).pools[0].replicas == ("http://h:1",)


async def test_real_resolver_finds_loopback_and_formats_urls() -> None:
    assert "127.0.0.1" in await getaddrinfo_resolver("localhost", 30000)
    assert replica_url("10.1.2.3", 30000) == "http://10.1.2.3:30000"
    assert replica_url("fd00::5", 30000) == "http://[fd00::5]:30000"
    try:
        missing = await getaddrinfo_resolver("no-such-pool.invalid", 30000)
    except socket.gaierror as exc:  # without any DNS server the lookup fails instead of NXDOMAIN
        assert exc.errno == socket.EAI_AGAIN
    else:
        assert missing == []
