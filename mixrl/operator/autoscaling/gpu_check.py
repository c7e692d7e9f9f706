"""Is a pool running on the GPUs its spec asked for?  A pure check over the reported products.

The reports come from what the GPUs say about themselves — DCGM exporter's ``modelName`` label,
queried per pool through Prometheus — never from node labels, which are what could be wrong.
The condition ``WrongGpuType`` is True when any reported product is outside the pool's
``nvidia.com/gpu.product`` list (the GPU table's, or the spec's override).  A GPU reports its own
name, never GPU Feature Discovery's ``-SHARED`` suffix for time-sliced nodes, so an allowed
``…-SHARED`` product counts as the GPU it names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from mixrl.api.kube_types import Condition, ConditionValue, Obj
from mixrl.api.memory import SHARED_SUFFIX
from mixrl.operator.kube.conditions import make_condition


def product_label(name: str) -> str:
    """NVML's or DCGM's ``modelName`` (``NVIDIA H100 80GB HBM3``) → GPU Feature Discovery's
    ``nvidia.com/gpu.product`` spelling (``NVIDIA-H100-80GB-HBM3``): spaces become dashes, as GFD
    does; the GPU table (``mixrl.api.gpus``) lists products in GFD's spelling."""
    return re.sub(r"\s+", "-", name.strip())


WRONG_GPU_TYPE = "WrongGpuType"


def wrong_gpu_value(reported: Iterable[str], allowed: Sequence[str]) -> ConditionValue | None:
    """(status, reason, message) of WrongGpuType, or None when nothing can be said."""
    products = {product_label(name) for name in reported if name}
    if not products or not allowed:
        return None  # no telemetry yet, or a CPU pool (no product list to check against)
    unexpected = sorted(products - {name.removesuffix(SHARED_SUFFIX) for name in allowed})
    if unexpected:
        return (
            "True",
            "UnexpectedProduct",
            f"pods run on {', '.join(unexpected)}; the pool allows {', '.join(allowed)}",
        )
    return "False", "ProductsMatch", f"pods run on {', '.join(sorted(products))}"


def wrong_gpu_condition(
    reported: Iterable[str], allowed: Sequence[str], previous: list[Obj], generation: int | None, now: str
) -> Condition | None:
    value = wrong_gpu_value(reported, allowed)
    if value is None:
        return None
    return make_condition(WRONG_GPU_TYPE, value, generation, now, previous)
