"""The in-process sampler: batching against one-by-one, stop tokens and the budget.

Its sampling step is the engine's (tests/engine/test_sampling.py checks it against float64 references).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from mixrl.rl.rollout.local_sampler import LocalSampler
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model

from .conftest import TOKENIZER


def reference_logq(row: list[float], temperature: float) -> list[float]:
    scaled = [z / temperature for z in row]
    top = max(scaled)
    log_norm = top + math.log(sum(math.exp(z - top) for z in scaled))
    return [z - log_norm for z in scaled]


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
        # greedy decoding samples from S = {the top token}
        assert all(r.support_size == 1 and r.cand_ids[0] == r.token_id for r in batched.records)
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


async def test_a_cancelled_request_leaves_the_others_running(tiny_model: torch.nn.Module) -> None:
    """An episode cancelled mid-turn (its task group failed, a timeout) cancels its request's
    future; finishing that request must not fail every other request of the batch."""
    prompt = TOKENIZER.prompt_ids("what is port in net ?")
    async with LocalSampler(tiny_model, [], temperature=0.0, num_candidates=3) as sampler:
        gone = asyncio.create_task(sampler.generate(prompt, 1))
        kept = asyncio.create_task(sampler.generate(prompt, 4))
        await asyncio.sleep(0)  # both requests are in; the driver has not stepped yet
        gone.cancel()
        result = await kept
        assert (len(result.records), result.finish_reason) == (4, "length")
        assert gone.cancelled()
