"""Every SGLang command line the operator generates passes the pinned SGLang's own argument parser.

The lines come from the operator's real builders (the engine container of every SGLang pool's
Deployment), for every pool of every example and for each precision × KV-cache option under each
kind of sampling rule; the judge is ``sglang.srt.server_args`` of the release the image pins.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixrl.api.errors import InvalidSpec
from mixrl.api.loader import parse_document, read_documents
from mixrl.api.models import RLRun
from mixrl.api.resolve import SGLANG_IMAGE, SGLANG_VERSION, ResolvedRun, resolve
from mixrl.operator.builders.objects import BuildOptions, Images, Owner
from mixrl.operator.builders.pools import pool_children
from mixrl.operator.builders.resources import seed_replicas

from .conftest import SGLangParser

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
LAUNCHER = ["python3", "-m", "sglang.launch_server"]

PRECISIONS = ("bf16", "fp8", "nvfp4", "mxfp4")
KV_CACHE = ("bf16", "fp8")
SAMPLING: dict[str, dict[str, Any]] = {
    "full softmax": {},
    "top-p and top-k (mask)": {"topP": {"p": 0.95, "k": 256}, "topCandidates": 20},
    "top-k only, small": {"topP": {"p": 1.0, "k": 8}, "topCandidates": 4},
    "top-k 1": {"topP": {"p": 1.0, "k": 1}, "topCandidates": 1},
}


def sglang_lines(resolved: ResolvedRun) -> dict[str, list[str]]:
    """Pool name -> the SGLang arguments of its engine container, as the operator builds it."""
    options = BuildOptions()
    lines = {}
    for pool in resolved.pools:
        if pool.engine != "sglang":
            continue
        owner = Owner("mixrl.dev/v1alpha1", "SamplerPool", pool.object_name, "p")
        for obj in pool_children(resolved, pool, seed_replicas(pool), owner, options):
            if obj["kind"] not in ("Deployment", "StatefulSet"):
                continue
            for container in obj["spec"]["template"]["spec"]["containers"]:
                if container["name"] == "engine":
                    command = container["command"]
                    assert command[: len(LAUNCHER)] == LAUNCHER, command
                    lines[pool.name] = command[len(LAUNCHER) :]
    return lines


def example_lines() -> dict[str, list[str]]:
    lines = {}
    for path in EXAMPLES:
        for doc in read_documents(path):
            run = parse_document(doc.data)
            if isinstance(run, RLRun):
                for pool, line in sglang_lines(resolve(run)).items():
                    lines[f"{path.name}:{run.metadata.name}/{pool}"] = line
    return lines


def variant_run(algorithm: dict[str, Any]) -> RLRun:
    """One B200 SGLang pool per precision × KV-cache option (B200 runs every precision)."""
    pools = [
        {"name": f"{precision}-kv{kv}", "gpuType": "B200", "weightPrecision": precision, "kvCacheDtype": kv}
        for precision in PRECISIONS
        for kv in KV_CACHE
    ]
    manifest = {
        "apiVersion": "mixrl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "variants", "namespace": "rl"},
        "spec": {
            "model": {"path": "/weights/base/qwen3-8b", "maxContextTokens": 40960},
            "trainer": {"gpuType": "H200", "nodes": 1, "gpusPerNode": 8},
            "samplerPools": pools,
            "algorithm": copy.deepcopy(algorithm),
            "weights": {"store": "file:///weights", "volumeSize": "100Gi"},
        },
    }
    run = parse_document(manifest)
    assert isinstance(run, RLRun)
    return run


def variant_lines() -> dict[str, list[str]]:
    lines = {}
    for sampling, algorithm in SAMPLING.items():
        for pool, line in sglang_lines(resolve(variant_run(algorithm))).items():
            lines[f"{sampling}/{pool}"] = line
    return lines


def test_the_examples_have_sglang_pools_to_check() -> None:
    # A guard: if the examples lost their SGLang pools, the parser test below would check nothing.
    assert len(example_lines()) >= 8


def test_every_generated_sglang_command_line_passes_sglangs_own_parser(sglang_parser: SGLangParser) -> None:
    lines = {**example_lines(), **variant_lines()}
    assert len(lines) == len(SAMPLING) * len(PRECISIONS) * len(KV_CACHE) + len(example_lines())
    version, results = sglang_parser.check(list(lines.values()))
    refused = {name: why for name, why in zip(lines, results, strict=True) if why is not None}
    assert not refused, f"SGLang {version} refuses:\n" + json.dumps(refused, indent=1)
    assert version == SGLANG_VERSION


def test_the_parser_is_a_real_judge(sglang_parser: SGLangParser) -> None:
    # The same parser refuses what the pinned release does not know, and a bad choice.
    good = next(iter(variant_lines().values()))
    _, results = sglang_parser.check(
        [good, [*good, "--no-such-flag"], [*good, "--kv-cache-dtype", "int3"], ["--tp-size", "2"]]
    )
    assert results[0] is None
    assert results[1] is not None and "--no-such-flag" in results[1]
    assert results[2] is not None and "int3" in results[2]
    assert results[3] is not None and "--model-path" in results[3]


@pytest.mark.parametrize(
    ("name", "mask_limit"), [("top-p and top-k (mask)", 512), ("top-k only, small", 16), ("top-k 1", 2)]
)
def test_the_mask_limit_stays_above_top_k(name: str, mask_limit: int) -> None:
    resolved = resolve(variant_run(SAMPLING[name]))
    for line in sglang_lines(resolved).values():
        assert int(line[line.index("--sampling-mask-max-tokens") + 1]) == mask_limit
        assert mask_limit > max(resolved.sampling.top_k, 1)


def test_launch_flags_carry_the_spec(sglang_parser: SGLangParser) -> None:
    lines = variant_lines()
    for name, line in lines.items():
        assert line[line.index("--context-length") + 1] == "40960", name
        assert "--skip-tokenizer-init" in line, name
        if name.startswith("full softmax"):
            # No mask asked for: SGLang's own default limit stays.
            assert "--sampling-mask-max-tokens" not in line, name
        kv = line[line.index("--kv-cache-dtype") + 1]
        assert kv == ("fp8_e4m3" if name.endswith("kvfp8") else "auto"), name


def test_top_p_without_top_k_is_refused_on_sglang_pools() -> None:
    # SGLang returns no mask without a finite top-k (it aborts the request): refused in one line.
    with pytest.raises(InvalidSpec) as refused:
        variant_run({"topP": {"p": 0.9}})
    assert [str(problem) for problem in refused.value.problems] == [
        "spec.algorithm.topP.k: top-p below 1 needs a positive k on SGLang pools: SGLang returns the"
        " sampling support only under a finite top-k and aborts the request otherwise (or run every"
        " pool on the torch engine)"
    ]


def kubelet_expanded(command: list[str], env: dict[str, str]) -> list[str]:
    """``$(NAME)`` references replaced as the kubelet does from the container's environment."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg) for arg in command]


def test_a_replica_across_nodes_launches_with_flags_sglangs_parser_accepts(
    sglang_parser: SGLangParser,
) -> None:
    # A 16-GPU H100 replica is a LeaderWorkerSet group of two 8-GPU nodes; each pod's command names
    # the variables LWS's pod webhook sets (tests/cluster/test_multinode_pool.py sees it set them).
    run = variant_run({})
    manifest = run.model_dump(mode="json", by_alias=True, exclude_none=True)
    manifest["spec"]["samplerPools"] = [
        {"name": "h100-tp16", "gpuType": "H100", "weightPrecision": "fp8", "gpusPerReplica": 16}
    ]
    wide = parse_document(manifest)
    assert isinstance(wide, RLRun)
    resolved = resolve(wide)
    (pool,) = resolved.pools
    owner = Owner("mixrl.dev/v1alpha1", "SamplerPool", pool.object_name, "p")
    (lws,) = [
        obj
        for obj in pool_children(resolved, pool, 1, owner, BuildOptions())
        if obj["kind"] == "LeaderWorkerSet"
    ]
    template = lws["spec"]["leaderWorkerTemplate"]
    leader_address = f"{lws['metadata']['name']}-0.{lws['metadata']['name']}.rl"
    lines = {}
    for member, index in (("leaderTemplate", "0"), ("workerTemplate", "1")):
        (engine,) = [c for c in template[member]["spec"]["containers"] if c["name"] == "engine"]
        env = {"LWS_WORKER_INDEX": index, "LWS_LEADER_ADDRESS": leader_address, "MIXRL_AUTH_TOKEN": "t"}
        command = kubelet_expanded(engine["command"], env)
        assert command[: len(LAUNCHER)] == LAUNCHER
        lines[member] = command[len(LAUNCHER) :]
        flags = dict(itertools.pairwise(lines[member]))
        assert (flags["--nnodes"], flags["--node-rank"], flags["--tp-size"]) == ("2", index, "16")
        assert flags["--dist-init-addr"] == f"{leader_address}:20000"
    version, results = sglang_parser.check(list(lines.values()))
    assert results == [None, None], f"SGLang {version} refuses: {results}"
    # Unexpanded, the rank is no integer: the kubelet's expansion is what makes the line valid.
    _, unexpanded = sglang_parser.check([[*lines["workerTemplate"], "--node-rank", "$(LWS_WORKER_INDEX)"]])
    assert unexpanded[0] is not None and "--node-rank" in unexpanded[0]


def pinned_tag(image: str) -> str:
    return image.rsplit(":", 1)[1]


def test_the_pinned_image_and_the_tested_package_are_one_release(sglang_parser: SGLangParser) -> None:
    version, _ = sglang_parser.check([])
    assert pinned_tag(SGLANG_IMAGE) == f"v{version}", (SGLANG_IMAGE, version)
    assert Images().sglang == SGLANG_IMAGE
    values = yaml.safe_load((ROOT / "charts" / "mixrl" / "values.yaml").read_text())
    chart = values["engineImages"]["sglang"]
    assert f"{chart['repository']}:{chart['tag']}" == SGLANG_IMAGE
    dockerfile = (ROOT / "images" / "sglang" / "Dockerfile").read_text()
    assert f"ARG SGLANG_IMAGE={SGLANG_IMAGE}\n" in dockerfile


def test_the_mask_limit_rule() -> None:
    from mixrl.api.sampling import SamplingRule

    assert SamplingRule(top_p=0.9, top_k=256).mask_limit() == 512
    assert SamplingRule(temperature=0.0).mask_limit() == 2  # greedy: |S| = 1
    assert SamplingRule(top_p=0.9).mask_limit() is None  # no finite top-k: SGLang returns no mask
