"""The router's pool list: from the local runner's pools file or from the resolved run (Kubernetes).

Pools file (written by ``mixrl run``)::

    {"run": "quickstart",
     "pools": [{"name": "nvfp4", "gpu_type": "cpu", "precision": "nvfp4", "capacity": 1.0,
                "replicas": ["http://127.0.0.1:31001"]}]}

``capacity`` null (or absent) means "measure it".  In the cluster the router reads the resolved run
(the operator's ConfigMap, ``ResolvedRun`` as JSON) and finds replicas by resolving each pool's
headless Service ``<run>-<pool>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mixrl.api.resolve import ResolvedRun


class RouterConfigError(ValueError):
    """A pools file or run config the router cannot use; the message names the field."""


class PoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    gpu_type: str = ""
    precision: str = ""
    capacity: float | None = Field(default=None, gt=0)
    replicas: tuple[str, ...] = ()
    service: str | None = None
    """DNS name of the pool's headless Service (used with --discover-dns)."""

    @field_validator("replicas")
    @classmethod
    def _urls(cls, replicas: tuple[str, ...]) -> tuple[str, ...]:
        for url in replicas:
            check_replica_url(url)
        if len(set(replicas)) != len(replicas):
            raise ValueError("replicas are listed twice")
        return tuple(url.rstrip("/") for url in replicas)


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str = ""
    pools: tuple[PoolConfig, ...] = Field(min_length=1)

    @field_validator("pools")
    @classmethod
    def _unique(cls, pools: tuple[PoolConfig, ...]) -> tuple[PoolConfig, ...]:
        names = [pool.name for pool in pools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"pool names must be unique; repeated: {', '.join(duplicates)}")
        return pools


def check_replica_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"replica {url!r} is not an http(s)://host:port URL")
    return url


def _first_error(exc: ValidationError, source: str) -> RouterConfigError:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    message = str(error["msg"]).removeprefix("Value error, ")
    return RouterConfigError(f"{source}: {where}: {message}")


def parse_pools(data: object, source: str = "pools") -> RouterConfig:
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise _first_error(exc, source) from None


def load_pools_file(path: Path) -> RouterConfig:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RouterConfigError(f"{path}: cannot read pools file: {exc}") from None
    return parse_pools(data, str(path))


def from_resolved_run(run: ResolvedRun, dns_suffix: str | None = None) -> RouterConfig:
    """Pools of a resolved run, without replicas (DNS discovery fills them in).

    The service name is ``<run>-<pool>.<namespace>.svc``; a pod's resolver search list completes
    it with the cluster domain.
    """
    suffix = f".{run.namespace}.svc" if dns_suffix is None else dns_suffix
    pools = tuple(
        PoolConfig(
            name=pool.name,
            gpu_type=pool.gpu_type,
            precision=pool.weight_precision,
            capacity=pool.capacity,
            service=f"{pool.object_name}{suffix}",
        )
        for pool in run.pools
    )
    return RouterConfig(run=run.name, pools=pools)


def load_run_config(path: Path, dns_suffix: str | None = None) -> RouterConfig:
    try:
        run = ResolvedRun.model_validate_json(path.read_text())
    except OSError as exc:
        raise RouterConfigError(f"{path}: cannot read run config: {exc}") from None
    except ValidationError as exc:
        raise _first_error(exc, str(path)) from None
    return from_resolved_run(run, dns_suffix)
