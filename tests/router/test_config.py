"""Where the router's pools come from: the resolved run, with replicas from DNS or a replicas file."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from pydantic import ValidationError

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import resolve
from mixrl.rl.router.config import RouterConfig, RouterConfigError, from_resolved_run, load_replicas_file
from mixrl.rl.router.server import getaddrinfo_resolver, replica_url

EXAMPLE = Path(__file__).parents[2] / "examples" / "rlrun-mixed.yaml"


def test_resolved_run_gives_pools_with_service_names(tmp_path: Path) -> None:
    resolved = resolve(load_rlrun(EXAMPLE))
    config = from_resolved_run(resolved)
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
    assert from_resolved_run(resolved, dns_suffix="").pools[0].service == "qwen3-moe-coding-b200-nvfp4"


def test_pool_lists_and_replicas_files_are_checked_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"pool names must be unique; repeated: a"):
        RouterConfig.model_validate({"pools": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ValidationError, match=r"Tuple should have at least 1 item"):
        RouterConfig.model_validate({"pools": []})
    resolved = resolve(load_rlrun(EXAMPLE))
    first = resolved.pools[0].name
    with pytest.raises(RouterConfigError, match=rf"--replicas: {first}: replicas are listed twice"):
        from_resolved_run(resolved, replicas={first: ("http://h:1", "http://h:1")})
    path = tmp_path / "replicas.json"
    path.write_text("{")
    with pytest.raises(RouterConfigError, match=r"replicas.json: cannot read it"):
        load_replicas_file(path, resolved)
    path.write_text(json.dumps({first: "http://h:1"}))
    with pytest.raises(RouterConfigError, match=r"replicas.json: expected \{pool: \[url, ...\]\}"):
        load_replicas_file(path, resolved)
    path.write_text(json.dumps({first: ["http://h:1/"]}))
    config = from_resolved_run(resolved, replicas=load_replicas_file(path, resolved))
    assert config.pools[0].replicas == ("http://h:1",) and config.pools[1].replicas == ()


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
