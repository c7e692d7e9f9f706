"""The ``/generate`` wire format, both ways and both sides, in this one module (pure; no I/O).

SGLang's native ``/generate`` request and response, plus mixrl's additions (docs/engine.md lists
them): the per-token ``meta_info`` fields ``output_token_weight_versions`` and
``output_token_support_size``, and the router's ``X-Mixrl-*`` headers.

- Client side: :func:`generate_body` builds a request from a :class:`SamplingRule`;
  :func:`parse_response` turns a response (the torch engine's or a real SGLang server's) into a
  :class:`GenerateResult`, one :class:`TokenRecord` per generated token.
- Server side (the torch engine): :func:`parse_generate` checks a request, :func:`build_response`
  writes the response for a finished sequence's token records.

Parsing requests follows SGLang: unknown top-level fields are ignored (the sglang-router adds
``"model": null``, for one) and unknown ``sampling_params`` keys are refused (SGLang builds
``SamplingParams(**sampling_params)``), while a known field with a wrong type or value is a
:class:`RequestError` naming it (the server answers HTTP 400).  Every field of SGLang's ``GenerateReqInput`` and
``SamplingParams`` is classified in :data:`GENERATE_FIELDS` / :data:`SAMPLING_FIELDS` (honoured,
refused, not applicable); a refused field that asks for something (any value but its "off" value)
is a :class:`RequestError` naming it, never silently ignored.  Text in and out, stop strings and
chat templates need the model's tokenizer (a :class:`TextCodec`); without one, those fields are
refused naming why.

Reading responses needs only SGLang's standard fields (``output_ids``,
``meta_info.output_token_logprobs``); mixrl's extra fields refine them when present:

- ``output_token_weight_versions`` (per token); else SGLang's ``weight_versions`` spans; else
  ``meta_info.weight_version`` for every token (SGLang's initial version ``"default"`` reads as 0);
- ``output_token_support_size`` (per token); else ``len(output_token_sampling_mask[t])``; else 0.

Candidates are the position's ``output_top_logprobs``.  When a support S is known, its members are
put first (most likely first), so S is always the leading ``support_size`` candidates as the token
record requires.  A support larger than the returned candidates (SGLang's ties at the top-k cut,
when every returned candidate is a member) gets its unreturned members at the cut's log q and is
counted (:func:`unreturned_members`, ``GenerateResult.tied_support_tokens``); any other support
member without a log-prob is an error (ask for ``top_logprobs_num >= top_k``, which
:func:`generate_body` does).  SGLang's
``output_token_sampling_logprobs`` is written (for parity) but not needed to read a record back.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
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


def unicode_text(field: str, text: str) -> str:
    """``text`` if it can be encoded; RequestError naming ``field`` and the position of the first
    lone surrogate (JSON's ``"\\ud800"`` decodes to one, and no tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            field,
            f"holds a lone surrogate ({text[exc.start]!r} at character {exc.start}); text must be valid Unicode",
        ) from None
    return text


class EngineResponseError(ValueError):
    """An engine response that does not hold what a token record needs."""


class SamplingMaskMissing(EngineResponseError):
    """The request asked for the sampling support and the answer has none: something between the
    client and the engine dropped ``return_sampling_mask`` (or the engine cannot answer it).  Unlike
    a malformed answer this repeats on every turn, so callers stop rather than drop the episode."""

    field = "output_token_sampling_mask"


class TextCodec(Protocol):
    """What the wire format needs of the model's tokenizer (mixrl.rl.engine.text.HFTextCodec)."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Seq[int], *, skip_special_tokens: bool = True, spaces: bool = True) -> str: ...
    def token_text(self, token_id: int) -> str: ...


@dataclass(frozen=True)
class SamplingRequest:
    """One prompt's ``sampling_params``, checked."""

    rule: SamplingRule = field(default_factory=SamplingRule)
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings (need the tokenizer); the text is cut before the match unless ``no_stop_trim``."""
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    stream_interval: int = 1


@dataclass(frozen=True)
class GenerateItem:
    """One prompt of a (possibly batched) /generate request."""

    rid: str | None
    input_ids: list[int]
    sampling: SamplingRequest
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_sampling_mask: bool = False
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    stream: bool = False
    log_metrics: bool = True


# ------------------------------------------------------------------------- the field table

FieldStatus = Literal["honoured", "refused", "not applicable"]


@dataclass(frozen=True)
class FieldRule:
    """How the torch engine treats one field of SGLang's API.

    ``refused``: any value but an "off" one (None, false, 0, "", [], {} or ``off``) is a 400 naming
    the field; ``example`` is a value that asks for it (the conformance test sends it).
    ``not applicable``: accepted and without effect because the engine has nothing it could change
    (one data-parallel rank, no routing policy), said in ``why``.
    """

    status: FieldStatus
    why: str = ""
    off: Any = None
    example: Any = "on"

    def asks(self, value: Any) -> bool:
        """Whether ``value`` asks for the feature (is not an "off" value)."""
        if value is None:
            return False
        if isinstance(self.off, bool):  # a switch that is on by default (log_metrics)
            return value is not self.off
        if value is False or (isinstance(value, str | list | dict) and not value):
            return False
        if _is_number(value) and value == 0:
            return False
        return value != self.off


def _honoured(why: str = "") -> FieldRule:
    return FieldRule("honoured", why)


def _refused(why: str, off: Any = None, example: Any = "on") -> FieldRule:
    return FieldRule("refused", why, off, example)


_NO_MM = "multimodal input is not supported (text-only causal LMs)"
_NO_DISAGG = "prefill/decode disaggregation is not supported"
_INTERNAL = "an SGLang-internal field, not for clients"

GENERATE_FIELDS: dict[str, FieldRule] = {
    "rid": _honoured("a string, or one per prompt; a string for a batch becomes rid_0, rid_1, …"),
    "text": _honoured("needs the tokenizer (refused without one)"),
    "input_ids": _honoured(),
    "sampling_params": _honoured("one object, or one per prompt"),
    "return_logprob": _honoured(),
    "logprob_start_len": _honoured("-1 only (output log-probs); input log-probs are refused"),
    "top_logprobs_num": _honoured(),
    "return_sampling_mask": _honoured(),
    "sampling_logprobs_mode": _refused(
        "only 'selected' (the sampled token's renormalized log-prob) is implemented",
        off="selected",
        example="support",
    ),
    "return_text_in_logprobs": _honoured("needs the tokenizer (refused without one)"),
    "stream": _honoured("server-sent events as SGLang streams them"),
    "return_prompt_token_ids": _honoured(),
    "no_logs": _honoured("the engine never logs request contents"),
    "session_id": FieldRule("not applicable", "a routing identity; it changes nothing in one engine"),
    "routing_key": FieldRule("not applicable", "the engine has no routing-key schedule policy"),
    "conversation_id": FieldRule("not applicable", "used by SGLang for request tracking only"),
    "log_metrics": _honoured("false leaves the request out of the per-request metrics"),
    "token_ids_logprob": _refused("log-probs of chosen token ids are not implemented", example=[1]),
    "input_embeds": _refused("not supported; send input_ids or text", example=[[0.0]]),
    "image_data": _refused(_NO_MM),
    "video_data": _refused(_NO_MM),
    "audio_data": _refused(_NO_MM),
    "mm_hashes": _refused(_NO_MM),
    "mm_content_hashes": _refused(_NO_MM),
    "use_audio_in_video": _refused(_NO_MM, example=True),
    "video_config": _refused(_NO_MM, example={"fps": 1}),
    "modalities": _refused(_NO_MM, example=["image"]),
    "max_dynamic_patch": _refused(_NO_MM, example=2),
    "min_dynamic_patch": _refused(_NO_MM, example=2),
    "image_max_dynamic_patch": _refused(_NO_MM, example=2),
    "video_max_dynamic_patch": _refused(_NO_MM, example=2),
    "images_config": _refused(_NO_MM, example={"a": 1}),
    "mm_processor_kwargs": _refused(_NO_MM, example={"a": 1}),
    "need_wait_for_mm_inputs": _refused(_NO_MM, example=True),
    "num_items_assigned": _refused(_NO_MM, example={"image": [1]}),
    "encoder_urls": _refused(_NO_MM, example=["http://x"]),
    "watermark": _refused("watermarking is not implemented", example={"key": 1}),
    "return_flat_raw_top_logprobs": _refused("flat log-prob arrays are not implemented", example=True),
    "return_flat_raw_output_top_logprobs": _refused("flat log-prob arrays are not implemented", example=True),
    "return_flat_raw_top_logprobs_b64": _refused("flat log-prob arrays are not implemented", example=True),
    "return_hidden_states": _refused("hidden states are not returned", example=True),
    "return_routed_experts": _refused("routed experts are not returned", example=True),
    "routed_experts_start_len": _refused("routed experts are not returned", example=1),
    "return_indexer_topk": _refused("indexer top-k is not returned", example=True),
    "return_entropy": _refused("entropy is not returned", example=True),
    "return_bytes": _refused(_INTERNAL, example=True),
    "session_params": _refused(
        "SGLang sessions (continual prompting) are not implemented", example={"id": "s"}
    ),
    "lora_path": _refused("LoRA adapters are not supported"),
    "lora_id": _refused("LoRA adapters are not supported"),
    "custom_logit_processor": _refused("custom logit processors are not supported"),
    "positional_embed_overrides": _refused("embedding overrides are not supported", example=[1]),
    "bootstrap_host": _refused(_NO_DISAGG),
    "bootstrap_port": _refused(_NO_DISAGG, example=1),
    "bootstrap_room": _refused(_NO_DISAGG, example=1),
    "bootstrap_pair_key": _refused(_NO_DISAGG),
    "decode_tp_size": _refused(_NO_DISAGG, example=2),
    "disagg_prefill_dp_rank": _refused(_NO_DISAGG, example=1),
    "routed_dp_rank": _refused("the engine has one data-parallel rank, 0", example=1),
    "data_parallel_rank": _refused("the engine has one data-parallel rank, 0", example=1),
    "background": _refused("background responses are not supported", example=True),
    "require_reasoning": _refused("reasoning control is not supported", example=True),
    "max_thinking_tokens": _refused("reasoning control is not supported", example=8),
    "priority": _refused("priority scheduling is not implemented", example=1),
    "extra_key": _refused("prefix-cache keys are not implemented"),
    "cache_salt": _refused("prefix-cache keys are not implemented"),
    "custom_labels": _refused("custom metric labels are not supported", example={"a": "b"}),
    "kv_hints": _refused("KV hints are not supported"),
    "multi_item_delimiter_indices": _refused("multi-item scoring is not supported", example=[1]),
    "token_indices_to_pool": _refused("pooling is not supported", example=[1]),
    "external_trace_header": _refused("trace propagation is not supported", example={"a": "b"}),
    "http_worker_ipc": _refused(_INTERNAL),
    "received_time": _refused(_INTERNAL, example=1.0),
}
"""Every field of SGLang's ``GenerateReqInput`` (0.5.23), as the torch engine treats it."""

_PENALTY = "penalties are not implemented by the torch engine"
_GRAMMAR = "constrained decoding is not supported"

SAMPLING_FIELDS: dict[str, FieldRule] = {
    "max_new_tokens": _honoured(),
    "stop": _honoured("needs the tokenizer (refused without one); the match is cut from the text"),
    "stop_token_ids": _honoured(),
    "temperature": _honoured(),
    "top_p": _honoured(),
    "top_k": _honoured(),
    "min_p": _honoured(),
    "ignore_eos": _honoured(),
    "sampling_seed": _honoured(),
    "n": _honoured("samples per prompt, prompt-major as SGLang orders them"),
    "no_stop_trim": _honoured(),
    "skip_special_tokens": _honoured("for the text (needs the tokenizer)"),
    "spaces_between_special_tokens": _honoured("for the text (needs the tokenizer)"),
    "stream_interval": _honoured("tokens per streamed chunk"),
    "stop_regex": _refused("stop regexes are not implemented; use stop strings", example="a+"),
    "frequency_penalty": _refused(_PENALTY, off=0.0, example=0.5),
    "presence_penalty": _refused(_PENALTY, off=0.0, example=0.5),
    "repetition_penalty": _refused(_PENALTY, off=1.0, example=1.2),
    "min_new_tokens": _refused("min_new_tokens is not implemented by the torch engine", off=0, example=2),
    "beam_width": _refused("beam search is not implemented", off=1, example=2),
    "json_schema": _refused(_GRAMMAR, example="{}"),
    "regex": _refused(_GRAMMAR, example="a+"),
    "ebnf": _refused(_GRAMMAR, example="root ::= 'a'"),
    "structural_tag": _refused(_GRAMMAR, example="{}"),
    "ebnf_full_assistant": _refused(_GRAMMAR, example=True),
    "logit_bias": _refused("logit bias is not implemented", example={"1": 2.0}),
    "custom_params": _refused("custom logit processors are not supported", example={"a": 1}),
    "watermark": _refused("watermarking is not implemented", example={"key": 1}),
    "stop_strs": _refused(_INTERNAL + "; send stop", example=["x"]),
    "stop_regex_strs": _refused(_INTERNAL + "; send stop_regex", example=["x"]),
    "stop_str_max_len": _refused(_INTERNAL, example=1),
    "stop_regex_max_len": _refused(_INTERNAL, example=1),
    "is_normalized": _refused(_INTERNAL, example=True),
}
"""Every field of SGLang's ``SamplingParams`` (0.5.23), as the torch engine treats it."""


CHAT_WIRE_FIELDS: dict[str, FieldRule] = {
    "return_sampling_mask": _refused("the sampling mask is served by /generate", example=True),
}
"""Fields of SGLang's ChatCompletionRequest spelled like /generate's (so defined in this module)."""


def refuse_asked(field_prefix: str, raw: Mapping[str, Any], table: Mapping[str, FieldRule]) -> None:
    """A RequestError naming the first refused field of ``table`` that ``raw`` asks for."""
    for name, rule in table.items():
        if rule.status == "refused" and name in raw and rule.asks(raw[name]):
            raise RequestError(f"{field_prefix}{name}", rule.why)


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

MAX_STOP_STRINGS = 32  # SGLang's MAX_STOP_COUNT
MAX_SAMPLES = 64
"""Most samples per prompt (``n``): each is a running sequence."""


def _stop_strings(field: str, raw: Any, codec: TextCodec | None) -> tuple[str, ...]:
    if raw is None or raw == "" or raw == []:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(field, "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(field, f"has {len(stops)} strings; at most {MAX_STOP_STRINGS}")
    if codec is None:
        raise RequestError(field, NO_TOKENIZER + "; use stop_token_ids")
    return tuple(dict.fromkeys(unicode_text(field, s) for s in stops))


NO_TOKENIZER = (
    "needs the model's tokenizer, and this engine has none (--skip-tokenizer-init, or no tokenizer "
    "files at --model-path; pass --tokenizer-path)"
)


def parse_sampling(
    field: str, raw: Any, defaults: dict[str, Any], codec: TextCodec | None = None
) -> SamplingRequest:
    """Check one ``sampling_params`` object.  A key SGLang's ``SamplingParams`` does not have is
    refused naming it, as SGLang refuses it (it builds ``SamplingParams(**sampling_params)``)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(field, f"must be an object, got {type(raw).__name__}")
    for name in raw:
        if name not in SAMPLING_FIELDS:
            raise RequestError(f"{field}.{name}", "is not one of SGLang's sampling parameters")
    merged = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
    refuse_asked(f"{field}.", raw, SAMPLING_FIELDS)
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
    text_flags = {
        name: _bool(f"{field}.{name}", merged.get(name, True))
        for name in ("skip_special_tokens", "spaces_between_special_tokens")
    }
    return SamplingRequest(
        rule=rule,
        max_new_tokens=_int(f"{field}.max_new_tokens", merged.get("max_new_tokens", 128), 0),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(f"{field}.ignore_eos", merged.get("ignore_eos", False)),
        sampling_seed=None if seed is None else _int(f"{field}.sampling_seed", seed, *SEED_RANGE),
        stop=_stop_strings(f"{field}.stop", raw.get("stop"), codec),
        no_stop_trim=_bool(f"{field}.no_stop_trim", merged.get("no_stop_trim", False)),
        n=_int(f"{field}.n", merged.get("n", 1), 1, MAX_SAMPLES),
        stream_interval=_int(f"{field}.stream_interval", merged.get("stream_interval", 1), 1),
        **text_flags,
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


def _prompts(body: dict[str, Any], vocab_size: int, codec: TextCodec | None) -> tuple[list[list[int]], bool]:
    """The prompts' token ids (from ``text`` through the tokenizer, or ``input_ids``) and whether
    the request is a batch."""
    text, raw_ids = body.get("text"), body.get("input_ids")
    if text is not None and raw_ids is not None:
        raise RequestError("text", "give text or input_ids, not both")
    if text is not None:
        if codec is None:
            raise RequestError("text", NO_TOKENIZER + "; send input_ids")
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text", "must be a string or a non-empty list of strings")
        where = [f"text[{i}]" if batched else "text" for i in range(len(texts))]
        prompts = [codec.encode(unicode_text(w, t)) for w, t in zip(where, texts, strict=True)]
        for i, ids in enumerate(prompts):
            if not ids:
                raise RequestError(f"text[{i}]" if batched else "text", "encodes to no tokens")
        return prompts, batched
    if raw_ids is None:
        raise RequestError("input_ids", "is required (or text)")
    batched = isinstance(raw_ids, list) and bool(raw_ids) and isinstance(raw_ids[0], list)
    if batched:
        return [_token_ids(f"input_ids[{i}]", ids, vocab_size) for i, ids in enumerate(raw_ids)], True
    return [_token_ids("input_ids", raw_ids, vocab_size)], False


def unique_rids(items: Seq[GenerateItem]) -> list[str]:
    """The request ids a client gave a request's items; RequestError naming ``rid`` when one
    repeats.  As SGLang (``_validate_rid_uniqueness``): two items of one id would be one to
    ``/abort_request``, which aborts every match, and one in the engine's logs."""
    given = [item.rid for item in items if item.rid]
    repeated = sorted(rid for rid, count in Counter(given).items() if count > 1)
    if repeated:
        raise RequestError("rid", f"repeats {', '.join(map(repr, repeated))}; every item needs its own id")
    return given


def _rids(raw: Any, count: int, batched: bool) -> list[str | None]:
    """SGLang's request ids: a string names a single request, or is the prefix of a batch's
    ``<rid>_<i>``; a list gives one per prompt."""
    if raw is None:
        return [None] * count
    if isinstance(raw, str):
        return [f"{raw}_{i}" for i in range(count)] if batched else [raw]
    if batched and isinstance(raw, list):
        if len(raw) != count:
            raise RequestError("rid", f"has {len(raw)} entries for {count} prompts")
        for i, rid in enumerate(raw):
            if rid is not None and not isinstance(rid, str):
                raise RequestError(f"rid[{i}]", "must be a string")
        return list(raw)
    raise RequestError("rid", "must be a string" + (" or a list of strings" if batched else ""))


def parse_generate(
    body: Any,
    *,
    vocab_size: int,
    context_length: int,
    sampling_defaults: dict[str, Any] | None = None,
    codec: TextCodec | None = None,
) -> tuple[list[GenerateItem], bool]:
    """Check a /generate body; returns its items and whether the answer is a list.

    With ``n`` > 1 every prompt is sampled n times, prompt-major (p0 s0, p0 s1, …, p1 s0, …) as
    SGLang orders them, and the answer is a list even for one prompt; each sample gets its own id.
    """
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    refuse_asked("", body, GENERATE_FIELDS)
    stream = _bool("stream", body.get("stream") or False)
    prompts, batched = _prompts(body, vocab_size, codec)
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
        sampling = [
            parse_sampling(f"sampling_params[{i}]", s, defaults, codec) for i, s in enumerate(raw_sampling)
        ]
        if len({s.n for s in sampling}) > 1:
            raise RequestError("sampling_params", "n must be the same for every prompt of a batch")
    else:
        sampling = [parse_sampling("sampling_params", raw_sampling, defaults, codec)] * n
    samples = sampling[0].n

    def where(name: str, i: int) -> str:
        return f"{name}[{i}]" if batched and isinstance(body.get(name), list) else name

    rids = _rids(body.get("rid"), n, batched)
    return_logprob = _per_item(body, "return_logprob", n, batched, False)
    top_num = _per_item(body, "top_logprobs_num", n, batched, 0)
    start_len = _per_item(body, "logprob_start_len", n, batched, -1)
    masks = _per_item(body, "return_sampling_mask", n, batched, False)
    text_in_logprobs = _bool("return_text_in_logprobs", body.get("return_text_in_logprobs") or False)
    if text_in_logprobs and codec is None:
        raise RequestError("return_text_in_logprobs", NO_TOKENIZER)
    prompt_ids = _bool("return_prompt_token_ids", body.get("return_prompt_token_ids") or False)
    log_metrics = _bool("log_metrics", True if body.get("log_metrics") is None else body["log_metrics"])
    items: list[GenerateItem] = []
    for i in range(n):
        want_logprob = _bool(where("return_logprob", i), return_logprob[i])
        k = _int(where("top_logprobs_num", i), top_num[i], 0, vocab_size)
        start = _int(where("logprob_start_len", i), start_len[i], -1)
        if want_logprob and start != -1:
            raise RequestError(where("logprob_start_len", i), "input log-probs are not supported; use -1")
        want_mask = _bool(where("return_sampling_mask", i), masks[i])
        for _ in range(samples):
            items.append(
                GenerateItem(
                    rids[i] if samples == 1 else None,
                    prompts[i],
                    sampling[i],
                    want_logprob,
                    k,
                    want_mask,
                    text_in_logprobs,
                    prompt_ids,
                    stream,
                    log_metrics,
                )
            )
    unique_rids(items)
    return items, batched or samples > 1


# ------------------------------------------------------------------ the response (server side)


class FinishedTokens(Protocol):
    """What an answer needs of a finished (or streamed) sequence: the runner's ``Sequence``."""

    @property
    def rid(self) -> str: ...
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def tokens(self) -> list[TokenRecord]: ...
    @property
    def finish_reason(self) -> dict[str, Any] | None: ...


class FinishedSequence(FinishedTokens, Protocol):
    """What the native response needs besides: the prompt tokens served from the cache."""

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


def weight_version_spans(versions: Seq[int]) -> list[dict[str, Any]]:
    """SGLang's ``meta_info.weight_versions``: runs of tokens produced by one version,
    ``{version (a string), start, end}`` with ``end`` exclusive."""
    spans: list[dict[str, Any]] = []
    for t, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = t + 1
        else:
            spans.append({"version": str(version), "start": t, "end": t + 1})
    return spans


def versions_from_spans(spans: Any, n: int) -> list[int] | None:
    """Per-token versions from SGLang's ``weight_versions`` spans (None if they do not cover n tokens)."""
    if not isinstance(spans, list):
        return None
    versions: list[int] = []
    for span in spans:
        if not isinstance(span, Mapping) or span.get("start") != len(versions):
            return None
        versions += [parse_weight_version(span.get("version"))] * (int(span["end"]) - int(span["start"]))
    return versions if len(versions) == n else None


def output_text(
    item: GenerateItem, output_ids: Seq[int], finish: Mapping[str, Any] | None, codec: TextCodec
) -> str:
    """The generated text as SGLang returns it: decoded with the request's flags, cut before a
    matched stop string unless ``no_stop_trim``."""
    s = item.sampling
    text = codec.decode(
        output_ids, skip_special_tokens=s.skip_special_tokens, spaces=s.spaces_between_special_tokens
    )
    matched = finish.get("matched") if finish else None
    if isinstance(matched, str) and not s.no_stop_trim and matched in text:
        text = text[: text.index(matched)]
    return text


def build_response(
    item: GenerateItem, seq: FinishedSequence, e2e_latency: float, codec: TextCodec | None = None
) -> dict[str, Any]:
    """SGLang's /generate response for a sequence (finished, or in flight for a streamed chunk:
    then ``finish_reason`` is null), with mixrl's per-token fields.

    Keys are omitted unless asked for, as SGLang omits them: log-probs only with
    ``return_logprob``, ``output_top_logprobs`` only with ``top_logprobs_num`` > 0 (or the
    sampling mask, whose support's log-probs it carries), the mask fields only with
    ``return_sampling_mask``, ``text`` only with a tokenizer.
    """
    tokens = list(seq.tokens)  # a snapshot: the model thread appends while a stream reads
    finish = seq.finish_reason
    ids = [t.token_id for t in tokens]
    version = tokens[-1].weight_version if tokens else None
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": finish,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(tokens),
        "cached_tokens": int(getattr(seq, "cached_tokens", 0)),
        "weight_version": str(version) if version is not None else None,
        "weight_versions": weight_version_spans([t.weight_version for t in tokens]),
        "e2e_latency": e2e_latency,
    }
    if item.return_logprob:

        def shown_text(token_id: int) -> str | None:
            return codec.token_text(token_id) if item.return_text_in_logprobs and codec else None

        meta["output_token_logprobs"] = [[t.logprob, t.token_id, shown_text(t.token_id)] for t in tokens]
        if item.top_logprobs_num > 0 or item.return_sampling_mask:
            shown = None if item.return_sampling_mask else item.top_logprobs_num
            meta["output_top_logprobs"] = [
                [
                    [lp, tid, shown_text(tid)]
                    for lp, tid in zip(t.cand_logprobs[:shown], t.cand_ids[:shown], strict=True)
                ]
                for t in tokens
            ]
        meta["output_token_support_size"] = [t.support_size for t in tokens]
        meta["output_token_weight_versions"] = [t.weight_version for t in tokens]
    if item.return_sampling_mask:
        meta["output_token_sampling_mask"] = [t.cand_ids[: t.support_size] for t in tokens]
        meta["output_token_sampling_logprobs"] = [renormalized_logprob(t) for t in tokens]
    out: dict[str, Any] = {}
    if codec is not None:
        out["text"] = output_text(item, ids, finish, codec)
    out["output_ids"] = ids
    if item.return_prompt_token_ids:
        out["prompt_token_ids"] = list(item.input_ids)
    out["meta_info"] = meta
    return out


def get_load_entry(
    running: int, waiting: int, used_tokens: int, pending_tokens: int, now: float
) -> dict[str, Any]:
    """One data-parallel rank's entry of SGLang's ``GET /get_load`` (a list, one per rank)."""
    return {
        "dp_rank": 0,
        "num_reqs": running + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": used_tokens + pending_tokens,
        "num_pending_tokens": pending_tokens,
        "ts_tic": now,
    }


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
    tied_support_tokens: int = 0
    """Tokens whose support had members without a returned log-prob (ties at the top-k cut),
    kept with those members at the cut's log q (:func:`unreturned_members`)."""

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


def _known_logprobs(top: list[Any] | None) -> dict[int, float]:
    known: dict[int, float] = {}
    for entry in top or []:
        known.setdefault(int(entry[1]), float(entry[0]))
    return known


def unreturned_members(top: list[Any] | None, token_id: int, mask: list[int] | None) -> list[int]:
    """Members of the support S that came without a log-prob: neither a candidate nor the token.

    SGLang returns ``top_logprobs_num`` candidates (≥ top-k) and a mask that can be larger, up to
    ``--sampling-mask-max-tokens``: its top-k keeps every token tied with the k-th ("cutoff ties",
    its help says).  Such members are tied at the cut, so their log q is the least log q among the
    returned members, and :func:`_candidates` records them with it rather than losing the episode
    (docs/engine.md, "Ties at the top-k cut").
    """
    known = _known_logprobs(top)
    return [i for i in mask or [] if i not in known and i != token_id]


def _candidates(
    top: list[Any] | None, token_id: int, logprob: float, mask: list[int] | None
) -> tuple[list[int], list[float]]:
    known = _known_logprobs(top)
    ordered = sorted(known.items(), key=lambda kv: -kv[1])
    if not mask:
        return [i for i, _ in ordered], [lp for _, lp in ordered]
    known.setdefault(token_id, logprob)
    missing = unreturned_members(top, token_id, mask)
    members = set(mask)
    if missing:
        outside = [i for i in _known_logprobs(top) if i not in members]
        if outside:  # S is a prefix of the ranking: a non-member outranks the unreturned member
            raise EngineResponseError(
                f"output_top_logprobs: support member {missing[0]} has no log-prob and candidate "
                f"{outside[0]} outside the support is returned; request top_logprobs_num >= top_k "
                "so the top candidates cover the sampling support"
            )
        cut = min(known[i] for i in mask if i in known)
        known.update(dict.fromkeys(missing, cut))
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
        versions = versions_from_spans(meta.get("weight_versions"), n)
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
    payload: Any,
    headers: Mapping[str, str] | None = None,
    default_pool: PoolInfo | None = None,
    *,
    request: Mapping[str, Any] | None = None,
) -> GenerateResult:
    """One prompt's ``/generate`` response (and the router's headers, if any) as a GenerateResult.

    ``request``: the body it answers.  When that set ``return_sampling_mask``, an answer with neither
    the mask nor mixrl's support sizes is an error, not records without their support (a proxy that
    drops the field, such as sglang-router 0.3.2, would otherwise make a truncated rule look
    untruncated).
    """
    if not isinstance(payload, dict):
        raise EngineResponseError("/generate: expected a JSON object per prompt")
    meta = payload.get("meta_info") or {}
    asked = bool((request or {}).get("return_sampling_mask"))
    if asked and "output_token_sampling_mask" not in meta and "output_token_support_size" not in meta:
        raise SamplingMaskMissing(
            "output_token_sampling_mask: absent although the request set return_sampling_mask; "
            "something between client and engine dropped the field (sglang-router 0.3.2 does: "
            "use mixrl's router, docs/router.md)"
        )
    finish, detail = _turn_finish(payload.get("meta_info") or {})
    pool = pool_from_headers(headers or {}, default_pool or PoolInfo())
    records = token_records(payload)
    return GenerateResult(records, finish, pool, detail, tied_support_tokens(payload))


def tied_support_tokens(response: dict[str, Any]) -> int:
    """Tokens of a response (already read by :func:`token_records`) whose support had members
    without a returned log-prob."""
    meta = response.get("meta_info") or {}
    masks = meta.get("output_token_sampling_mask") or []
    tops = meta.get("output_top_logprobs") or [None] * len(masks)
    token_lps = meta["output_token_logprobs"]
    return sum(1 for t, mask in enumerate(masks) if unreturned_members(tops[t], int(token_lps[t][1]), mask))


# ----------------------------------------------------------------------- streams and /v1 usage

SSE_DONE = b"data: [DONE]\n\n"
"""The last event of an SGLang stream."""


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One server-sent event of an SGLang stream: ``data: <json>`` and a blank line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def stream_chunk(response: dict[str, Any], index: int | None) -> dict[str, Any]:
    """A streamed /generate chunk: the cumulative response; in a batch SGLang adds the item's ``index``."""
    return response if index is None else {**response, "index": index}


def openai_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object of an OpenAI-compatible answer."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
