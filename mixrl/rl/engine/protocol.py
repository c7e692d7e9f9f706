"""SGLang's native ``/generate`` request and response, checked and built without any I/O.

Parsing follows SGLang: unknown fields are ignored (the sglang-router adds ``"model": null``, for
one), while a known field with a wrong type or value is a :class:`RequestError` naming it (the
server answers HTTP 400).  Fields that SGLang accepts but this token-in/token-out engine cannot
honour (``text``, ``stop`` strings, ``stream``, penalties, constrained decoding, ``n`` > 1, input
log-probs) are refused by name rather than silently ignored.

Responses have SGLang's shape (``text``, ``output_ids``, ``meta_info``) plus mixrl's per-token
fields in ``meta_info`` (docs/engine.md lists them):
``output_token_weight_versions`` and, with ``return_logprob``, ``output_token_support_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mixrl.rl.engine.runner import Sequence

MAX_ERROR_CHARS = 200
"""Longest reason an error message carries: a reason quoting a client's value never echoes megabytes."""

SEED_RANGE = (-(2**63), 2**64 - 1)
"""What ``torch.Generator.manual_seed`` accepts (a negative seed wraps around, as in torch)."""


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters in all)"


class RequestError(ValueError):
    """A request field with a wrong type or value; ``field`` is its dotted path."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {clip(message)}")
        self.field = field
        self.status = status

    def to_json(self) -> dict[str, Any]:
        kind = "BadRequestError" if self.status == 400 else "RequestEntityTooLarge"
        return {"error": {"message": str(self), "type": kind, "param": self.field, "code": self.status}}


@dataclass(frozen=True)
class SamplingRequest:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None


@dataclass(frozen=True)
class GenerateItem:
    """One prompt of a (possibly batched) /generate request."""

    rid: str | None
    input_ids: list[int]
    sampling: SamplingRequest
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_sampling_mask: bool = False


# ---------------------------------------------------------------------------------- type checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _int(field: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    if not _is_int(value):
        raise RequestError(field, f"must be an integer, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise RequestError(field, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise RequestError(field, f"must be <= {high}, got {value}")
    return value


def _float(field: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if not _is_number(value):
        raise RequestError(field, f"must be a finite number, got {type(value).__name__} {value!r}")
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise RequestError(field, f"must be in {bracket}{low}, {high}], got {value}")
    return float(value)


def _bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RequestError(field, f"must be true or false, got {type(value).__name__} {value!r}")
    return value


def _token_ids(field: str, value: Any, vocab_size: int, allow_empty: bool = False) -> list[int]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise RequestError(field, "must be a non-empty list of token ids")
    for i, token in enumerate(value):
        _int(f"{field}[{i}]", token, 0, vocab_size - 1)
    return list(value)


# ------------------------------------------------------------------------------ sampling params

_UNSUPPORTED_SAMPLING: dict[str, tuple[Any, str]] = {
    # name: (value meaning "off", why another value is refused)
    "frequency_penalty": (0.0, "penalties are not implemented by the torch engine"),
    "presence_penalty": (0.0, "penalties are not implemented by the torch engine"),
    "repetition_penalty": (1.0, "penalties are not implemented by the torch engine"),
    "min_new_tokens": (0, "min_new_tokens is not implemented by the torch engine"),
    "n": (1, "only n=1 is supported; send the prompt several times"),
    "json_schema": (None, "constrained decoding is not supported"),
    "regex": (None, "constrained decoding is not supported"),
    "ebnf": (None, "constrained decoding is not supported"),
}


def parse_sampling(field: str, raw: Any, defaults: dict[str, Any]) -> SamplingRequest:
    """Check one ``sampling_params`` object; unknown keys are ignored, as SGLang does."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(field, f"must be an object, got {type(raw).__name__}")
    merged = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
    for name, (off, why) in _UNSUPPORTED_SAMPLING.items():
        if name in raw and raw[name] is not None and raw[name] != off:
            raise RequestError(f"{field}.{name}", why)
    stop = raw.get("stop")
    if stop not in (None, "", []):
        raise RequestError(f"{field}.stop", "stop strings need a tokenizer; this engine takes stop_token_ids")
    top_k = _int(f"{field}.top_k", merged.get("top_k", -1), -1)
    if top_k == 0:
        raise RequestError(f"{field}.top_k", "must be -1 (no top-k) or a positive integer, got 0")
    stop_ids = merged.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise RequestError(f"{field}.stop_token_ids", "must be a list of token ids")
    for i, token in enumerate(stop_ids):
        _int(f"{field}.stop_token_ids[{i}]", token, 0)
    seed = merged.get("sampling_seed")
    return SamplingRequest(
        temperature=_float(f"{field}.temperature", merged.get("temperature", 1.0), 0.0, 1e4),
        top_p=_float(f"{field}.top_p", merged.get("top_p", 1.0), 0.0, 1.0, low_open=True),
        top_k=top_k,
        min_p=_float(f"{field}.min_p", merged.get("min_p", 0.0), 0.0, 1.0),
        max_new_tokens=_int(f"{field}.max_new_tokens", merged.get("max_new_tokens", 128), 0),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(f"{field}.ignore_eos", merged.get("ignore_eos", False)),
        sampling_seed=None if seed is None else _int(f"{field}.sampling_seed", seed, *SEED_RANGE),
    )


# --------------------------------------------------------------------------------- the request


def _per_item(body: dict[str, Any], name: str, count: int, batched: bool, default: Any) -> list[Any]:
    """A field given once for all prompts or, in a batch, as a list with one value per prompt."""
    value = body.get(name)
    if value is None:
        return [default] * count
    if batched and isinstance(value, list):
        if len(value) != count:
            raise RequestError(name, f"has {len(value)} entries for {count} prompts")
        return [default if v is None else v for v in value]
    return [value] * count


def parse_generate(
    body: Any, *, vocab_size: int, context_length: int, sampling_defaults: dict[str, Any] | None = None
) -> tuple[list[GenerateItem], bool]:
    """Check a /generate body; returns its items and whether it was a batch (list of prompts)."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    for name, why in (
        ("text", "this engine is token-in/token-out (no tokenizer); send input_ids"),
        ("input_embeds", "not supported; send input_ids"),
        ("image_data", "multimodal input is not supported"),
    ):
        if body.get(name) is not None:
            raise RequestError(name, why)
    if body.get("stream"):
        raise RequestError("stream", "streaming is not supported by the torch engine")
    raw_ids = body.get("input_ids")
    if raw_ids is None:
        raise RequestError("input_ids", "is required")
    batched = isinstance(raw_ids, list) and bool(raw_ids) and isinstance(raw_ids[0], list)
    if batched:
        prompts = [_token_ids(f"input_ids[{i}]", ids, vocab_size) for i, ids in enumerate(raw_ids)]
    else:
        prompts = [_token_ids("input_ids", raw_ids, vocab_size)]
    for i, ids in enumerate(prompts):
        if len(ids) >= context_length:
            name = f"input_ids[{i}]" if batched else "input_ids"
            raise RequestError(name, f"has {len(ids)} tokens; the context length is {context_length}")
    n = len(prompts)
    defaults = sampling_defaults or {}
    raw_sampling = body.get("sampling_params")
    if batched and isinstance(raw_sampling, list):
        if len(raw_sampling) != n:
            raise RequestError("sampling_params", f"has {len(raw_sampling)} entries for {n} prompts")
        sampling = [parse_sampling(f"sampling_params[{i}]", s, defaults) for i, s in enumerate(raw_sampling)]
    else:
        sampling = [parse_sampling("sampling_params", raw_sampling, defaults)] * n

    def where(name: str, i: int) -> str:
        return f"{name}[{i}]" if batched and isinstance(body.get(name), list) else name

    rids = _per_item(body, "rid", n, batched, None)
    return_logprob = _per_item(body, "return_logprob", n, batched, False)
    top_num = _per_item(body, "top_logprobs_num", n, batched, 0)
    start_len = _per_item(body, "logprob_start_len", n, batched, -1)
    masks = _per_item(body, "return_sampling_mask", n, batched, False)
    items: list[GenerateItem] = []
    for i in range(n):
        if rids[i] is not None and not isinstance(rids[i], str):
            raise RequestError(where("rid", i), "must be a string")
        want_logprob = _bool(where("return_logprob", i), return_logprob[i])
        k = _int(where("top_logprobs_num", i), top_num[i], 0, vocab_size)
        start = _int(where("logprob_start_len", i), start_len[i], -1)
        if want_logprob and start != -1:
            raise RequestError(where("logprob_start_len", i), "input log-probs are not supported; use -1")
        want_mask = _bool(where("return_sampling_mask", i), masks[i])
        items.append(GenerateItem(rids[i], prompts[i], sampling[i], want_logprob, k, want_mask))
    return items, batched


# -------------------------------------------------------------------------------- the response


def build_response(item: GenerateItem, seq: Sequence, e2e_latency: float) -> dict[str, Any]:
    """SGLang's /generate response for one finished sequence, with mixrl's per-token fields."""
    tokens = seq.tokens
    version = tokens[-1].weight_version if tokens else None
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(tokens),
        "cached_tokens": 0,
        "weight_version": str(version) if version is not None else None,
        "e2e_latency": e2e_latency,
        "output_token_weight_versions": [t.weight_version for t in tokens],
    }
    if item.return_logprob:
        meta["output_token_logprobs"] = [[t.logprob, t.token_id, None] for t in tokens]
        meta["output_top_logprobs"] = [
            [[lp, tid, None] for lp, tid in zip(t.cand_logprobs, t.cand_ids, strict=True)] for t in tokens
        ]
        meta["output_token_support_size"] = [t.support_size for t in tokens]
    if item.return_sampling_mask:
        meta["output_token_sampling_mask"] = [
            t.cand_ids[: t.support_size] if t.support_size else [] for t in tokens
        ]
        meta["output_token_sampling_logprobs"] = [t.sampling_logprob for t in tokens]
    return {"text": "", "output_ids": seq.output_ids, "meta_info": meta}
