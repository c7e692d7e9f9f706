"""The prefix cache: a session's next turn computes only its new tokens, with the same results.

Real: the runner on the tiny transformers Qwen3 model, the engine's HTTP app on loopback, the weight
store.  "Without the cache" is the same engine with ``prefix_cache_tokens=0`` (every prompt
prefilled whole), the reference the cache must not change.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
import torch

from mixrl.rl.engine.kv_cache import SHARED_PREFIX_MIN_TOKENS, PrefixCache, shared_prefixes
from mixrl.rl.engine.runner import ModelRunner, Sequence
from mixrl.rl.engine.sampling import RowSampling
from mixrl.rl.tiny_models import create_tiny_checkpoint
from mixrl.rl.weights import WeightStore

from .conftest import VOCAB, random_prompts, reference_logprobs, reference_model, serve_in_process

# Token ids, candidate ids, support sizes and finish reasons must be equal; log-probs equal up to
# float rounding: the cached keys and values of earlier output tokens were computed one decode step
# at a time, the uncached ones in one prefill, and float32 sums in another order differ by ~1e-6.
LOGPROB_ABS = 1e-5
SAMPLING = RowSampling(temperature=1.0, top_p=0.9, top_k=40, num_candidates=8, cover_support=True)


def _runner(model: torch.nn.Module, cache_tokens: int) -> ModelRunner:
    return ModelRunner(
        model,
        weight_version=0,
        context_length=4096,
        kv_scales=[None] * model.config.num_hidden_layers,
        prefix_cache_tokens=cache_tokens,
    )


def _kv(length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, length, 2), float(length)), torch.zeros(1, length, 2))]


def _finish(runner: ModelRunner, seqs: list[Sequence]) -> None:
    runner.add(seqs)
    while runner.running:
        runner.step()


def _sessions(runner: ModelRunner, count: int, turns: int, seed: int) -> list[list[Sequence]]:
    """``count`` sessions of ``turns`` turns, all sessions' turn t admitted in one batch.

    Turn t+1's prompt is turn t's prompt, its output and a few new "tool" tokens, as an agent sends it.
    """
    histories = random_prompts(count, seed=seed, low=6, high=30)
    played: list[list[Sequence]] = [[] for _ in range(count)]
    for turn in range(turns):
        seqs = [
            Sequence(
                rid=f"s{i}t{turn}",
                prompt_ids=list(history),
                sampling=SAMPLING,
                max_new_tokens=6 + 3 * i,
                generator=torch.Generator().manual_seed(1000 * i + turn),
            )
            for i, history in enumerate(histories)
        ]
        _finish(runner, seqs)
        tools = random_prompts(count, seed=seed * 100 + turn, low=1, high=9)
        for i, seq in enumerate(seqs):
            played[i].append(seq)
            histories[i] = histories[i] + seq.output_ids + tools[i]
    return played


def _assert_same(cached: Sequence, plain: Sequence) -> None:
    assert cached.output_ids == plain.output_ids
    assert cached.finish_reason == plain.finish_reason
    for a, b in zip(cached.tokens, plain.tokens, strict=True):
        assert a.cand_ids == b.cand_ids
        assert a.support_size == b.support_size
        assert a.logprob == pytest.approx(b.logprob, abs=LOGPROB_ABS)
        assert a.cand_logprobs == pytest.approx(b.cand_logprobs, abs=LOGPROB_ABS)


# ------------------------------------------------------------------ the cache itself


def test_match_is_the_longest_common_prefix_and_leaves_one_token_to_compute() -> None:
    cache = PrefixCache(max_tokens=100)
    cache.insert([1, 2, 3, 4], _kv(4))
    cache.insert([1, 2, 9], _kv(3))
    assert cache.match([1, 2, 3, 4, 5, 6])[0] == 4
    assert cache.match([1, 2, 9, 7])[0] == 3
    assert cache.match([1, 2, 3, 4])[0] == 3  # the last prompt token is computed, for its logits
    assert cache.match([5, 1, 2])[0] == 0
    length, kv = cache.match([1, 2, 3, 8])
    assert length == 3 and kv[0][0].shape == (1, 3, 2) and float(kv[0][0][0, 0, 0]) == 4.0


def test_a_newer_turn_supersedes_its_prefix_and_lru_evicts_under_the_budget() -> None:
    cache = PrefixCache(max_tokens=10)
    cache.insert([1, 2, 3], _kv(3))
    cache.insert([1, 2, 3, 4, 5], _kv(5))  # the session's next turn: the first entry goes
    assert len(cache) == 1 and cache.held_tokens == 5
    cache.insert([1, 2], _kv(2))  # already inside the held entry
    assert len(cache) == 1
    cache.insert([7, 7, 7, 7], _kv(4))
    cache.match([1, 2, 3, 4, 5, 6])  # touch the session: the other entry is now least recent
    cache.insert([8, 8, 8], _kv(3))  # 12 > 10: evicts [7, 7, 7, 7]
    assert cache.held_tokens == 8
    assert cache.match([7, 7, 7, 7, 7])[0] == 0 and cache.match([1, 2, 3, 4, 5, 6])[0] == 5
    cache.insert(list(range(11)), _kv(11))  # larger than the whole budget: not kept
    assert cache.held_tokens == 8
    with pytest.raises(ValueError, match="max_tokens: must be >= 1"):
        PrefixCache(0)


# ------------------------------------------------------------------ the runner


def test_multi_turn_sessions_with_the_cache_equal_those_without(dense_path: str) -> None:
    model = reference_model(dense_path)
    with_cache = _runner(model, 100_000)
    cached = _sessions(with_cache, count=4, turns=4, seed=3)
    plain = _sessions(_runner(model, 0), count=4, turns=4, seed=3)
    for session_c, session_p in zip(cached, plain, strict=True):
        assert session_c[0].cached_tokens == 0
        for turn, (c, p) in enumerate(zip(session_c, session_p, strict=True)):
            _assert_same(c, p)
            assert p.cached_tokens == 0
            if turn:
                previous = session_c[turn - 1]
                # everything the previous turn fed the model: its prompt and all but its last token
                assert c.cached_tokens == len(previous.prompt_ids) + len(previous.tokens) - 1
            ref = reference_logprobs(model, c.prompt_ids, c.output_ids)
            for t, record in enumerate(c.tokens):
                assert record.logprob == pytest.approx(ref[t, record.token_id].item(), abs=2e-4)
    prompts = sum(len(s.prompt_ids) for session in cached for s in session)
    reused = sum(s.cached_tokens for session in cached for s in session)
    assert with_cache.prompt_tokens_total == prompts and with_cache.cached_tokens_total == reused
    assert reused > prompts / 2  # four turns: most of each prompt is history


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hits_of_different_lengths_and_a_miss_share_one_prefill(
    kind: str, dense_path: str, moe_path: str
) -> None:
    model = reference_model(dense_path if kind == "dense" else moe_path)
    runs = {}
    for budget in (100_000, 0):
        runner = _runner(model, budget)
        first = [
            Sequence(rid=str(i), prompt_ids=p, sampling=SAMPLING, max_new_tokens=4 + 5 * i)
            for i, p in enumerate(random_prompts(3, seed=8, low=3, high=25))
        ]
        for seq in first:
            seq.generator = torch.Generator().manual_seed(int(seq.rid))
            _finish(runner, [seq])
        fresh = random_prompts(1, seed=9, low=30, high=31)[0]
        second = [
            Sequence(
                rid=f"b{i}",
                prompt_ids=[*s.prompt_ids, *s.output_ids, *([5] * (1 + 7 * i))],
                sampling=SAMPLING,
                max_new_tokens=8,
                generator=torch.Generator().manual_seed(50 + i),
            )
            for i, s in enumerate(first)
        ] + [Sequence(rid="miss", prompt_ids=fresh, sampling=SAMPLING, max_new_tokens=8)]
        second[-1].generator = torch.Generator().manual_seed(99)
        _finish(runner, second)  # one prefill: three hits with gaps of different widths, one miss
        runs[budget] = second
    for c, p in zip(runs[100_000], runs[0], strict=True):
        _assert_same(c, p)
    assert [s.cached_tokens for s in runs[100_000]][-1] == 0
    assert all(s.cached_tokens > 0 for s in runs[100_000][:-1])


def test_shared_prefixes_are_those_of_sorted_neighbours_beyond_their_hits() -> None:
    system, a, b = list(range(1, 41)), [50] * 10, [60] * 10
    prompts = [system + a, system + b, system + a, [7] * 50]
    # two samples of one prompt share all of it but the last token; both share the system prompt with b
    assert shared_prefixes(prompts, [0, 0, 0, 0]) == [tuple(system), tuple(system + a[:-1])]
    # a hit that already covers the system prompt leaves only what lies beyond it (10 < 32 tokens)
    assert shared_prefixes(prompts, [40, 40, 40, 0]) == []
    assert shared_prefixes(prompts, [0, 0, 0, 0], min_tokens=45) == [tuple(system + a[:-1])]
    assert shared_prefixes([system], [0]) == [] and SHARED_PREFIX_MIN_TOKENS == 32


class _CountingModel(torch.nn.Module):
    """The model, counting the token positions each forward pass computes."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config, self.computed = model, model.config, 0

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs: object) -> object:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        assert isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor)
        self.computed += int(mask[:, -ids.shape[1] :].sum())  # the fed columns' real tokens
        return self.inner(**kwargs)


def test_prompts_admitted_together_compute_their_shared_prefix_once(dense_path: str) -> None:
    """Episodes with one system prompt, and samples of one prompt (a GRPO group), in one admission:
    the shared part is computed once, and the results equal those without the cache."""
    model = reference_model(dense_path)
    system = random_prompts(1, seed=21, low=48, high=49)[0]
    tasks = random_prompts(2, seed=22, low=6, high=7)
    prompts = [system + tasks[0], system + tasks[0], system + tasks[0], system + tasks[1]]
    runs, computed = {}, {}
    for budget in (100_000, 0):
        counting = _CountingModel(model)
        runner = _runner(counting, budget)  # type: ignore[arg-type]
        seqs = [
            Sequence(
                rid=str(i),
                prompt_ids=list(p),
                sampling=SAMPLING,
                max_new_tokens=5,
                generator=torch.Generator().manual_seed(70 + i),
            )
            for i, p in enumerate(prompts)
        ]
        runner.add(seqs)
        computed[budget] = counting.computed
        while runner.running:
            runner.step()
        runs[budget] = (seqs, runner)
    for c, p in zip(runs[100_000][0], runs[0][0], strict=True):
        _assert_same(c, p)
    # without the cache: 4 x 54 positions; with it: the system prompt once (48), then the first
    # prompt's own part once (5, one short of its end), then 1 + 1 + 1 + 6 for the four rows
    assert computed[0] == 4 * 54
    assert computed[100_000] == 48 + 5 + 9
    # the first row to reuse a prefix computed for the batch pays for it: cached counts only reuse
    seqs, runner = runs[100_000]
    assert [s.cached_tokens for s in seqs] == [0, 53, 53, 48]
    assert runner.cached_tokens_total == 154 and runner.prompt_tokens_total == 4 * 54


def test_weight_changes_invalidate_the_cache(dense_path: str, tmp_path: Path) -> None:
    model = reference_model(dense_path)
    other = reference_model(create_tiny_checkpoint(tmp_path / "v1", "qwen3", vocab_size=VOCAB, seed=7))
    runner = _runner(model, 100_000)
    prompt = random_prompts(1, seed=11, low=20, high=21)[0]
    turn1 = Sequence(rid="t1", prompt_ids=prompt, sampling=RowSampling(temperature=0.0), max_new_tokens=5)
    _finish(runner, [turn1])
    assert runner.prefix_cache_tokens() == len(prompt) + 4

    # a sequence running while the weights change is not cached: its keys mix both versions
    spanning = Sequence(
        rid="span", prompt_ids=[3, 4, 5, 6], sampling=RowSampling(temperature=0.0), max_new_tokens=6
    )
    runner.add([spanning])
    runner.step()
    model.load_state_dict(other.state_dict())
    runner.weight_version = 1  # what every weight update does
    assert runner.prefix_cache_tokens() == 0
    while runner.running:
        runner.step()
    assert runner.prefix_cache_tokens() == 0

    turn2_prompt = [*prompt, *turn1.output_ids, 9, 9]
    turn2 = Sequence(
        rid="t2", prompt_ids=turn2_prompt, sampling=RowSampling(temperature=0.0), max_new_tokens=5
    )
    _finish(runner, [turn2])
    assert turn2.cached_tokens == 0  # nothing of version 0 is reused under version 1
    ref = reference_logprobs(other, turn2_prompt, turn2.output_ids)
    for t, record in enumerate(turn2.tokens):
        assert record.logprob == pytest.approx(ref[t, record.token_id].item(), abs=2e-4)
    assert runner.prefix_cache_tokens() == len(turn2_prompt) + 4  # cached again, as version 1


# ------------------------------------------------------------------ through HTTP


async def _generate(session: aiohttp.ClientSession, url: str, ids: list[int]) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 5},
        "return_logprob": True,
    }
    async with session.post(f"{url}/generate", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_cached_tokens_flush_and_weight_update_through_the_server(
    dense_path: str, tmp_path: Path, other_version: tuple[str, WeightStore]
) -> None:
    _, store = other_version
    prompt = list(range(10, 30))
    async with (
        serve_in_process(model_path=dense_path, weight_root=str(tmp_path)) as (url, service),
        aiohttp.ClientSession() as session,
    ):
        first = await _generate(session, url, prompt)
        assert first["meta_info"]["cached_tokens"] == 0
        turn2 = [*prompt, *first["output_ids"], 7, 8]
        second = await _generate(session, url, turn2)
        assert second["meta_info"]["cached_tokens"] == len(prompt) + 4
        assert service.runner.cached_tokens_total == len(prompt) + 4

        async with session.post(f"{url}/flush_cache") as response:
            assert response.status == 200
        assert (await _generate(session, url, turn2))["meta_info"]["cached_tokens"] == 0
        assert (await _generate(session, url, turn2))["meta_info"]["cached_tokens"] == len(turn2) - 1

        update = {"model_path": store.path(1), "weight_version": 1, "flush_cache": False}
        async with session.post(f"{url}/update_weights_from_disk", json=update) as response:
            assert response.status == 200, await response.text()
        after = await _generate(session, url, turn2)
        assert after["meta_info"]["cached_tokens"] == 0  # even with flush_cache false
        assert after["meta_info"]["weight_version"] == "1"


async def test_disable_radix_cache_reports_no_cached_tokens(dense_path: str) -> None:
    async with (
        serve_in_process(model_path=dense_path, radix_cache=False) as (url, service),
        aiohttp.ClientSession() as session,
    ):
        prompt = list(range(40, 60))
        first = await _generate(session, url, prompt)
        second = await _generate(session, url, [*prompt, *first["output_ids"], 1])
        assert second["meta_info"]["cached_tokens"] == 0
        assert service.runner.prefix_cache is None
