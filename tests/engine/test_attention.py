"""The engine's attention (``mixrl_sdpa``): transformers' SDPA without the per-head copy, same bits.

Real: the tiny transformers Qwen3 models (dense and MoE, grouped-query: 4 query heads on 2 key and
value heads), the runner.  The reference is the same model on transformers' own ``sdpa``.
"""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from mixrl.rl.engine.attention import (
    ENGINE_ATTENTION,
    SPLIT_KV_ATTENTION,
    SPLIT_KV_CHUNK,
    split_kv_attention_forward,
    use_engine_attention,
)
from mixrl.rl.engine.runner import ModelRunner, Sequence
from mixrl.rl.engine.sampling import RowSampling

from .conftest import random_prompts, reference_model


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logits_are_bit_identical_to_transformers_sdpa(kind: str, dense_path: str, moe_path: str) -> None:
    path = dense_path if kind == "dense" else moe_path
    plain, engine = reference_model(path), reference_model(path)
    assert plain.config._attn_implementation == "sdpa" and plain.config.num_key_value_heads < (
        plain.config.num_attention_heads
    )
    use_engine_attention(engine)
    assert engine.config._attn_implementation == ENGINE_ATTENTION
    ids = torch.randint(1, 200, (3, 24), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 24, dtype=torch.bool)
    mask[0, :9] = False  # left padding: the masked path
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    with torch.inference_mode():
        for kwargs in (
            {"attention_mask": mask, "position_ids": positions},
            {"attention_mask": torch.ones(3, 24, dtype=torch.bool)},  # no padding: the causal path
        ):
            assert torch.equal(plain(input_ids=ids, **kwargs).logits, engine(input_ids=ids, **kwargs).logits)


def test_a_prefill_on_a_cached_prefix_does_not_repeat_the_keys_and_values(
    dense_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' ``repeat_kv`` copies the whole cache per layer before a masked prefill; the
    engine's prefills (cached prefix or not) never call it, and decode steps never did."""
    model = reference_model(dense_path)
    runner = ModelRunner(
        model,
        weight_version=0,
        context_length=512,
        kv_scales=[None] * model.config.num_hidden_layers,
        prefix_cache_tokens=10_000,
    )
    called: list[int] = []
    original = hf_sdpa.repeat_kv

    def counting(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
        called.append(n_rep)
        return original(hidden, n_rep)

    monkeypatch.setattr(hf_sdpa, "repeat_kv", counting)
    prompts = random_prompts(3, seed=5, low=10, high=20)
    first = [
        Sequence(rid=str(i), prompt_ids=p, sampling=RowSampling(temperature=0.0), max_new_tokens=4)
        for i, p in enumerate(prompts)
    ]
    runner.add(first)
    while runner.running:
        runner.step()
    second = [
        Sequence(
            rid=f"b{i}",
            prompt_ids=[*s.prompt_ids, *s.output_ids, 7, 8, 9],
            sampling=RowSampling(temperature=0.0),
            max_new_tokens=4,
        )
        for i, s in enumerate(first)
    ]
    runner.add(second)
    while runner.running:
        runner.step()
    assert all(s.cached_tokens > 0 for s in second)
    assert called == []
    # the reference: transformers' own sdpa does copy (so the check above can fail)
    plain = reference_model(dense_path)
    with torch.inference_mode():
        plain(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[False, True, True]]))
    assert called


def test_an_unpadded_decode_step_packs_the_query_heads(
    dense_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without padding transformers hands SDPA the grouping (``enable_gqa``, slower on the CPU); the
    engine packs a key-value head's query heads as its queries, as transformers does with a mask."""
    plain, engine = reference_model(dense_path), reference_model(dense_path)
    use_engine_attention(engine)
    config = plain.config
    ids = torch.randint(1, 200, (3, 12), generator=torch.Generator().manual_seed(8))
    shapes: list[tuple[int, ...]] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        shapes.append(tuple(query.shape))
        return original(query, *args, **kwargs)

    logits = []
    with torch.inference_mode():
        for model in (plain, engine):
            out = model(input_ids=ids[:, :-1], use_cache=True)
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
            step = model(input_ids=ids[:, -1:], cache=out.cache, use_cache=True)
            monkeypatch.undo()
            logits.append(step.logits)
    groups = config.num_attention_heads // config.num_key_value_heads
    layers = config.num_hidden_layers
    assert shapes[:layers] == [(3, config.num_attention_heads, 1, config.head_dim)] * layers  # transformers
    assert shapes[layers:] == [(3, config.num_key_value_heads, groups, config.head_dim)] * layers  # packed
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


def _grouped_module() -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_key_value_groups = 2  # type: ignore[assignment]
    return module


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_split_kv_attention_is_sdpa_in_another_order(q_len: int, padded: bool) -> None:
    g = torch.Generator().manual_seed(q_len)
    keys = SPLIT_KV_CHUNK * 2 + 22  # three splits, the last one partly padding
    query = torch.randn(2, 4, q_len, 16, generator=g)
    key, value = torch.randn(2, 2, keys, 16, generator=g), torch.randn(2, 2, keys, 16, generator=g)
    if padded:
        mask = torch.ones(2, 1, q_len, keys, dtype=torch.bool)
        mask[1, :, :, : SPLIT_KV_CHUNK + 3] = False  # a whole split and more masked out for one row
        reference = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, enable_gqa=True
        )
    else:  # causal over the last keys
        mask = None
        full = torch.ones(q_len, keys, dtype=torch.bool).tril(keys - q_len)
        reference = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=full, enable_gqa=True
        )
    out, _ = split_kv_attention_forward(_grouped_module(), query, key, value, mask, scaling=0.25)
    assert out.shape == (2, q_len, 4, 16)
    assert torch.allclose(out, reference.transpose(1, 2), atol=1e-6)
    bf16_out, _ = split_kv_attention_forward(
        _grouped_module(), query.bfloat16(), key.bfloat16(), value.bfloat16(), mask, scaling=0.25
    )
    bf16_ref = torch.nn.functional.scaled_dot_product_attention(
        query.bfloat16(),
        key.bfloat16(),
        value.bfloat16(),
        attn_mask=mask if padded else full,
        enable_gqa=True,
    ).transpose(1, 2)
    difference = (bf16_out.float() - bf16_ref.float()).abs()
    assert (
        bf16_out.dtype == torch.bfloat16 and 0 < float(difference.max()) < 0.05
    )  # another kernel's rounding


def test_a_split_kv_runner_decodes_through_the_lean_step(dense_path: str) -> None:
    model = reference_model(dense_path)
    runner = ModelRunner(
        model, weight_version=0, context_length=256, kv_scales=[None] * 2, attention_backend="split_kv"
    )
    assert model.config._attn_implementation == SPLIT_KV_ATTENTION and runner._lean_decode
    seq = Sequence("a", random_prompts(1, seed=3)[0], RowSampling(temperature=0.0), max_new_tokens=6)
    runner.add([seq])
    while runner.running:
        runner.step()
    assert len(seq.output_ids) == 6
    with pytest.raises(ValueError, match="attention backend: must be one of sdpa, split_kv"):
        use_engine_attention(model, "flashinfer")
