"""The model runner in-process: continuous batching and the KV cache against plain full forward passes."""

from __future__ import annotations

import pytest
import torch

from mixrl.rl.engine.runner import ModelRunner, Sequence
from mixrl.rl.engine.sampling import RowSampling

from .conftest import random_prompts, reference_logprobs, reference_model

TIE = 1e-4  # a greedy choice may differ from the reference only between near-equal logits
# Float rounding differs between incremental and full passes by ~1e-6; an FP8 KV cache turns a value
# that sits on an E4M3 rounding boundary into a full E4M3 step (~6 %), so its tolerance is wider.
LOGPROB_ABS = {False: 2e-4, True: 5e-3}


def _runner(model: torch.nn.Module, fp8_kv: bool = False, use_kv_cache: bool = True) -> ModelRunner:
    layers = model.config.num_hidden_layers
    return ModelRunner(
        model,
        weight_version=0,
        context_length=4096,
        kv_scales=[(1.0, 1.0) if fp8_kv else None] * layers,
        use_kv_cache=use_kv_cache,
    )


def _sequences(prompts: list[list[int]], sampling: RowSampling, base_tokens: int = 12) -> list[Sequence]:
    return [
        Sequence(
            rid=str(i),
            prompt_ids=p,
            sampling=sampling,
            max_new_tokens=base_tokens + 3 * i,
            generator=torch.Generator().manual_seed(100 + i),
        )
        for i, p in enumerate(prompts)
    ]


def _run_staggered(runner: ModelRunner, seqs: list[Sequence]) -> None:
    """Admit two requests, decode, admit more while those run, and so on (continuous batching)."""
    pending = list(seqs)
    while pending or runner.running:
        if pending:
            runner.add(pending[:2])
            pending = pending[2:]
        for _ in range(3):
            runner.step()


def _assert_matches_reference(
    model: torch.nn.Module, seq: Sequence, temperature: float = 1.0, fp8_kv: bool = False
) -> None:
    ref = reference_logprobs(model, seq.prompt_ids, seq.output_ids, temperature, fp8_kv=fp8_kv)
    for t, token in enumerate(seq.tokens):
        assert token.logprob == pytest.approx(ref[t, token.token_id].item(), abs=LOGPROB_ABS[fp8_kv])
        if seq.sampling.greedy:
            assert ref[t, token.token_id] >= ref[t].max() - (TIE if not fp8_kv else LOGPROB_ABS[True])


@pytest.mark.parametrize("fp8_kv", [False, True], ids=["bf16_kv", "fp8_kv"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_batched_greedy_equals_sequential_and_reference(
    kind: str, fp8_kv: bool, dense_path: str, moe_path: str
) -> None:
    model = reference_model(dense_path if kind == "dense" else moe_path, "bf16")
    prompts = random_prompts(6, seed=1)
    greedy = RowSampling(temperature=0.0, num_candidates=2)
    alone = _sequences(prompts, greedy)
    for seq in alone:
        runner = _runner(model, fp8_kv)
        runner.add([seq])
        while runner.running:
            runner.step()
    batched = _sequences(prompts, greedy)
    _run_staggered(_runner(model, fp8_kv), batched)
    for a, b in zip(alone, batched, strict=True):
        assert a.finish_reason == b.finish_reason == {"type": "length", "length": a.max_new_tokens}
        assert b.output_ids == a.output_ids
        assert [t.logprob for t in b.tokens] == pytest.approx(
            [t.logprob for t in a.tokens], abs=LOGPROB_ABS[fp8_kv]
        )
        _assert_matches_reference(model, b, fp8_kv=fp8_kv)


def test_seeded_sampling_is_batch_independent_and_cached_equals_uncached(dense_path: str) -> None:
    model = reference_model(dense_path, "bf16")
    prompts = random_prompts(5, seed=2)
    sampling = RowSampling(temperature=0.8, top_p=0.9, top_k=40, num_candidates=3, cover_support=True)
    cached = _sequences(prompts, sampling)
    _run_staggered(_runner(model), cached)
    uncached = _sequences(prompts, sampling)
    runner = _runner(model, use_kv_cache=False)
    runner.add(uncached)
    while runner.running:
        runner.step()
    for a, b in zip(cached, uncached, strict=True):
        assert a.output_ids == b.output_ids
        _assert_matches_reference(model, a, temperature=0.8)


def test_fp8_kv_cache_changes_results_measurably(dense_path: str) -> None:
    model = reference_model(dense_path, "bf16")
    prompts = random_prompts(4, seed=3, low=20, high=30)
    runs: dict[bool, list[Sequence]] = {}
    for fp8 in (False, True):
        runs[fp8] = _sequences(prompts, RowSampling(temperature=0.0), base_tokens=10)
        runner = _runner(model, fp8)
        runner.add(runs[fp8])
        while runner.running:
            runner.step()
    differences = []
    for plain, fp8 in zip(runs[False], runs[True], strict=True):
        for a, b in zip(plain.tokens, fp8.tokens, strict=True):
            differences.append(abs(a.logprob - b.logprob))  # same context up to the first divergence
            if a.token_id != b.token_id:
                break
    mean = sum(differences) / len(differences)
    assert mean > 1e-3  # FP8 rounding of keys and values is visible ...
    assert mean < 0.5  # ... and bounded


def test_stop_tokens_and_zero_budget(dense_path: str) -> None:
    model = reference_model(dense_path, "bf16")
    prompt = random_prompts(1, seed=4)[0]
    probe = Sequence(rid="probe", prompt_ids=prompt, sampling=RowSampling(temperature=0.0), max_new_tokens=6)
    runner = _runner(model)
    runner.add([probe])
    while runner.running:
        runner.step()
    stop_at = probe.output_ids[3]
    first = probe.output_ids.index(stop_at)
    seq = Sequence(
        rid="s",
        prompt_ids=prompt,
        sampling=RowSampling(temperature=0.0),
        max_new_tokens=50,
        stop_token_ids=frozenset({stop_at}),
    )
    empty = Sequence(rid="e", prompt_ids=prompt, sampling=RowSampling(), max_new_tokens=0)
    done = runner.add([seq, empty])
    while runner.running:
        done += runner.step()
    assert {s.rid for s in done} == {"s", "e"}
    assert seq.output_ids == probe.output_ids[: first + 1]
    assert seq.finish_reason == {"type": "stop", "matched": stop_at}
    assert empty.output_ids == [] and empty.finish_reason == {"type": "length", "length": 0}


def test_an_abort_during_the_last_step_stays_an_abort(
    dense_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/abort_request marks a sequence from the event loop while a step runs on the model thread;
    that step's last token then ended it as `length`, though the abort had counted it aborted."""
    runner = _runner(reference_model(dense_path, "bf16"))
    seq = Sequence(
        rid="a",
        prompt_ids=random_prompts(1, seed=5)[0],
        sampling=RowSampling(temperature=0.0),
        max_new_tokens=2,
    )
    runner.add([seq])
    real = runner._sample_into

    def aborted_meanwhile(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        seq.abort("aborted by request")  # as the event loop does mid-step
        return real(seqs, logits)

    monkeypatch.setattr(runner, "_sample_into", aborted_meanwhile)
    done = runner.step()
    assert done == [seq] and len(seq.tokens) == 2
    assert seq.finish_reason == {"type": "abort", "message": "aborted by request"}
