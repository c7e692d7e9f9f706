"""How long a sampler pool stops generating for one weight update, per pool (issue #29).

The fleet simulators (:mod:`mixrl.sim.fleet`, :mod:`mixrl.sim.trainer_coupled`) used to pause every
pool a fixed 20 s per update.  How long a pool really pauses depends on how its engines take a new
version:

- ``staged``: the engine prepares the new version beside the served weights while it keeps
  decoding, then swaps between two decode steps — mixrl's torch engine loading from the store, and
  a BF16 pool receiving the trainer's broadcast (``weights.broadcast``, ``mixrl run`` only: the
  operator refuses it in a cluster).  Its pause is ``pause_decode_steps`` decode steps of the pool
  (:data:`PAUSE_DECODE_STEPS`, measured by ``bench/weight_sync.py``).
- ``paused``: SGLang's disk path (the weight-sync sidecar's pause in place →
  ``/update_weights_from_disk`` → continue): the engine generates nothing for the whole load.  No
  GPU has measured that load here, so its length is an assumption: :data:`SGLANG_DISK_PAUSE_S`
  (the simulators' earlier fleet-wide figure), or ``disk_s_per_gb`` × the pool's checkpoint size
  when the run states one.

A simulator ticks once per second; a pause shorter than a second removes that share of the
second's capacity (:func:`paused_fraction`), it is not rounded to 0 or 1 s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

import numpy as np

from mixrl.api.memory import BYTES_PER_PARAMETER

if TYPE_CHECKING:
    from mixrl.sim.fleet import FleetPool

STAGED: Final = "staged"
PAUSED: Final = "paused"
UpdateMode = Literal["staged", "paused"]

PAUSE_DECODE_STEPS = 2.0
"""Extra delay of a staged update, in decode steps of the pool.  ``bench/weight_sync.py`` (two torch
engines of a Qwen3-0.6B-shaped model under streamed decode load, the staged pass, f45943d): the gap
between two tokens that spans the swap is 1.0–2.0 median decode steps (p50 1.5), a step slowed by
the preparation sharing the 2 cores, so at most about one step beyond the one it would have taken
anyway; 2.0 keeps a margin."""

SGLANG_DISK_PAUSE_S = 20.0
"""Assumption, not a measurement: seconds an SGLang engine on the disk path generates nothing per
update (paused in place for the whole ``/update_weights_from_disk``).  The figure the simulators
used for every pool before issue #29; no GPU has measured SGLang's load in this project."""


def decode_step_s(tokens_per_s_per_sequence: float) -> float:
    """One decode step of a pool: each running sequence gains one token per step, so a step lasts
    the inverse of one sequence's token rate (callers derive that rate from their own model)."""
    return 1.0 / tokens_per_s_per_sequence


def weights_gb(parameters_billions: float, precision: str) -> float:
    """Gigabytes (10⁹ bytes) of one checkpoint in ``precision`` (``mixrl.api.memory``'s bytes per
    parameter: bf16 2, fp8 1, nvfp4 0.5625, mxfp4 0.53125)."""
    return parameters_billions * BYTES_PER_PARAMETER[precision]


def paused_fraction(pause_s: float | np.ndarray, offset_s: float | np.ndarray) -> np.ndarray:
    """Share of the one-second tick that starts ``offset_s`` seconds after a pause of ``pause_s``
    seconds began: 1 while the pause covers the whole tick, its remainder in the tick where it
    ends (a 0.05 s pause removes 5 % of that tick's capacity), 0 before it began and after."""
    offset = np.asarray(offset_s, dtype=float)
    share = np.clip(np.asarray(pause_s, dtype=float) - offset, 0.0, 1.0)
    return np.where(offset >= 0, share, 0.0)


@dataclass(frozen=True)
class WeightPause:
    """The simulators' weight-update pause, per pool.

    ``every_pool_s`` set: every pool pauses that long (the model before issue #29: 20 s), whatever
    its engine.  Otherwise each pool's :meth:`mode` decides: ``staged`` pools pause
    ``pause_decode_steps`` of their decode step, ``paused`` pools ``disk_pause_s`` (or
    ``disk_s_per_gb`` × the checkpoint's gigabytes at the pool's precision, with
    ``parameters_billions``).  ``broadcast``: BF16 pools receive the trainer's broadcast and swap
    as the torch engine does.  ``staged_everywhere``: a what-if — every pool swaps like the torch
    engine (SGLang has no such disk path today)."""

    every_pool_s: float | None = None
    pause_decode_steps: float = PAUSE_DECODE_STEPS
    disk_pause_s: float = SGLANG_DISK_PAUSE_S
    disk_s_per_gb: float | None = None
    parameters_billions: float | None = None
    broadcast: bool = False
    staged_everywhere: bool = False

    def __post_init__(self) -> None:
        if self.disk_s_per_gb is not None and self.parameters_billions is None:
            raise ValueError("WeightPause: disk_s_per_gb needs parameters_billions (the checkpoint's size)")

    def mode(self, pool: FleetPool) -> UpdateMode:
        """How the pool's engines take a version: ``staged`` (torch engine; a BF16 pool on the
        broadcast) or ``paused`` (SGLang loading from disk)."""
        if self.staged_everywhere or pool.engine == "torch":
            return STAGED
        if self.broadcast and pool.weight_precision == "bf16":
            return STAGED
        return PAUSED

    def seconds(self, pool: FleetPool, step_s: float) -> float:
        """Seconds the pool generates nothing per update; ``step_s`` is its decode step."""
        if self.every_pool_s is not None:
            return self.every_pool_s
        if self.mode(pool) == STAGED:
            return self.pause_decode_steps * step_s
        if self.disk_s_per_gb is not None:
            assert self.parameters_billions is not None
            return self.disk_s_per_gb * weights_gb(self.parameters_billions, pool.weight_precision)
        return self.disk_pause_s

    def per_pool(self, pools: Sequence[FleetPool], step_s: float) -> np.ndarray:
        return np.array([self.seconds(p, step_s) for p in pools], dtype=float)

    def describe(self, step_s: float) -> str:
        """One line for a benchmark's table."""
        if self.every_pool_s is not None:
            return f"every pool {self.every_pool_s:g} s (the model before issue #29)"
        staged = f"{self.pause_decode_steps:g} decode steps ({self.pause_decode_steps * step_s:.3f} s)"
        if self.staged_everywhere:
            return f"every pool staged: {staged} (what-if)"
        disk = (
            f"{self.disk_s_per_gb:g} s/GB"
            if self.disk_s_per_gb is not None
            else f"{self.disk_pause_s:g} s (assumed)"
        )
        bf16 = ", BF16 pools on the broadcast staged" if self.broadcast else ""
        return f"per pool: SGLang disk {disk}, torch engine {staged}{bf16}"


def update_pauses(
    pools: Sequence[FleetPool], weight_update_s: float | None, pause: WeightPause, step_s: float
) -> np.ndarray:
    """Seconds each pool generates nothing per weight update: ``weight_update_s`` for every pool
    when it is set (a simulator's fixed pause), else ``pause``'s per pool (``step_s``: the decode
    step)."""
    if weight_update_s is not None:
        return np.full(len(pools), float(weight_update_s))
    return pause.per_pool(pools, step_s)


OLD_MODEL = WeightPause(every_pool_s=SGLANG_DISK_PAUSE_S)
"""Every pool 20 s per update: what the simulators assumed before issue #29."""
