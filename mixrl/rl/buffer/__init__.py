"""Trajectory buffer: groups trajectories by prompt, hands full groups to the trainer, durably.

``mixrl buffer`` runs :func:`main`.  Pieces: :mod:`.grouping` (pure), :mod:`.store`
(``TrajectoryBuffer``: the state made durable by append-only logs), :mod:`.server` (aiohttp) and
:mod:`.client` (``BufferClient``, used by the rollout worker and the trainer).
"""

from __future__ import annotations

from mixrl.rl.buffer.client import Batch, BatchGroup, BufferClient, BufferError


def main(argv: list[str]) -> int:
    from mixrl.rl.buffer.cli import main as cli_main

    return cli_main(argv)


__all__ = ["Batch", "BatchGroup", "BufferClient", "BufferError", "main"]
