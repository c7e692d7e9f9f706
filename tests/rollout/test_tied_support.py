"""Ties at the top-k cut: a support larger than the returned candidates keeps the episode.

SGLang returns ``top_logprobs_num`` candidates (mixrl asks for max(topCandidates, top_k)) and a
sampling mask that may be larger, up to ``--sampling-mask-max-tokens`` = 2 × top-k, when tokens tie
with the k-th.  Stand-in: a FakeEngine replica answering as SGLang does in that case (its standard
fields only), behind the real router, played by the real rollout worker.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from mixrl.api.trajectory import TokenRecord
from mixrl.rl.engine.protocol import EngineResponseError, parse_response, renormalized_logprob

from .conftest import TOKENIZER, Engines, StartBuffer, StartRouter, metrics_text, scripted_reply
from .test_agent import TASK
from .test_worker import worker_behind_router

CUT = -3.0
"""log q of the tokens tied at the cut."""


def _tied(token: int, vocab: int) -> tuple[int, int]:
    return (token + 1) % vocab, (token + 2) % vocab


def _sglang_tied_response(token_lps: list[float], tokens: list[int], vocab: int) -> dict[str, Any]:
    """Each token: 2 candidates returned (itself and one tied at the cut), a mask of 3 (two tied)."""
    tops, masks = [], []
    for lp, token in zip(token_lps, tokens, strict=True):
        returned, unreturned = _tied(token, vocab)
        tops.append([[lp, token, None], [CUT, returned, None]])
        masks.append([token, returned, unreturned])
    meta = {
        "id": "r",
        "finish_reason": {"type": "stop", "matched": tokens[-1]},
        "weight_version": "2",
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(token_lps, tokens, strict=True)],
        "output_top_logprobs": tops,
        "output_token_sampling_mask": masks,
    }
    return {"text": "", "output_ids": tokens, "meta_info": meta}


def test_unreturned_tied_members_get_the_cut_logprob_and_are_counted() -> None:
    result = parse_response(_sglang_tied_response([-0.1, -0.2], [10, 20], vocab=64))
    assert result.tied_support_tokens == 2
    for record, token in zip(result.records, (10, 20), strict=True):
        returned, unreturned = _tied(token, 64)
        assert record.support_size == 3
        assert record.cand_ids[0] == token and set(record.cand_ids[1:3]) == {returned, unreturned}
        assert record.cand_logprobs[1:3] == [CUT, CUT]
        # the behaviour probability the corrections use: q(a) renormalized on all three members
        expected = record.logprob - math.log(math.exp(record.logprob) + 2 * math.exp(CUT))
        assert renormalized_logprob(record) == pytest.approx(expected)


def test_a_support_member_ranked_below_a_returned_non_member_is_still_an_error() -> None:
    response = _sglang_tied_response([-0.1], [10], vocab=64)
    response["meta_info"]["output_top_logprobs"][0].append([-2.0, 40, None])  # outranks member 12
    with pytest.raises(EngineResponseError, match="candidate 40 outside the support"):
        parse_response(response)


def tied_reply(body: dict[str, Any]) -> dict[str, Any]:
    """The scripted policy's answer, reshaped as SGLang's with ties at the cut on every token."""
    answer = scripted_reply()(body)
    meta = answer["meta_info"]
    tied = _sglang_tied_response(
        [lp for lp, _, _ in meta["output_token_logprobs"]], answer["output_ids"], TOKENIZER.vocab_size
    )
    meta.update({k: tied["meta_info"][k] for k in ("output_top_logprobs", "output_token_sampling_mask")})
    return answer


async def test_the_episode_is_kept_and_the_tokens_counted(
    engines: Engines, start_router: StartRouter, start_buffer: StartBuffer
) -> None:
    engine = await engines("a", reply=tied_reply)
    async with worker_behind_router(engine, start_router, start_buffer) as (worker, _):
        trajectory = await worker.play(TASK, 0, "p0")
    assert (trajectory.finish_reason, trajectory.reward) == ("submitted", 1.0)
    generated = [i for i, m in enumerate(trajectory.loss_mask) if m]
    assert generated and all(trajectory.support_size[i] == 3 for i in generated)
    for i in generated:  # every record is one the corrections accept
        TokenRecord(
            token_id=trajectory.tokens[i],
            logprob=trajectory.logprobs[i],
            cand_ids=trajectory.cand_ids[i],
            cand_logprobs=trajectory.cand_logprobs[i],
            support_size=trajectory.support_size[i],
            weight_version=trajectory.weight_version[i],
        )
    assert worker.stats.tied_support_tokens == len(generated)
    text = await metrics_text(worker.stats)
    labels = 'gpu_type="gpu-a",pool="a",precision="prec-a",run="test"'
    assert f"mixrl_rollout_tied_support_tokens_total{{{labels}}} {float(len(generated))}" in text
