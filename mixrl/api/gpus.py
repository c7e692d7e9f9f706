"""The GPU capability table: the one place that knows what each accelerator can do.

Validation (which precisions a pool may use), the operator (node selection through the GPU Feature
Discovery label ``nvidia.com/gpu.product``) and the docs all read this table.  Facts from the paper
and NVIDIA's data sheets: A100 has no FP8 tensor cores, Hopper has FP8 but no FP4, Blackwell adds
FP4 (NVFP4 and MXFP4).
"""

from __future__ import annotations

from dataclasses import dataclass

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"

PRECISION_CORES: dict[str, str] = {"fp8": "FP8", "mxfp4": "FP4", "nvfp4": "FP4"}
"""Weight precision -> the tensor cores serving it needs (bf16 runs on every GPU)."""

# The wording of the two precision problems, used by precision_problem and (through
# mixrl.api.rules) by the API server's CEL rules, so `mixrl validate` and `kubectl apply` agree.
WEIGHTS_NEED_CORES = "{precision} needs {cores} tensor cores, which {gpu_type} lacks"
FP8_KV_CACHE_NEEDS_CORES = "an fp8 KV cache needs FP8 tensor cores, which {gpu_type} lacks"


@dataclass(frozen=True)
class GpuCapability:
    """What one GPU type offers to a sampler or trainer."""

    gpu_type: str
    architecture: str
    gfd_products: tuple[str, ...]
    """Values of ``nvidia.com/gpu.product`` that GPU Feature Discovery reports for this type."""
    fp8_tensor_cores: bool
    fp4_tensor_cores: bool
    memory_gib: int
    gpus_per_node: int = 8
    """GPUs in one node of this type: the 8 of an HGX/DGX board (every type here ships in 8-GPU
    servers).  A pool replica of more GPUs spans ``gpusPerReplica / gpus_per_node`` nodes (a
    LeaderWorkerSet, :func:`replica_nodes`)."""
    emulated: bool = False
    """True for ``cpu``: every precision is emulated in software, nothing is scheduled on a GPU."""

    def has_cores(self, cores: str) -> bool:
        """Whether this GPU has ``FP8`` or ``FP4`` tensor cores (an emulated one has everything)."""
        if self.emulated:
            return True
        if cores == "FP8":
            return self.fp8_tensor_cores
        if cores == "FP4":
            return self.fp4_tensor_cores
        raise ValueError(f"unknown tensor-core kind {cores!r}")

    def supports_weight_precision(self, precision: str) -> bool:
        if self.emulated or precision == "bf16":
            return True
        cores = PRECISION_CORES.get(precision)
        return cores is not None and self.has_cores(cores)


GPU_TABLE: dict[str, GpuCapability] = {
    gpu.gpu_type: gpu
    for gpu in (
        GpuCapability(
            "A100",
            "Ampere",
            (
                "NVIDIA-A100-SXM4-80GB",
                "NVIDIA-A100-SXM4-40GB",
                "NVIDIA-A100-80GB-PCIe",
                "NVIDIA-A100-PCIE-40GB",
            ),
            fp8_tensor_cores=False,
            fp4_tensor_cores=False,
            memory_gib=80,
        ),
        GpuCapability(
            "H100",
            "Hopper",
            ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL"),
            fp8_tensor_cores=True,
            fp4_tensor_cores=False,
            memory_gib=80,
        ),
        GpuCapability(
            "H200",
            "Hopper",
            ("NVIDIA-H200", "NVIDIA-H200-NVL"),
            fp8_tensor_cores=True,
            fp4_tensor_cores=False,
            memory_gib=141,
        ),
        GpuCapability(
            "B200",
            "Blackwell",
            ("NVIDIA-B200",),
            fp8_tensor_cores=True,
            fp4_tensor_cores=True,
            memory_gib=180,
        ),
        GpuCapability(
            "B300",
            "Blackwell Ultra",
            ("NVIDIA-B300-SXM6-AC", "NVIDIA-B300"),
            fp8_tensor_cores=True,
            fp4_tensor_cores=True,
            memory_gib=288,
        ),
        GpuCapability(
            "RTX-PRO-6000",
            "Blackwell",
            (
                "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
                "NVIDIA-RTX-PRO-6000-Blackwell-Workstation-Edition",
            ),
            fp8_tensor_cores=True,
            fp4_tensor_cores=True,
            memory_gib=96,
        ),
        GpuCapability(
            "cpu", "CPU (emulated precisions)", (), False, False, memory_gib=0, gpus_per_node=0, emulated=True
        ),
    )
}

GPU_TYPES: tuple[str, ...] = tuple(GPU_TABLE)


def default_gpus(gpu_type: str) -> int:
    """GPUs per pod where the spec names none (``samplerPools[].gpusPerReplica``): none on an
    emulated type, whose processes compute on CPUs, one on a GPU type."""
    return 0 if GPU_TABLE[gpu_type].emulated else 1


def requested_gpus(gpu_type: str, count: int) -> int:
    """The ``nvidia.com/gpu`` a pod of ``gpu_type`` requests for ``count`` GPUs: ``count`` on a GPU
    type, none on an emulated one whatever ``count`` says (there ``gpusPerNode`` counts trainer
    processes, and a CPU node has no GPU to give: the pod would stay Pending)."""
    return 0 if GPU_TABLE[gpu_type].emulated else count


def spans_nodes(gpu_type: str, gpus: int) -> bool:
    """Whether one replica of ``gpus`` GPUs of ``gpu_type`` needs more than one node."""
    gpu = GPU_TABLE[gpu_type]
    return not gpu.emulated and gpus > gpu.gpus_per_node


def replica_nodes(gpu_type: str, gpus: int) -> int:
    """The nodes one replica of ``gpus`` GPUs of ``gpu_type`` spans: 1 when they fit one node, else
    ``gpus / gpus_per_node`` (validation refuses a count that does not divide evenly:
    mixrl.api.rules.REPLICA_WHOLE_NODES)."""
    if not spans_nodes(gpu_type, gpus):
        return 1
    return gpus // GPU_TABLE[gpu_type].gpus_per_node


def precision_problem(gpu_type: str, weight_precision: str, kv_cache_dtype: str) -> str | None:
    """Why this GPU cannot serve this precision, or None when it can (one short sentence)."""
    gpu = GPU_TABLE[gpu_type]
    if not gpu.supports_weight_precision(weight_precision):
        cores = PRECISION_CORES.get(weight_precision, "FP8")
        return WEIGHTS_NEED_CORES.format(precision=weight_precision, cores=cores, gpu_type=gpu_type)
    if kv_cache_dtype == "fp8" and not gpu.has_cores("FP8"):
        return FP8_KV_CACHE_NEEDS_CORES.format(gpu_type=gpu_type)
    return None


def markdown_table() -> str:
    """The table as Markdown, for docs/gpus.md (kept in sync by a test)."""
    rows = [
        "| gpuType | architecture | FP8 | FP4 | memory (GiB) | GPUs per node | nvidia.com/gpu.product |",
        "|---|---|---|---|---|---|---|",
    ]
    for gpu in GPU_TABLE.values():
        products = ", ".join(f"`{p}`" for p in gpu.gfd_products) or "— (local, emulated)"
        rows.append(
            f"| `{gpu.gpu_type}` | {gpu.architecture} | {'yes' if gpu.fp8_tensor_cores else 'no'} "
            f"| {'yes' if gpu.fp4_tensor_cores else 'no'} | {gpu.memory_gib or '—'} "
            f"| {gpu.gpus_per_node or '—'} | {products} |"
        )
    return "\n".join(rows) + "\n"


# ----------------------------------------------------------------------------- default prices

DEFAULT_PRICES_DATE = "2026-12-01"
"""When :data:`DEFAULT_PRICE_PER_GPU_HOUR` was last set."""
DEFAULT_PRICE_PER_GPU_HOUR: dict[str, float] = {
    "A100": 1.2,
    "H100": 2.5,
    "H200": 3.5,
    "B200": 6.0,
    "B300": 8.0,
    "RTX-PRO-6000": 1.6,
    "cpu": 0.0,
}
"""Dollars per GPU-hour the autoscaler assumes for a pool without ``costPerGpuHour``: round
on-demand figures at the level of public neo-cloud list prices (the same ones
examples/rlrun-mixed.yaml states), not a quote from any provider — set ``costPerGpuHour`` to what
you pay.  Only the ratios between pools matter to the ordering (cheapest throughput first)."""


def default_price(gpu_type: str) -> float:
    """The assumed price of one GPU-hour of ``gpu_type`` (:data:`DEFAULT_PRICE_PER_GPU_HOUR`)."""
    return DEFAULT_PRICE_PER_GPU_HOUR[gpu_type]


def price_per_gpu_hour(gpu_type: str, cost_per_gpu_hour: float | None) -> float:
    """What one GPU-hour of a pool is billed at: its ``costPerGpuHour``, else
    :func:`default_price` of its GPU type (the autoscaling loop's fill and the simulator alike)."""
    return cost_per_gpu_hour if cost_per_gpu_hour is not None else default_price(gpu_type)
