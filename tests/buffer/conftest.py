"""Buffer tests.

Everything here is real: the pure grouping, the append-only logs on a real temporary directory
(flush + fsync), the aiohttp server over loopback HTTP, ``BufferClient``, and ``mixrl buffer`` as a
real process killed with SIGKILL and restarted on the same directory.  No stand-ins: the
trajectories are built with the shared :class:`~mixrl.api.trajectory.Trajectory` type, with
invented token ids (the buffer never looks inside tokens beyond versions and masks).
"""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import resolve
from mixrl.api.trajectory import TokenRecord, Trajectory

from ..fakes import no_leftover_tasks as no_leftover_tasks
from ..servers import RunningBuffer as RunningBuffer
from ..servers import StartBuffer as StartBuffer
from ..servers import started_buffers


def make_trajectory(
    prompt_id: str,
    sample_index: int = 0,
    versions: tuple[int, ...] = (0, 0),
    pool: str = "fp8",
    reward: float | None = 1.0,
    split: str = "train",
) -> Trajectory:
    """A finished episode: one generated token per entry of ``versions``, with a tool reply between."""
    trajectory = Trajectory(
        run="test",
        prompt_id=prompt_id,
        sample_index=sample_index,
        pool=pool,
        gpu_type=f"gpu-{pool}",
        precision=pool,
        prompt_ids=[1, 2, 3],
        reward=reward,
        finish_reason="submitted",
        num_turns=1,
        split=split,
    )
    for i, version in enumerate(versions):
        token = 10 + i
        record = TokenRecord(
            token_id=token,
            logprob=-0.5,
            cand_ids=[token, 99],
            cand_logprobs=[-0.5, -1.2],
            support_size=0,
            weight_version=version,
        )
        trajectory.append_generated(record)
        if i == 0:
            trajectory.append_observation([7, 8])  # tool output: masked, no version
    return trajectory


def group_of(
    prompt_id: str, size: int, versions: tuple[int, ...] = (0, 0), pool: str = "fp8"
) -> list[Trajectory]:
    return [make_trajectory(prompt_id, i, versions, pool) for i in range(size)]


class FullDisk:
    """A log file on a disk that fills up mid-write: half of the bytes land, then ENOSPC."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def write(self, data: bytes) -> int:
        self.f.write(bytes(data[: len(data) // 2]))
        self.f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


@pytest.fixture
async def start_buffer(tmp_path: Path) -> AsyncIterator[StartBuffer]:
    async with started_buffers(tmp_path / "buffer") as start:
        yield start


def write_run_config(path: Path, prompts: int, samples: int, max_staleness: int | None = None) -> Path:
    """A resolved run (``--config``) of ``prompts`` groups of ``samples`` per step, named ``test``."""
    algorithm = {"promptsPerUpdate": prompts, "samplesPerPrompt": samples, "maxStaleness": max_staleness}
    pool = {"name": "p", "gpuType": "cpu", "engine": "torch", "weightPrecision": "bf16", "gpusPerReplica": 0}
    manifest = {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "test"},
        "spec": {
            "model": {"path": "/models/tiny"},
            "trainer": {"gpuType": "cpu", "gpusPerNode": 0},
            "samplerPools": [pool],
            "algorithm": algorithm,
        },
    }
    run = parse_document(manifest)
    assert isinstance(run, RLRun)
    path.write_text(resolve(run).model_dump_json())
    return path
