"""Every pool precision through the engine's HTTP app: exact against a hand-prepared model, and its KL to bf16.

The servers run inside the test process (same app as `mixrl engine`, without a child process's
start-up cost); test_server.py and test_weight_updates.py cover the command line and the process.
The KL table is printed (``pytest -s``) and recorded in docs/engine.md.
"""

from __future__ import annotations

import math

import pytest
import torch

from mixrl.rl.engine.client import EngineClient

from .conftest import VOCAB, random_prompts, reference_logprobs, reference_model, serve_in_process

# name -> (model, weight precision, kv-cache dtype)
SETUPS = {
    "bf16": ("dense", "bf16", "bf16"),
    "fp8": ("dense", "fp8", "bf16"),
    "fp8_channel": ("dense", "fp8_channel", "bf16"),
    "mxfp4": ("dense", "mxfp4", "bf16"),
    "nvfp4": ("dense", "nvfp4", "bf16"),
    "bf16+fp8kv": ("dense", "bf16", "fp8"),
    "moe-nvfp4": ("moe", "nvfp4", "bf16"),
}


SERVING_KERNELS = {"dtype": "bfloat16", "attention_backend": "split_kv"}
"""A BF16 pool that differs from its trainer by kernels (BF16 activations, split-KV attention), as
a real one does: the homogeneous fleet of the stability study."""


def _config(name: str, dense_path: str, moe_path: str) -> dict[str, object]:
    if name == "bf16-kernels":
        return {"model_path": dense_path, "pool": name, **SERVING_KERNELS}
    model, weights, kv = SETUPS[name]
    path = dense_path if model == "dense" else moe_path
    return {"model_path": path, "weight_precision": weights, "kv_cache_dtype": kv, "pool": name}


async def _full_distributions(url: str, prompts: list[list[int]]) -> torch.Tensor:
    """The engine's next-token log-probs over the whole vocabulary after each prompt [N, V]."""
    async with EngineClient(url) as client:
        results = await client.generate_batch(
            prompts, max_new_tokens=1, temperature=1.0, top_logprobs_num=VOCAB
        )
    out = torch.empty(len(prompts), VOCAB, dtype=torch.float64)
    for i, result in enumerate(results):
        record = result.records[0]
        out[i, record.cand_ids] = torch.tensor(record.cand_logprobs, dtype=torch.float64)
    return out


PROMPTS = random_prompts(24, seed=20, low=4, high=24)


@pytest.mark.parametrize("name", list(SETUPS))
async def test_engine_equals_hand_prepared_model_at_its_precision(
    name: str, dense_path: str, moe_path: str
) -> None:
    model_kind, weights, kv = SETUPS[name]
    model = reference_model(dense_path if model_kind == "dense" else moe_path, weights)
    async with serve_in_process(**_config(name, dense_path, moe_path)) as (url, _):
        served = await _full_distributions(url, PROMPTS[:8])
        async with EngineClient(url) as client:
            result = await client.generate(PROMPTS[0], max_new_tokens=12, temperature=0.0)
    tolerance = 5e-3 if kv == "fp8" else 2e-4  # see test_runner.LOGPROB_ABS
    for i, prompt in enumerate(PROMPTS[:8]):
        ref = reference_logprobs(model, prompt, [0], fp8_kv=kv == "fp8")[0]  # next token after prompt
        assert torch.allclose(served[i], ref, atol=tolerance, rtol=0), (name, i)
    # greedy decoding through the KV cache agrees with the plain forward too
    ref = reference_logprobs(model, PROMPTS[0], result.output_ids, fp8_kv=kv == "fp8")
    for t, record in enumerate(result.records):
        assert ref[t, record.token_id] >= ref[t].max() - tolerance
        assert record.logprob == pytest.approx(ref[t, record.token_id].item(), abs=tolerance)


async def test_each_precision_moves_the_distribution_a_bounded_amount(dense_path: str, moe_path: str) -> None:
    dense = [name for name, (kind, _, _) in SETUPS.items() if kind == "dense"] + ["bf16-kernels"]
    dists = {}
    for name in dense:
        async with serve_in_process(**_config(name, dense_path, moe_path)) as (url, _):
            dists[name] = await _full_distributions(url, PROMPTS)
    base = dists["bf16"]
    kl = {}
    for name in dense:
        per_token = (base.exp() * (base - dists[name])).sum(dim=-1)
        kl[name] = float(per_token.mean())
    print("\nper-token KL(bf16 || precision), tiny Qwen3, 24 positions:")
    for name, value in kl.items():
        print(f"  {name:<12} {value:.3e}")
    assert kl["bf16"] == 0.0
    for name in dense:
        if name != "bf16":
            assert 1e-5 < kl[name] < 0.3, (name, kl[name])  # measurable, bounded
    # coarser formats move the distribution more
    assert kl["fp8"] < kl["nvfp4"] and kl["fp8"] < kl["mxfp4"]
    assert kl["fp8_channel"] < kl["nvfp4"]
    # a BF16 pool on serving kernels differs from the trainer measurably, and less than any quantized pool
    assert kl["bf16-kernels"] < min(kl[name] for name in ("fp8", "fp8_channel", "mxfp4", "nvfp4"))
    assert all(math.isfinite(v) for v in kl.values())
