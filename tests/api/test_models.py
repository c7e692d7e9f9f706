from __future__ import annotations

from typing import Any

import pytest
import yaml

from mixrl.api.errors import InvalidSpec
from mixrl.api.gpus import GPU_TABLE, precision_problem
from mixrl.api.loader import parse_document
from mixrl.api.models import RLRun
from mixrl.api.resolve import resolve


def problems(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(InvalidSpec) as info:
        parse_document(doc)
    return [str(p) for p in info.value.problems]


def test_paper_defaults(minimal_run: dict[str, Any]) -> None:
    run = parse_document(minimal_run)
    assert isinstance(run, RLRun)
    algorithm = run.spec.algorithm
    assert (algorithm.prompts_per_update, algorithm.samples_per_prompt) == (128, 8)
    assert algorithm.corrections.mis == (0.2, 5.0)
    assert algorithm.corrections.score_centering is True and algorithm.corrections.tis is None
    assert algorithm.top_p.mask_replay is True
    assert algorithm.temperature == 1.0
    assert algorithm.max_staleness is None
    assert run.spec.trainer.precision == "bf16"
    assert run.spec.rollout.format_error_limit == 3


@pytest.mark.parametrize(
    ("precision", "kv"),
    [("nvfp4", "fp8"), ("mxfp4", "fp8"), ("fp8", "fp8"), ("bf16", "bf16")],
)
def test_low_precision_pools_default_to_fp8_kv_cache(
    minimal_run: dict[str, Any], precision: str, kv: str
) -> None:
    minimal_run["spec"]["samplerPools"][0]["weightPrecision"] = precision
    resolved = resolve(parse_document(minimal_run))  # type: ignore[arg-type]
    assert resolved.pools[0].kv_cache_dtype == kv


def test_unique_pool_names(minimal_run: dict[str, Any]) -> None:
    pools = minimal_run["spec"]["samplerPools"]
    pools.append(dict(pools[0]))
    assert problems(minimal_run) == ["spec.samplerPools[1].name: duplicate pool name 'b200'"]


def test_min_replicas_not_above_max(minimal_run: dict[str, Any]) -> None:
    minimal_run["spec"]["samplerPools"][0].update(minReplicas=3, maxReplicas=2)
    assert problems(minimal_run) == ["spec.samplerPools[0].minReplicas: 3 exceeds maxReplicas 2"]


def test_negative_replicas_rejected(minimal_run: dict[str, Any]) -> None:
    minimal_run["spec"]["samplerPools"][0].update(minReplicas=-1)
    [line] = problems(minimal_run)
    assert line.startswith("spec.samplerPools[0].minReplicas: ") and "greater than or equal to 0" in line


def test_a100_rejects_fp8_weights_and_fp8_kv_cache(minimal_run: dict[str, Any]) -> None:
    pool = minimal_run["spec"]["samplerPools"][0]
    pool.update(gpuType="A100", weightPrecision="fp8")
    assert problems(minimal_run) == [
        "spec.samplerPools[0].weightPrecision: fp8 needs FP8 tensor cores, which A100 lacks"
    ]
    pool.update(weightPrecision="bf16", kvCacheDtype="fp8")
    assert problems(minimal_run) == [
        "spec.samplerPools[0].kvCacheDtype: an fp8 KV cache needs FP8 tensor cores, which A100 lacks"
    ]


@pytest.mark.parametrize("gpu", ["A100", "H100", "H200"])
@pytest.mark.parametrize("precision", ["nvfp4", "mxfp4"])
def test_fp4_only_on_blackwell(minimal_run: dict[str, Any], gpu: str, precision: str) -> None:
    minimal_run["spec"]["samplerPools"][0].update(gpuType=gpu, weightPrecision=precision)
    assert problems(minimal_run) == [
        f"spec.samplerPools[0].weightPrecision: {precision} needs FP4 tensor cores, which {gpu} lacks"
    ]


def test_gpu_table_drives_the_rules() -> None:
    # Every combination the table allows passes, every one it forbids fails: validation has no
    # rule of its own beyond the table.
    for gpu in GPU_TABLE.values():
        for precision in ("bf16", "fp8", "mxfp4", "nvfp4"):
            expected_ok = (
                gpu.emulated
                or precision == "bf16"
                or (gpu.fp4_tensor_cores if precision.endswith("fp4") else gpu.fp8_tensor_cores)
            )
            assert (precision_problem(gpu.gpu_type, precision, "bf16") is None) == expected_ok
    assert {g for g, c in GPU_TABLE.items() if c.fp4_tensor_cores} == {"B200", "B300", "RTX-PRO-6000"}


@pytest.mark.parametrize("mis", [[0.0, 5.0], [1.0, 5.0], [0.2, 1.0], [0.5, 0.9], [-0.1, 2.0]])
def test_mis_range_must_bracket_one(minimal_run: dict[str, Any], mis: list[float]) -> None:
    minimal_run["spec"]["algorithm"] = {"corrections": {"mis": mis}}
    [line] = problems(minimal_run)
    assert line.startswith("spec.algorithm.corrections.mis: range") and "0 < lo < 1 < hi" in line


def test_mis_can_be_disabled(minimal_run: dict[str, Any]) -> None:
    minimal_run["spec"]["algorithm"] = {"corrections": {"mis": None, "scoreCentering": False}}
    run = parse_document(minimal_run)
    assert isinstance(run, RLRun) and run.spec.algorithm.corrections.mis is None


def test_at_least_one_pool(minimal_run: dict[str, Any]) -> None:
    minimal_run["spec"]["samplerPools"] = []
    [line] = problems(minimal_run)
    assert line.startswith("spec.samplerPools: ") and "at least 1" in line


@pytest.mark.parametrize("field", ["promptsPerUpdate", "samplesPerPrompt"])
@pytest.mark.parametrize("value", [0, -4])
def test_batch_sizes_positive(minimal_run: dict[str, Any], field: str, value: int) -> None:
    minimal_run["spec"]["algorithm"] = {field: value}
    [line] = problems(minimal_run)
    assert line.startswith(f"spec.algorithm.{field}: ") and "greater than 0" in line


def test_unknown_fields_are_errors(minimal_run: dict[str, Any]) -> None:
    minimal_run["spec"]["samplerPools"][0]["weightPrecison"] = "fp8"
    minimal_run["spec"]["algoritm"] = {}
    assert sorted(problems(minimal_run)) == [
        "spec.algoritm: unknown field (check the spelling; unknown fields are rejected)",
        "spec.samplerPools[0].weightPrecison: unknown field (check the spelling; unknown fields are rejected)",
    ]


def test_unknown_precision_and_gpu(minimal_run: dict[str, Any]) -> None:
    minimal_run["spec"]["samplerPools"][0].update(weightPrecision="int4", gpuType="V100")
    lines = problems(minimal_run)
    assert any(
        line.startswith("spec.samplerPools[0].weightPrecision: ") and "'int4'" in line for line in lines
    )
    assert any(line.startswith("spec.samplerPools[0].gpuType: unknown GPU type 'V100'") for line in lines)


def test_cpu_pools_need_the_torch_engine(minimal_run: dict[str, Any]) -> None:
    minimal_run["spec"]["samplerPools"][0].update(gpuType="cpu")
    assert problems(minimal_run) == [
        "spec.samplerPools[0].engine: sglang needs a GPU; use the torch engine for gpuType cpu"
    ]
    minimal_run["spec"]["samplerPools"][0]["engine"] = "torch"
    parse_document(minimal_run)


@pytest.mark.parametrize(
    ("gpu_type", "engine", "written", "gpus"),
    [("B200", "sglang", {}, 1), ("cpu", "torch", {}, 0), ("cpu", "torch", {"gpusPerReplica": None}, 0),
     ("B200", "sglang", {"gpusPerReplica": 4}, 4), ("cpu", "torch", {"gpusPerReplica": 2}, 2)],
)  # fmt: skip
def test_gpus_per_replica_defaults_by_gpu_type(
    minimal_run: dict[str, Any], gpu_type: str, engine: str, written: dict[str, Any], gpus: int
) -> None:
    """A cpu pool that says nothing asks for no GPU (it stayed Pending on a CPU node with the old
    default of 1); a GPU pool one, and what is written wins."""
    minimal_run["spec"]["samplerPools"][0].update(gpuType=gpu_type, engine=engine, **written)
    run = parse_document(minimal_run)
    assert isinstance(run, RLRun)
    assert run.spec.sampler_pools[0].gpus_per_replica == gpus
    assert resolve(run).pools[0].gpus_per_replica == gpus


def test_run_name_short_enough_for_children(minimal_run: dict[str, Any]) -> None:
    minimal_run["metadata"]["name"] = "r" * 31
    assert problems(minimal_run) == ["metadata.name: at most 30 characters (children are <run>-<pool>)"]


def test_tis_and_mis_are_exclusive(minimal_run: dict[str, Any]) -> None:
    minimal_run["spec"]["algorithm"] = {"corrections": {"tis": 2.0}}
    assert problems(minimal_run) == ["spec.algorithm.corrections.tis: choose one of mis and tis, not both"]


def test_pass_k_needs_enough_samples(minimal_run: dict[str, Any]) -> None:
    minimal_run["spec"]["evaluation"] = {"passK": [1, 4], "samplesPerTask": 2}
    assert problems(minimal_run) == ["spec.evaluation.samplesPerTask: 2 is below the largest passK 4"]


def test_yaml_round_trip(minimal_run: dict[str, Any]) -> None:
    run = parse_document(minimal_run)
    text = yaml.safe_dump(run.to_yaml_dict(), sort_keys=False)
    again = parse_document(yaml.safe_load(text))
    assert again == run
    # camelCase outside, as users write it
    assert "samplerPools" in text and "sampler_pools" not in text


def test_resolve_sampling_and_sglang_flags(minimal_run: dict[str, Any]) -> None:
    minimal_run["spec"]["algorithm"] = {"topP": {"p": 0.9, "k": 64}, "topCandidates": 8}
    resolved = resolve(parse_document(minimal_run))  # type: ignore[arg-type]
    # With a support to replay, K must cover the largest support (top-k).
    assert resolved.sampling.top_logprobs_num == 64 and resolved.sampling.return_sampling_mask
    assert resolved.trainer.corrections.topp_replay
    args = resolved.pools[0].engine_args
    assert args[args.index("--quantization") + 1] == "modelopt_fp4"
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert "--enable-metrics" in args
    assert resolved.pools[0].gpu_products == GPU_TABLE["B200"].gfd_products


def test_no_truncation_means_no_replay(minimal_run: dict[str, Any]) -> None:
    resolved = resolve(parse_document(minimal_run))  # type: ignore[arg-type]
    assert not resolved.sampling.return_sampling_mask and not resolved.trainer.corrections.topp_replay


def test_gpu_docs_match_the_table() -> None:
    from mixrl.api.gpus import markdown_table

    from .conftest import ROOT

    assert markdown_table() in (ROOT / "docs" / "gpus.md").read_text(), "docs/gpus.md is stale"


@pytest.mark.parametrize("name", ["trainer", "router", "rollout", "buffer", "config", "weights"])
def test_pool_names_of_components_are_reserved(minimal_run: dict[str, Any], name: str) -> None:
    minimal_run["spec"]["samplerPools"][0]["name"] = name
    assert problems(minimal_run) == [
        f"spec.samplerPools[0].name: {name!r} is reserved for the run's own {name} objects"
    ]


@pytest.mark.parametrize("name", ["run", "all"])
def test_pool_names_of_the_whole_runs_figures_are_reserved(minimal_run: dict[str, Any], name: str) -> None:
    minimal_run["spec"]["samplerPools"][0]["name"] = name
    assert problems(minimal_run) == [
        f"spec.samplerPools[0].name: {name!r} is reserved for the whole run's figures (metrics label pool"
        " 'all', collapse signs scope 'run')"
    ]
