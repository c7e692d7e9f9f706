"""The router's pool list: the resolved run's pools, with their replicas from a file or from DNS.

The pools (names, GPU types, precisions, capacities; a null capacity means "measure it") come from
the resolved run (``--config``), in a cluster as on a laptop.  Where a pool's replicas are depends
on where the run lives (:class:`mixrl.api.launch.Where`): in a cluster the router resolves each
pool's headless Service ``<run>-<pool>``; ``mixrl run`` lists them in a replicas file::

    {"nvfp4": ["http://127.0.0.1:31001"], "bf16": ["http://127.0.0.1:31002"]}
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mixrl.api.gpus import price_per_gpu_hour
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
    gpus_per_replica: int = Field(default=0, ge=0)
    price_per_gpu_hour: float = Field(default=0.0, ge=0)
    """Dollars per GPU-hour (``costPerGpuHour``, else the default table): the cost counter's rate."""

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


def load_replicas_file(path: Path, run: ResolvedRun) -> dict[str, tuple[str, ...]]:
    """``{pool: [url, ...]}`` for pools of ``run``; RouterConfigError names the file and the pool."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RouterConfigError(f"--replicas {path}: cannot read it: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(urls, list) for urls in data.values()):
        raise RouterConfigError(f"--replicas {path}: expected {{pool: [url, ...]}}")
    known = {pool.name for pool in run.pools}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RouterConfigError(f"--replicas {path}: {unknown[0]}: no such pool in run {run.name!r}")
    return {name: tuple(map(str, urls)) for name, urls in data.items()}


def from_resolved_run(
    run: ResolvedRun, dns_suffix: str | None = None, replicas: dict[str, tuple[str, ...]] | None = None
) -> RouterConfig:
    """Pools of a resolved run, with the listed ``replicas`` (else none: DNS discovery or
    ``PUT /pools/{name}`` fills them in).

    The service name is ``<run>-<pool>.<namespace>.svc``; a pod's resolver search list completes
    it with the cluster domain.
    """
    suffix = f".{run.namespace}.svc" if dns_suffix is None else dns_suffix
    listed = replicas or {}
    pools = []
    for pool in run.pools:
        try:
            pools.append(
                PoolConfig(
                    name=pool.name,
                    gpu_type=pool.gpu_type,
                    precision=pool.weight_precision,
                    capacity=pool.capacity,
                    replicas=listed.get(pool.name, ()),
                    service=f"{pool.object_name}{suffix}",
                    gpus_per_replica=pool.gpus_per_replica,
                    price_per_gpu_hour=price_per_gpu_hour(pool.gpu_type, pool.cost_per_gpu_hour),
                )
            )
        except ValidationError as exc:
            reason = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
            raise RouterConfigError(f"--replicas: {pool.name}: {reason}") from None
    return RouterConfig(run=run.name, pools=tuple(pools))
