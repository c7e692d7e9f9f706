"""The in-process sampler: each record against a plain float64 reference, and batching against one-by-one."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from mixrl.rl.models import create_tiny_checkpoint, load_model
from mixrl.rl.rollout.local_sampler import LocalSampler, sample_tokens

from .conftest import TOKENIZER


def reference_logq(row: list[float], temperature: float) -> list[float]:
    scaled = [z / temperature for z in row]
    top = max(scaled)
    log_norm = top + math.log(sum(math.exp(z - top) for z in scaled))
    return [z - log_norm for z in scaled]


def reference_support(logq: list[float], top_p: float, top_k: int) -> list[int]:
    order = sorted(range(len(logq)), key=lambda i: -logq[i])
    if top_k > 0:
        order = order[:top_k]
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += math.exp(logq[i])
    return kept


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 1.0, -1), (0.7, 0.8, -1), (1.3, 0.95, 5)])
def test_records_match_a_float64_reference(temperature: float, top_p: float, top_k: int) -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 3
    sampled = sample_tokens(
        logits, temperature, top_p, top_k, num_candidates=4, generator=torch.Generator().manual_seed(2)
    )
    truncates = top_p < 1.0 or top_k > 0
    for row, token in zip(logits.double().tolist(), sampled, strict=True):
        logq = reference_logq(row, temperature)
        assert token.logprob == pytest.approx(logq[token.token_id], abs=1e-12)
        support = reference_support(logq, top_p, top_k) if truncates else []
        assert token.support_size == len(support)
        expected = sorted(range(len(logq)), key=lambda i: -logq[i])[: max(4, len(support))]
        assert token.cand_ids == expected
        assert token.cand_logprobs == pytest.approx([logq[i] for i in expected], abs=1e-12)
        if truncates:
            assert token.token_id in support and token.cand_ids[: len(support)] == support


def test_sampling_follows_the_renormalized_support() -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]]).repeat(20000, 1)
    draws = sample_tokens(logits, 1.0, 0.8, -1, generator=torch.Generator().manual_seed(0))
    logq = reference_logq(logits[0].double().tolist(), 1.0)
    support = reference_support(logq, 0.8, -1)
    mass = sum(math.exp(logq[i]) for i in support)
    counts = [sum(1 for d in draws if d.token_id == i) for i in range(6)]
    for i in range(6):
        expected = math.exp(logq[i]) / mass if i in support else 0.0
        assert counts[i] / len(draws) == pytest.approx(expected, abs=0.015)


def test_temperature_zero_is_greedy() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(3))
    for row, token in zip(logits, sample_tokens(logits, 0.0, num_candidates=2), strict=True):
        assert token.token_id == int(row.argmax()) and token.support_size == 0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    path = create_tiny_checkpoint(
        Path(tmp_path_factory.mktemp("tiny")) / "m", "qwen3", TOKENIZER.vocab_size, seed=4
    )
    return load_model(path)


async def test_batched_generation_equals_one_by_one(tiny_model: torch.nn.Module) -> None:
    prompts = [
        TOKENIZER.prompt_ids(q)
        for q in ("what is port in net ?", "what is user in db ?", "what is rate in ui ?")
    ]
    prompts.append(prompts[0] + TOKENIZER.encode("ls") + TOKENIZER.observation_ids("tool", "db.ini net.cfg"))
    async with LocalSampler(
        tiny_model, TOKENIZER.stop_token_ids, temperature=0.0, num_candidates=3
    ) as sampler:
        together = await asyncio.gather(*[sampler.generate(p, 6) for p in prompts])
        assert sampler.forward_passes <= 6  # one pass per step for the whole batch
    for prompt, batched in zip(prompts, together, strict=True):
        async with LocalSampler(
            tiny_model, TOKENIZER.stop_token_ids, temperature=0.0, num_candidates=3
        ) as alone:
            single = await alone.generate(prompt, 6)
        assert [r.token_id for r in batched.records] == [r.token_id for r in single.records]
        assert batched.finish_reason == single.finish_reason
        # each record's log q against a float64 forward of the unpadded sequence
        context = list(prompt)
        for record in batched.records:
            with torch.no_grad():
                logits = tiny_model(input_ids=torch.tensor([context])).logits[0, -1].double().tolist()
            assert record.logprob == pytest.approx(reference_logq(logits, 1.0)[record.token_id], abs=1e-4)
            context.append(record.token_id)


async def test_stop_tokens_and_budget(tiny_model: torch.nn.Module) -> None:
    prompt = TOKENIZER.prompt_ids("what is port in net ?")
    async with LocalSampler(tiny_model, [], temperature=1.0, seed=5) as sampler:
        result = await sampler.generate(prompt, 7)
    assert (len(result.records), result.finish_reason) == (7, "length")
    first = result.records[0].token_id
    async with LocalSampler(tiny_model, [first], temperature=1.0, seed=5) as sampler:
        stopped = await sampler.generate(prompt, 7)
    assert [r.token_id for r in stopped.records] == [first] and stopped.finish_reason == "stop"
    async with LocalSampler(tiny_model, [], temperature=1.0) as sampler:
        with pytest.raises(ValueError, match="max_new_tokens: must be positive, got 0"):
            await sampler.generate(prompt, 0)
