"""The runner's decode step without transformers' per-step Python: the same bits as ``model(...)``.

Real: the tiny transformers Qwen3 models (dense and MoE), the runner and its KV cache.  The
reference is the same runner with the lean step switched off, i.e. ``model(...)`` for every step.
"""

from __future__ import annotations

import pytest
import torch

from mixrl.rl.engine.decode import supports_decode_step
from mixrl.rl.engine.runner import ModelRunner, Sequence
from mixrl.rl.engine.sampling import RowSampling

from .conftest import random_prompts, reference_model


def _runner(model: torch.nn.Module, fp8: bool, lean: bool) -> ModelRunner:
    runner = ModelRunner(
        model,
        weight_version=0,
        context_length=512,
        kv_scales=[(0.5, 2.0) if fp8 else None] * model.config.num_hidden_layers,
    )
    assert runner._lean_decode  # the dense Qwen3 takes it
    runner._lean_decode = lean
    return runner


def _play(runner: ModelRunner, prompts: list[list[int]], late: list[list[int]]) -> list[Sequence]:
    """``prompts`` admitted together, ``late`` joining the running batch after 3 steps."""
    sampling = RowSampling(temperature=1.0, top_k=50, num_candidates=4)

    def seqs(group: list[list[int]], tag: str) -> list[Sequence]:
        return [
            Sequence(
                rid=f"{tag}{i}",
                prompt_ids=prompt,
                sampling=sampling,
                max_new_tokens=8 + 2 * i,
                generator=torch.Generator().manual_seed(i + (100 if tag == "late" else 0)),
            )
            for i, prompt in enumerate(group)
        ]

    first, second = seqs(prompts, "first"), seqs(late, "late")
    runner.add(first)
    for _ in range(3):
        runner.step()
    runner.add(second)
    while runner.running:
        runner.step()
    return first + second


@pytest.mark.parametrize(
    ("fp8", "precision"),
    [(False, "bf16"), (True, "bf16"), (False, "nvfp4")],
    ids=["bf16-kv", "fp8-kv", "nvfp4-w4a4"],  # W4A4: input-quantizing linear layers
)
@pytest.mark.parametrize("padded", [False, True], ids=["same-lengths", "padded"])
def test_lean_decode_steps_give_the_same_bits_as_the_model(
    dense_path: str, fp8: bool, precision: str, padded: bool
) -> None:
    model = reference_model(dense_path, precision)
    if padded:  # rows of different lengths, and two more joining mid-way: the masked path
        prompts, late = random_prompts(3, seed=5, low=4, high=20), random_prompts(2, seed=6, low=2, high=30)
    else:  # one length, no padding ever: transformers passes SDPA no mask
        prompts, late = [p[:10] for p in random_prompts(3, seed=5, low=10, high=20)], []
    lean_runner = _runner(model, fp8, lean=True)
    forward_calls = 0
    original = model.forward

    def counting(*args: object, **kwargs: object) -> object:
        nonlocal forward_calls
        forward_calls += 1
        return original(*args, **kwargs)

    model.forward = counting  # type: ignore[method-assign]
    lean = _play(lean_runner, prompts, late)
    prefills = forward_calls
    plain = _play(_runner(model, fp8, lean=False), prompts, late)
    del model.forward
    assert prefills == (2 if late else 1)  # the decode steps did not go through model(...)
    assert forward_calls > 2 * prefills  # ... and without the lean step they do
    for a, b in zip(lean, plain, strict=True):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        for x, y in zip(a.tokens, b.tokens, strict=True):
            assert x.logprob == y.logprob and x.cand_logprobs == y.cand_logprobs  # bit-identical


def test_only_the_models_it_was_written_against_take_it(dense_path: str, moe_path: str) -> None:
    dense = reference_model(dense_path)
    assert supports_decode_step(dense)
    assert not supports_decode_step(reference_model(moe_path))  # another architecture
    dense.train()
    assert not supports_decode_step(dense)  # dropout would apply
    dense.eval()
    dense.set_attn_implementation("eager")
    assert not supports_decode_step(dense)  # not the attention it calls
    plain_linear = dense.model.layers[0].mlp.up_proj
    dense.set_attn_implementation("sdpa")
    assert supports_decode_step(dense)
    dense.model.layers[0].mlp.up_proj = torch.nn.Sequential(plain_linear)
    assert not supports_decode_step(dense)  # a linear that is not nn.Linear: F.linear would skip it
