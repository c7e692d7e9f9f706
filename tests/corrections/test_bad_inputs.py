"""Bad arguments raise one CorrectionInputError (a ValueError) whose one line names the problem."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from mixrl.rl.corrections import (
    CorrectionConfig,
    CorrectionInputError,
    chunked_token_policy_loss,
    grpo_advantages,
    token_policy_loss,
)


def base(make_batch: Callable[..., Any]) -> Any:
    batch = make_batch(5, 20, 4, seed=0, support_prob=0.0, pad_prob=0.0)
    support = torch.tensor([2, 0, 0, 0, 0])
    tokens = batch.tokens.clone()
    tokens[0] = batch.cand_ids[0, 1]
    return batch.with_(support_size=support, tokens=tokens)


def set_at(t: torch.Tensor, index: tuple[int, ...], value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


CASES: dict[str, tuple[Callable[[Any], dict[str, Any]], str]] = {
    "tokens shape": (lambda b: {"tokens": b.tokens[:4]}, r"tokens must have shape \[5\], got \[4\]"),
    "advantages shape": (
        lambda b: {"advantages": b.advantages[:, None]},
        r"advantages must have shape \[5\]",
    ),
    "cand_logprobs shape": (
        lambda b: {"cand_logprobs": b.cand_logprobs[:, :3]},
        r"cand_logprobs must have shape \[5, 4\]",
    ),
    "cand_ids 1-D": (lambda b: {"cand_ids": b.cand_ids[:, 0]}, r"cand_ids must have shape \[N, K\]"),
    "float tokens": (lambda b: {"tokens": b.tokens.double()}, "tokens must hold integers"),
    "int advantages": (lambda b: {"advantages": b.tokens}, "advantages must hold floating-point"),
    "loss_mask shape": (lambda b: {"loss_mask": torch.ones(6)}, r"loss_mask must have shape \[5\]"),
    "loss_mask values": (
        lambda b: {"loss_mask": torch.tensor([1, 0, 2, 1, 1])},
        r"loss_mask\[2\] must be 0 or 1",
    ),
    "token out of vocab": (
        lambda b: {"tokens": set_at(b.tokens, (3,), 20)},
        r"tokens\[3\] is outside the vocabulary \[0, 20\)",
    ),
    "support > K": (
        lambda b: {"support_size": set_at(b.support_size, (1,), 5)},
        r"support_size\[1\] exceeds the K = 4",
    ),
    "support > valid": (
        lambda b: {
            "cand_ids": set_at(b.cand_ids, (0, 3), -1),
            "support_size": set_at(b.support_size, (0,), 4),
        },
        r"support_size\[0\] exceeds the number of non-padding",
    ),
    "negative support": (
        lambda b: {"support_size": set_at(b.support_size, (2,), -1)},
        r"support_size\[2\] is negative",
    ),
    "NaN sampler logprob": (
        lambda b: {"sampler_logprobs": set_at(b.sampler_logprobs, (4,), float("nan"))},
        r"sampler_logprobs\[4\] is NaN",
    ),
    "-inf sampler logprob": (
        lambda b: {"sampler_logprobs": set_at(b.sampler_logprobs, (1,), float("-inf"))},
        r"sampler_logprobs\[1\] is infinite",
    ),
    "NaN cand logprob": (
        lambda b: {"cand_logprobs": set_at(b.cand_logprobs, (2, 1), float("nan"))},
        r"cand_logprobs\[2\] holds NaN",
    ),
    "NaN advantage": (
        lambda b: {"advantages": set_at(b.advantages, (0,), float("nan"))},
        r"advantages\[0\] is not finite",
    ),
    "token outside support": (
        lambda b: {"tokens": set_at(b.tokens, (0,), int(b.cand_ids[0, 3]))},
        r"tokens\[0\] is outside its own sampling support",
    ),
    "duplicate candidate": (
        lambda b: {"cand_ids": set_at(b.cand_ids, (3, 2), int(b.cand_ids[3, 0]))},
        r"cand_ids\[3\] lists the same id twice",
    ),
    "candidate after padding": (
        lambda b: {"cand_ids": set_at(b.cand_ids, (1, 1), -1)},
        r"cand_ids\[1\] has a candidate after padding",
    ),
    "candidate out of vocab": (
        lambda b: {"cand_ids": set_at(b.cand_ids, (1, 1), 25)},
        r"cand_ids\[1\] holds an id outside",
    ),
    "empty batch": (
        lambda b: {
            "logits": b.logits[:0],
            "tokens": b.tokens[:0],
            "advantages": b.advantages[:0],
            "sampler_logprobs": b.sampler_logprobs[:0],
            "cand_ids": b.cand_ids[:0],
            "cand_logprobs": b.cand_logprobs[:0],
            "support_size": b.support_size[:0],
        },
        r"empty batch",
    ),
    "logits 1-D": (lambda b: {"logits": b.logits[0]}, r"logits must be a 2-D floating-point tensor"),
    "list tokens": (lambda b: {"tokens": b.tokens.tolist()}, r"tokens must be a torch.Tensor, got list"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_one_clear_line(make_batch: Callable[..., Any], case: str) -> None:
    batch = base(make_batch)
    token_policy_loss(batch.logits, batch.records(), CorrectionConfig())  # the unmodified batch is fine
    change, message = CASES[case]
    bad = batch.with_(**change(batch))
    with pytest.raises(CorrectionInputError, match=message) as info:
        token_policy_loss(bad.logits, bad.records(), CorrectionConfig(), bad.loss_mask)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_masked_rows_are_not_checked(make_batch: Callable[..., Any]) -> None:
    batch = base(make_batch)
    bad = batch.with_(sampler_logprobs=set_at(batch.sampler_logprobs, (4,), float("nan")))
    token_policy_loss(bad.logits, bad.records(), CorrectionConfig(), torch.tensor([1, 1, 1, 1, 0]))


def test_chunked_checks_its_own_arguments(make_batch: Callable[..., Any]) -> None:
    batch = base(make_batch)
    hidden, head = torch.randn(5, 8), torch.randn(20, 8)
    cases = [
        ((hidden, torch.randn(20, 7)), {}, r"lm_head_weight must be \[V, H\] with H = 8"),
        ((hidden, head.double()), {}, r"lm_head_weight dtype torch.float64 differs"),
        ((hidden[:4], head), {}, r"tokens must have shape \[4\]"),
        ((hidden, head), {"chunk_size": 0}, r"chunk_size must be a positive integer"),
        ((hidden, head), {"temperature": 0.0}, r"temperature must be a positive finite number"),
        ((hidden, head), {"vocab_start": 3}, r"vocab_start must be 0 without a vocab_group"),
    ]
    for (h, w), kw, message in cases:
        with pytest.raises(CorrectionInputError, match=message):
            chunked_token_policy_loss(h, w, batch.records(), CorrectionConfig(), **kw)
    with pytest.raises(CorrectionInputError, match="config must be a CorrectionConfig, got dict"):
        token_policy_loss(batch.logits, batch.records(), {"mis": None})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mis": (0.5, 0.9)}, r"mis range must satisfy 0 < lo < 1 < hi, got \(0.5, 0.9\)"),
        ({"mis": (0.0, 5.0)}, r"mis range must satisfy 0 < lo < 1 < hi"),
        ({"mis": (0.2,)}, r"mis must be a pair"),
        ({"mis": None, "tis": 0.0}, r"tis cap must be a positive finite number"),
        ({"mis": None, "tis": float("inf")}, r"tis cap must be a positive finite number"),
        ({"tis": 2.0}, r"mis and tis are alternative weights"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(CorrectionInputError, match=message):
        CorrectionConfig(**kwargs)


def test_grpo_config_turns_everything_off() -> None:
    cfg = CorrectionConfig.grpo()
    assert (cfg.mis, cfg.tis, cfg.score_centering, cfg.topp_replay) == (None, None, False, False)
    assert CorrectionConfig() == CorrectionConfig(
        mis=(0.2, 5.0), tis=None, score_centering=True, topp_replay=True
    )
    with pytest.raises(AttributeError):
        cfg.mis = (0.1, 10.0)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.ones(2, 3), 3), r"rewards must be a 1-D tensor"),
        ((torch.ones(7), 3), r"rewards has 7 entries, not a positive multiple of group_size 3"),
        ((torch.ones(0), 3), r"rewards has 0 entries"),
        ((torch.ones(6), 0), r"group_size must be a positive integer"),
        ((torch.ones(6), 1), r"normalize_std needs group_size >= 2"),
        ((torch.tensor([1.0, float("nan")]), 2), r"rewards contains NaN"),
    ],
)
def test_grpo_advantages_bad_input(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(CorrectionInputError, match=message):
        grpo_advantages(*args)
