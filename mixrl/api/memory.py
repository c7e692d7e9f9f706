"""Do the model's weights fit the GPUs a pool or the trainer lands on?  A check on the spec alone.

It runs only when the spec says how large the model is (``model.parametersBillions``): a 30B
model in BF16 at one GPU per replica cannot be served by a 40 GB A100, and the place to say so is
validation (one line naming the field), not a pod that crash-loops on a GPU node an hour later.

The estimate is a lower bound, so a refusal is certain and a pass is not a promise: weights count
at their serving precision (embeddings and norms, which stay BF16, are ignored), the KV cache and
activations not at all.  The GPUs counted are the smallest of the products the pods may be
scheduled on (``scheduling.gpuProducts``, else the GPU table's, whose A100 entry includes the 40 GB
parts); memory comes from the product name where GPU Feature Discovery puts it (``…-40GB``, MIG
profiles ``…-MIG-1g.10gb``), else from the GPU table.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mixrl.api.gpus import GPU_TABLE

GIB = 2**30
WEIGHT_FRACTION = 0.9
"""The weights alone may fill at most this share of a GPU (the rest: KV cache, activations, CUDA)."""
BYTES_PER_PARAMETER = {"bf16": 2.0, "fp8": 1.0, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
"""Serving precision -> bytes per weight, block scales included (MXFP4: one byte per 32, NVFP4: per 16)."""
TRAINING_BYTES_PER_PARAMETER = 8.0
"""BF16 weights and gradients plus AdamW's two moments at BF16 at least: the floor under any sharding."""
SHARED_SUFFIX = "-SHARED"
"""GPU Feature Discovery's suffix for time-sliced (shared) GPUs; the memory is the product's."""

_MIG = re.compile(r"-MIG-\d+g\.(\d+)gb$", re.IGNORECASE)
_SIZE = re.compile(r"-(\d+)GB(?:-|$)", re.IGNORECASE)


def product_memory_gib(product: str, gpu_type: str) -> float:
    """Memory of one GPU of ``product`` (a ``nvidia.com/gpu.product`` value) of ``gpu_type``."""
    name = product.removesuffix(SHARED_SUFFIX)
    if mig := _MIG.search(name):
        return float(mig.group(1))
    if size := _SIZE.search(name):
        return float(size.group(1))
    return float(GPU_TABLE[gpu_type].memory_gib)


def smallest_product(products: Sequence[str], gpu_type: str) -> tuple[str, float]:
    """The product with the least memory, and that memory (the table's entry without products)."""
    candidates = list(products) or [gpu_type]
    return min(((p, product_memory_gib(p, gpu_type)) for p in candidates), key=lambda pair: pair[1])


def fit_problem(need_gib: float, gpus: int, products: Sequence[str], gpu_type: str, what: str) -> str | None:
    """Why ``need_gib`` spread over ``gpus`` GPUs does not fit, or None."""
    product, memory = smallest_product(products, gpu_type)
    per_gpu = need_gib / gpus
    if per_gpu <= WEIGHT_FRACTION * memory:
        return None
    return (
        f"{what} needs {per_gpu:.0f} GiB per GPU over {gpus} GPU{'s' if gpus > 1 else ''}, more than "
        f"{WEIGHT_FRACTION:.0%} of the {memory:g} GiB of {product}"
    )


def pool_memory_problem(
    parameters_billions: float,
    weight_precision: str,
    gpu_type: str,
    gpus_per_replica: int,
    gpu_products: Sequence[str] | None,
) -> str | None:
    """Why one replica's GPUs cannot hold the weights at the pool's precision, or None."""
    gpu = GPU_TABLE[gpu_type]
    if gpu.emulated or gpus_per_replica == 0:
        return None
    need = parameters_billions * 1e9 * BYTES_PER_PARAMETER[weight_precision] / GIB
    what = f"a {parameters_billions:g}B-parameter model in {weight_precision}"
    problem = fit_problem(need, gpus_per_replica, gpu_products or gpu.gfd_products, gpu_type, what)
    if problem is None:
        return None
    return (
        f"{problem}; raise gpusPerReplica (tensor parallelism) or list larger GPUs in scheduling.gpuProducts"
    )


def trainer_memory_problem(
    parameters_billions: float, gpu_type: str, gpus: int, gpu_products: Sequence[str] | None
) -> str | None:
    """Why the trainer's GPUs together cannot hold weights, gradients and optimizer state, or None."""
    gpu = GPU_TABLE[gpu_type]
    if gpu.emulated or gpus == 0:
        return None
    need = parameters_billions * 1e9 * TRAINING_BYTES_PER_PARAMETER / GIB
    what = f"training a {parameters_billions:g}B-parameter model (BF16 weights, gradients, AdamW state)"
    problem = fit_problem(need, gpus, gpu_products or gpu.gfd_products, gpu_type, what)
    return None if problem is None else f"{problem}; add GPUs per node or nodes"
