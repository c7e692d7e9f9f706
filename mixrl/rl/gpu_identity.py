"""Which GPU this process actually runs on, as NVML reports it (nvidia-ml-py, imported lazily).

Engine pods report it so the operator can tell a pool that landed on the wrong GPU type (a node
label that lies, a node selector that was overridden).  Without nvidia-ml-py, a driver or a GPU
the answer is None: a CPU run has no GPU identity, and that is not an error.

NVML names a GPU ``NVIDIA H100 80GB HBM3``; GPU Feature Discovery publishes the same name with
dashes, ``NVIDIA-H100-80GB-HBM3``, as the ``nvidia.com/gpu.product`` node label.  The GPU table
(``mixrl.api.gpus``) lists products in GFD's spelling, so :func:`product_label` converts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuIdentity:
    name: str
    """NVML's device name, e.g. ``NVIDIA H100 80GB HBM3``."""
    product: str
    """The same in GFD's ``nvidia.com/gpu.product`` spelling, e.g. ``NVIDIA-H100-80GB-HBM3``."""
    uuid: str
    memory_mib: int
    driver: str
    count: int
    """GPUs visible to this process."""


def product_label(name: str) -> str:
    """NVML or DCGM ``modelName`` → GFD's product label (spaces become dashes, as GFD does)."""
    return re.sub(r"\s+", "-", name.strip())


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def gpu_identity(index: int = 0) -> GpuIdentity | None:
    """The identity of GPU ``index`` (default the first visible one), or None without a GPU."""
    try:
        import pynvml  # nvidia-ml-py; only present in GPU images
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None  # no driver, or no GPU in this container
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count <= index:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(pynvml.nvmlDeviceGetName(handle))
        return GpuIdentity(
            name=name,
            product=product_label(name),
            uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
            memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024),
            driver=_text(pynvml.nvmlSystemGetDriverVersion()),
            count=count,
        )
    finally:
        pynvml.nvmlShutdown()
