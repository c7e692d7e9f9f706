"""The ``/generate`` wire format, both ways and both sides, in this one module (pure; no I/O).

SGLang's native ``/generate`` request and response, plus mixrl's additions (docs/engine.md lists
them): the per-token ``meta_info`` fields ``output_token_weight_versions`` and
``output_token_support_size``, and the router's ``X-Mixrl-*`` headers.

- Client side: :func:`generate_body` builds a request from a :class:`SamplingRule`;
  :func:`parse_response` turns a response (the torch engine's or a real SGLang server's) into a
  :class:`GenerateResult`, one :class:`TokenRecord` per generated token.
- Server side (the torch engine): :func:`parse_generate` checks a request, :func:`build_response`
  writes the response for a finished sequence's token records.

Parsing requests follows SGLang: unknown fields are ignored (the sglang-router adds ``"model":
null``, for one), while a known field with a wrong type or value is a :class:`RequestError` naming
it (the server answers HTTP 400).  Fields that SGLang accepts but this token-in/token-out engine
cannot honour (``text``, ``stop`` strings, ``stream``, penalties, constrained decoding, ``n`` > 1,
input log-probs) are refused by name rather than silently ignored.

Reading responses needs only SGLang's standard fields (``output_ids``,
``meta_info.output_token_logprobs``); mixrl's extra fields refine them when present:

- ``output_token_weight_versions`` (per token); else ``meta_info.weight_version`` for every token
  (SGLang reports one version per request; SGLang's initial version string ``"default"`` reads as 0);
- ``output_token_support_size`` (per token); else ``len(output_token_sampling_mask[t])``; else 0.

Candidates are the position's ``output_top_logprobs``.  When a support S is known, its members are
put first (most likely first), so S is always the leading ``support_size`` candidates as the token
record requires; a support member whose log-prob the response does not carry is an error (ask for
``top_logprobs_num >= top_k``, which :func:`generate_body` does).  SGLang's
``output_token_sampling_logprobs`` is written (for parity) but not needed to read a record back.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import ValidationError

from mixrl.api.sampling import SamplingRule
from mixrl.api.trajectory import TokenRecord

SESSION_HEADER = "X-Mixrl-Session"
"""Request header: the episode's session id; the router keeps a session on one pool and replica."""
POOL_HEADER = "X-Mixrl-Pool"
"""Response headers the router adds: which pool, GPU type, precision and replica served the turn."""
GPU_TYPE_HEADER = "X-Mixrl-Gpu-Type"
PRECISION_HEADER = "X-Mixrl-Precision"
REPLICA_HEADER = "X-Mixrl-Replica"

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


class EngineResponseError(ValueError):
    """An engine response that does not hold what a token record needs."""


@dataclass(frozen=True)
class SamplingRequest:
    """One prompt's ``sampling_params``, checked."""

    rule: SamplingRule = field(default_factory=SamplingRule)
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
    # An int is always finite; math.isfinite(10**400) would raise OverflowError converting it.
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


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
    rule = SamplingRule(
        temperature=_float(f"{field}.temperature", merged.get("temperature", 1.0), 0.0, 1e4),
        top_p=_float(f"{field}.top_p", merged.get("top_p", 1.0), 0.0, 1.0, low_open=True),
        top_k=top_k,
        min_p=_float(f"{field}.min_p", merged.get("min_p", 0.0), 0.0, 1.0),
    )
    return SamplingRequest(
        rule=rule,
        max_new_tokens=_int(f"{field}.max_new_tokens", merged.get("max_new_tokens", 128), 0),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(f"{field}.ignore_eos", merged.get("ignore_eos", False)),
        sampling_seed=None if seed is None else _int(f"{field}.sampling_seed", seed, *SEED_RANGE),
    )


# ------------------------------------------------------------------- the request (client side)


def generate_body(
    input_ids: list[int] | list[list[int]],
    rule: SamplingRule,
    *,
    max_new_tokens: int,
    top_logprobs_num: int = 0,
    return_sampling_mask: bool | None = None,
    stop_token_ids: Seq[int] = (),
    ignore_eos: bool = False,
    sampling_seed: int | None = None,
    rid: str | list[str] | None = None,
) -> dict[str, Any]:
    """SGLang's ``/generate`` body, every sampling parameter explicit (else SGLang takes them from
    the model's generation config) and ``return_logprob`` always on.

    ``return_sampling_mask=None`` asks for the support whenever ``rule`` truncates; with the mask,
    at least top-k candidates are asked for, so every record carries S as its leading candidates on
    either engine.
    """
    want_mask = rule.truncates() if return_sampling_mask is None else return_sampling_mask
    sampling: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": rule.temperature,
        "top_p": rule.top_p,
        "top_k": rule.top_k,
        "min_p": rule.min_p,
        "ignore_eos": ignore_eos,
    }
    if stop_token_ids:
        sampling["stop_token_ids"] = list(stop_token_ids)
    if sampling_seed is not None:
        sampling["sampling_seed"] = sampling_seed
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": rule.candidates(top_logprobs_num) if want_mask else top_logprobs_num,
    }
    if want_mask:
        body["return_sampling_mask"] = True
    if rid is not None:
        body["rid"] = rid
    return body


# ------------------------------------------------------------------- the request (server side)


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


# ------------------------------------------------------------------ the response (server side)


class FinishedSequence(Protocol):
    """What the response needs of a finished sequence (the runner's ``Sequence``)."""

    @property
    def rid(self) -> str: ...
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def tokens(self) -> list[TokenRecord]: ...
    @property
    def finish_reason(self) -> dict[str, Any] | None: ...
    @property
    def cached_tokens(self) -> int: ...


def renormalized_logprob(record: TokenRecord) -> float:
    """log q(a) renormalized on the support S (SGLang's ``output_token_sampling_logprobs``);
    log q(a) itself when the token was sampled from the whole vocabulary."""
    if not record.support_size:
        return record.logprob
    support = record.cand_logprobs[: record.support_size]
    top = max(support)
    return record.logprob - top - math.log(math.fsum(math.exp(lp - top) for lp in support))


def build_response(item: GenerateItem, seq: FinishedSequence, e2e_latency: float) -> dict[str, Any]:
    """SGLang's /generate response for one finished sequence, with mixrl's per-token fields.

    Each record holds at least its support's candidates; the response carries what the request
    asked for: ``top_logprobs_num`` candidates, or all of them with ``return_sampling_mask``.
    """
    tokens = seq.tokens
    version = tokens[-1].weight_version if tokens else None
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(tokens),
        "cached_tokens": seq.cached_tokens,
        "weight_version": str(version) if version is not None else None,
        "e2e_latency": e2e_latency,
        "output_token_weight_versions": [t.weight_version for t in tokens],
    }
    if item.return_logprob:
        shown = None if item.return_sampling_mask else item.top_logprobs_num
        meta["output_token_logprobs"] = [[t.logprob, t.token_id, None] for t in tokens]
        meta["output_top_logprobs"] = [
            [[lp, tid, None] for lp, tid in zip(t.cand_logprobs[:shown], t.cand_ids[:shown], strict=True)]
            for t in tokens
        ]
        meta["output_token_support_size"] = [t.support_size for t in tokens]
    if item.return_sampling_mask:
        meta["output_token_sampling_mask"] = [t.cand_ids[: t.support_size] for t in tokens]
        meta["output_token_sampling_logprobs"] = [renormalized_logprob(t) for t in tokens]
    return {"text": "", "output_ids": [t.token_id for t in tokens], "meta_info": meta}


# ------------------------------------------------------------------ the response (client side)

TurnFinish = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class PoolInfo:
    """Which pool served a request (the router's ``X-Mixrl-*`` headers, or known up front)."""

    pool: str = ""
    gpu_type: str = ""
    precision: str = ""


@dataclass(frozen=True)
class GenerateResult:
    """One prompt's generation: a token record per generated token, why it stopped, who served it."""

    records: list[TokenRecord]
    finish_reason: TurnFinish
    pool: PoolInfo = field(default_factory=PoolInfo)
    finish_detail: Mapping[str, Any] = field(default_factory=dict)
    """SGLang's ``meta_info.finish_reason`` object (e.g. an abort's ``message``)."""

    @property
    def output_ids(self) -> list[int]:
        return [r.token_id for r in self.records]

    @property
    def completion_tokens(self) -> int:
        return len(self.records)

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


def parse_weight_version(value: Any) -> int:
    """SGLang's weight_version string as mixrl's integer version."""
    if isinstance(value, bool):
        raise EngineResponseError(f"weight_version: expected an integer version, got {value!r}")
    if isinstance(value, int):
        return value
    if value in (None, "default"):
        return 0
    try:
        return int(str(value))
    except ValueError:
        raise EngineResponseError(f"weight_version: expected an integer version, got {value!r}") from None


def _candidates(
    top: list[Any] | None, token_id: int, logprob: float, mask: list[int] | None
) -> tuple[list[int], list[float]]:
    known: dict[int, float] = {}
    for entry in top or []:
        known.setdefault(int(entry[1]), float(entry[0]))
    ordered = sorted(known.items(), key=lambda kv: -kv[1])
    if not mask:
        return [i for i, _ in ordered], [lp for _, lp in ordered]
    known.setdefault(token_id, logprob)
    missing = [i for i in mask if i not in known]
    if missing:
        raise EngineResponseError(
            f"output_top_logprobs: support member {missing[0]} has no log-prob; request "
            f"top_logprobs_num >= top_k so the top candidates cover the sampling support"
        )
    members = set(mask)
    head = sorted(((i, known[i]) for i in members), key=lambda kv: -kv[1])
    tail = [(i, lp) for i, lp in sorted(known.items(), key=lambda kv: -kv[1]) if i not in members]
    merged = head + tail
    return [i for i, _ in merged], [lp for _, lp in merged]


def token_records(response: dict[str, Any]) -> list[TokenRecord]:
    """One :class:`TokenRecord` per generated token of a single-prompt response."""
    meta = response.get("meta_info") or {}
    output_ids = response.get("output_ids")
    token_lps = meta.get("output_token_logprobs")
    if output_ids is None or token_lps is None:
        raise EngineResponseError("output_token_logprobs: missing; the request must set return_logprob")
    n = len(output_ids)
    if len(token_lps) != n:
        raise EngineResponseError(f"output_token_logprobs: {len(token_lps)} entries for {n} output tokens")
    tops = meta.get("output_top_logprobs") or [None] * n
    masks = meta.get("output_token_sampling_mask")
    sizes = meta.get("output_token_support_size")
    versions = meta.get("output_token_weight_versions")
    if versions is None:
        versions = [parse_weight_version(meta.get("weight_version"))] * n
    records: list[TokenRecord] = []
    for t in range(n):
        logprob, token_id = float(token_lps[t][0]), int(token_lps[t][1])
        if token_id != output_ids[t]:
            raise EngineResponseError(
                f"output_token_logprobs[{t}]: token {token_id} != output_ids {output_ids[t]}"
            )
        mask = masks[t] if masks is not None else None
        support = int(sizes[t]) if sizes is not None else len(mask or [])
        if support and mask is None:
            # the engine told |S| without its members: they are the leading candidates by definition
            top_ids = [int(e[1]) for e in sorted(tops[t] or [], key=lambda e: -float(e[0]))]
            if len(top_ids) < support:
                raise EngineResponseError(
                    f"output_top_logprobs[{t}]: {len(top_ids)} candidates for a support of {support}; "
                    "request return_sampling_mask"
                )
            mask = top_ids[:support]
        cand_ids, cand_lps = _candidates(tops[t], token_id, logprob, mask if support else None)
        try:
            records.append(
                TokenRecord(
                    token_id=token_id,
                    logprob=logprob,
                    cand_ids=cand_ids,
                    cand_logprobs=cand_lps,
                    support_size=support,
                    weight_version=parse_weight_version(versions[t]),
                )
            )
        except ValidationError as exc:
            message = exc.errors()[0].get("msg", str(exc))
            raise EngineResponseError(f"token {t}: {message}") from None
    return records


def _turn_finish(meta: Mapping[str, Any]) -> tuple[TurnFinish, Mapping[str, Any]]:
    """SGLang's ``meta_info.finish_reason`` as stop / length / abort, and the object itself."""
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind in ("stop", "length", "abort"):
        return kind, reason if isinstance(reason, Mapping) else {"type": kind}
    raise EngineResponseError(f"meta_info.finish_reason: unexpected {reason!r}")


def pool_from_headers(headers: Mapping[str, str], default: PoolInfo) -> PoolInfo:
    """The pool the router names in its response headers; ``default`` without them (an engine)."""
    pool = headers.get(POOL_HEADER)
    if not pool:
        return default
    return PoolInfo(pool, headers.get(GPU_TYPE_HEADER, ""), headers.get(PRECISION_HEADER, ""))


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def completion_token_counts(raw: bytes) -> list[int]:
    """Every ``meta_info.completion_tokens`` in a raw response body (or a streamed chunk), in order.

    Read without parsing: a body that carries top-K log-probs per token runs to megabytes (the
    router counts tokens of every answer it passes on).  JSON escapes quotes inside strings, so
    text the model generated cannot match.
    """
    return [int(count) for count in _COMPLETION_TOKENS.findall(raw)]


def parse_response(
    payload: Any, headers: Mapping[str, str] | None = None, default_pool: PoolInfo | None = None
) -> GenerateResult:
    """One prompt's ``/generate`` response (and the router's headers, if any) as a GenerateResult."""
    if not isinstance(payload, dict):
        raise EngineResponseError("/generate: expected a JSON object per prompt")
    finish, detail = _turn_finish(payload.get("meta_info") or {})
    pool = pool_from_headers(headers or {}, default_pool or PoolInfo())
    return GenerateResult(token_records(payload), finish, pool, detail)
