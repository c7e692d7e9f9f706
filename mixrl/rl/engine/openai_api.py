"""SGLang's OpenAI-compatible API on the torch engine: ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions`` (pure translation; no I/O).

A request becomes the same :class:`~mixrl.rl.engine.protocol.GenerateItem` list a ``/generate``
request does (one per prompt and sample, prompt-major), so sampling, stop strings and records are
the engine's own; the answer is built from the finished sequences.  As in SGLang:

- ``logprobs`` (completions: an int, the top candidates per token; chat: ``logprobs: true`` with
  ``top_logprobs: k``) carry the sampler's log q = log softmax(z / T), before truncation;
- ``return_token_ids: true`` adds the ids: ``token_ids`` and ``prompt_token_ids`` per completion
  choice, ``prompt_token_ids`` and ``response_token_ids`` per chat choice;
- SGLang's extra sampling fields (``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``,
  ``no_stop_trim``, ``skip_special_tokens``, ``rid``) are honoured; every other field of SGLang's
  ``CompletionRequest`` / ``ChatCompletionRequest`` is classified in :data:`COMPLETION_FIELDS` /
  :data:`CHAT_FIELDS`, and one that asks for something the engine cannot do is refused by name.
- mixrl's ``min_weight_version`` (docs/engine.md#version-aware-requests) is read into
  :attr:`OpenAIRequest.min_weight_version`; the server answers 409 when its weights are older.

Both need the model's tokenizer (the answer is text; chat needs its template).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from mixrl.api.trajectory import TokenRecord
from mixrl.rl.engine.protocol import (
    CHAT_WIRE_FIELDS,
    GENERATE_FIELDS,
    NO_TOKENIZER,
    SAMPLING_FIELDS,
    FieldRule,
    FieldStatus,
    FinishedTokens,
    GenerateItem,
    RequestError,
    TextCodec,
    openai_usage,
    output_text,
    parse_sampling,
    refuse_asked,
    unicode_text,
    unique_rids,
)
from mixrl.rl.engine.version_gate import body_min_version

OPENAI_DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and SGLang's CompletionRequest's) ``max_tokens`` default for completions."""

CHAT_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
"""The message roles besides ``user`` that SGLang 0.5.23 (the pinned release) accepts, in any case
(``ChatCompletionMessageGenericParam`` lowercases them); ``user`` only as written.  Any other role
is its 400, so here too: passed on, it would reach the chat template, which may render it
verbatim as if it meant something."""


class ChatCodec(TextCodec, Protocol):
    @property
    def has_chat_template(self) -> bool: ...
    def chat_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]: ...


def _from(table: dict[str, FieldRule], name: str, why: str = "") -> FieldRule:
    rule = table[name]
    return FieldRule(rule.status, why or rule.why, rule.off, rule.example)


_H = FieldRule("honoured")
_NA: FieldStatus = "not applicable"

_SHARED_FIELDS: dict[str, FieldRule] = {
    "model": FieldRule(_NA, "the engine serves one model; any name is answered by it"),
    "user": FieldRule(_NA, "an end-user id for abuse tracking; nothing to track here"),
    "session_id": _from(GENERATE_FIELDS, "session_id"),
    "n": FieldRule("honoured", "choices per prompt"),
    "seed": FieldRule("honoured", "the sampling seed"),
    "stop": FieldRule("honoured", "stop strings"),
    "temperature": _H,
    "top_p": _H,
    "top_k": _H,
    "min_p": _H,
    "max_tokens": _H,
    "stop_token_ids": _H,
    "no_stop_trim": _H,
    "ignore_eos": _H,
    "skip_special_tokens": _H,
    "rid": _H,
    "return_token_ids": FieldRule("honoured", "token ids of the prompt and the output"),
    "stream": FieldRule("honoured", "server-sent chunks, then data: [DONE]"),
    "stream_options": FieldRule("honoured", "include_usage (continuous_usage_stats is refused)"),
    "frequency_penalty": _from(SAMPLING_FIELDS, "frequency_penalty"),
    "presence_penalty": _from(SAMPLING_FIELDS, "presence_penalty"),
    "repetition_penalty": _from(SAMPLING_FIELDS, "repetition_penalty"),
    "min_tokens": _from(SAMPLING_FIELDS, "min_new_tokens"),
    "logit_bias": _from(SAMPLING_FIELDS, "logit_bias"),
    "regex": _from(SAMPLING_FIELDS, "regex"),
    "ebnf": _from(SAMPLING_FIELDS, "ebnf"),
    "stop_regex": _from(SAMPLING_FIELDS, "stop_regex"),
    "custom_params": _from(SAMPLING_FIELDS, "custom_params"),
    "watermark": _from(SAMPLING_FIELDS, "watermark"),
    "response_format": FieldRule(
        "refused", "structured output is not supported", off={"type": "text"}, example={"type": "json_object"}
    ),
    "return_hidden_states": _from(GENERATE_FIELDS, "return_hidden_states"),
    "return_routed_experts": _from(GENERATE_FIELDS, "return_routed_experts"),
    "routed_experts_start_len": _from(GENERATE_FIELDS, "routed_experts_start_len"),
    "return_cached_tokens_details": FieldRule("refused", "cache details are not reported", example=True),
    "return_spec_tokens_details": FieldRule("refused", "there is no speculative decoding", example=True),
    "lora_path": _from(GENERATE_FIELDS, "lora_path"),
    "session_params": _from(GENERATE_FIELDS, "session_params"),
    "custom_logit_processor": _from(GENERATE_FIELDS, "custom_logit_processor"),
    "images_config": _from(GENERATE_FIELDS, "images_config"),
    "mm_processor_kwargs": _from(GENERATE_FIELDS, "mm_processor_kwargs"),
    "data_parallel_rank": _from(GENERATE_FIELDS, "data_parallel_rank"),
    "extra_key": _from(GENERATE_FIELDS, "extra_key"),
    "cache_salt": _from(GENERATE_FIELDS, "cache_salt"),
    "priority": _from(GENERATE_FIELDS, "priority"),
}

COMPLETION_FIELDS: dict[str, FieldRule] = {
    **_SHARED_FIELDS,
    "prompt": FieldRule("honoured", "a string, a list of strings, a list of ids or a list of id lists"),
    "rid": FieldRule("honoured", "a string (several choices: rid_0, rid_1, …), or a list of one per prompt"),
    "logprobs": FieldRule("honoured", "top candidates per token (an integer)"),
    "json_schema": _from(SAMPLING_FIELDS, "json_schema"),
    "best_of": FieldRule("refused", "best_of is not implemented; use n", off=1, example=2),
    "echo": FieldRule("refused", "echoing the prompt is not implemented", example=True),
    "suffix": FieldRule("refused", "suffixes (insertion) are not supported"),
    "custom_labels": _from(GENERATE_FIELDS, "custom_labels"),
}
"""Every field of SGLang's ``CompletionRequest`` (0.5.23), as the torch engine treats it."""

CHAT_FIELDS: dict[str, FieldRule] = {
    **_SHARED_FIELDS,
    "messages": FieldRule("honoured", "rendered by the tokenizer's chat template"),
    "logprobs": FieldRule("honoured", "the sampled token's log-prob"),
    "top_logprobs": FieldRule("honoured", "top candidates per token"),
    "max_completion_tokens": FieldRule("honoured", "as max_tokens"),
    "return_prompt_token_ids": FieldRule("honoured", "the rendered prompt's ids"),
    "chat_template_kwargs": FieldRule("refused", "template arguments are not passed", example={"a": 1}),
    "continue_final_message": FieldRule(
        "refused", "continuing the final message is not supported", example=True
    ),
    "tools": FieldRule("refused", "tool-call parsing is not implemented", example=[{"type": "function"}]),
    "tool_choice": FieldRule("refused", "tool-call parsing is not implemented", off="none", example="auto"),
    "parallel_tool_calls": FieldRule(_NA, "without tools there are no tool calls"),
    "separate_reasoning": FieldRule(_NA, "no reasoning parser is configured (as SGLang without one)"),
    "stream_reasoning": FieldRule(_NA, "no reasoning parser is configured (as SGLang without one)"),
    "reasoning_effort": FieldRule("refused", "reasoning control is not supported"),
    "thinking": FieldRule("refused", "reasoning control is not supported", example={"type": "enabled"}),
    "task": FieldRule("refused", "tasks are not supported"),
    "return_meta_info": FieldRule("refused", "meta_info is served by /generate", example=True),
    "return_input_ids_in_sglext": FieldRule(
        "refused", "sglext is not implemented; use return_token_ids", example=True
    ),
    "return_output_ids_in_sglext": FieldRule(
        "refused", "sglext is not implemented; use return_token_ids", example=True
    ),
    **CHAT_WIRE_FIELDS,
    "sampling_logprobs_mode": _from(GENERATE_FIELDS, "sampling_logprobs_mode"),
    "return_flat_raw_output_top_logprobs": _from(GENERATE_FIELDS, "return_flat_raw_output_top_logprobs"),
    "return_flat_raw_top_logprobs_b64": _from(GENERATE_FIELDS, "return_flat_raw_top_logprobs_b64"),
    "max_dynamic_patch": _from(GENERATE_FIELDS, "max_dynamic_patch"),
    "min_dynamic_patch": _from(GENERATE_FIELDS, "min_dynamic_patch"),
    "use_audio_in_video": _from(GENERATE_FIELDS, "use_audio_in_video"),
    "video_config": _from(GENERATE_FIELDS, "video_config"),
    "input_ids": FieldRule("refused", "send messages (or use /v1/completions with token ids)", example=[1]),
}
"""Every field of SGLang's ``ChatCompletionRequest`` (0.5.23), as the torch engine treats it."""


@dataclass(frozen=True)
class OpenAIRequest:
    """A checked /v1 request: the engine items, and what the answer shows."""

    items: list[GenerateItem]
    prompts: int
    samples: int
    top_logprobs: int | None  # None: no logprobs
    return_token_ids: bool
    model: str
    stream: bool = False
    include_usage: bool = False
    min_weight_version: int | None = None
    """mixrl's ``min_weight_version`` (docs/engine.md#version-aware-requests); None: any version."""


_SAMPLING_NAMES = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "no_stop_trim",
    "ignore_eos",
    "skip_special_tokens",
    "n",
)
"""The /v1 fields that are SGLang sampling parameters of the same name."""


def _sampling(body: dict[str, Any], defaults: dict[str, Any], codec: TextCodec, max_tokens: Any) -> Any:
    raw: dict[str, Any] = {name: body[name] for name in _SAMPLING_NAMES if body.get(name) is not None}
    if body.get("seed") is not None:
        raw["sampling_seed"] = body["seed"]
    raw["max_new_tokens"] = max_tokens
    try:
        return parse_sampling("", raw, defaults, codec)
    except RequestError as exc:  # name the OpenAI field, not the sampling_params path
        name = exc.field.lstrip(".")
        name = {"sampling_seed": "seed", "max_new_tokens": "max_tokens"}.get(name, name)
        raise RequestError(name, str(exc).split(": ", 1)[1]) from None


def _prompt_ids(raw: Any, codec: TextCodec, vocab_size: int, context_length: int) -> list[list[int]]:
    if isinstance(raw, str):
        prompts = [codec.encode(unicode_text("prompt", raw))]
    elif isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
        prompts = [codec.encode(unicode_text(f"prompt[{i}]", p)) for i, p in enumerate(raw)]
    elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        prompts = [list(raw)]
    elif isinstance(raw, list) and raw and all(isinstance(p, list) and p for p in raw):
        prompts = [list(p) for p in raw]
    else:
        raise RequestError(
            "prompt", "must be a string, a list of strings, a list of ids or a list of id lists"
        )
    for i, ids in enumerate(prompts):
        if not ids:
            raise RequestError("prompt", f"prompt {i} encodes to no tokens")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise RequestError("prompt", f"prompt {i}: token ids must be integers in [0, {vocab_size})")
        if len(ids) >= context_length:
            raise RequestError(
                "prompt", f"prompt {i} has {len(ids)} tokens; the context length is {context_length}"
            )
    return prompts


def _item_rids(prompts: int, n: int, rid: Any, per_prompt: bool) -> list[str | None]:
    """One id per item (prompt-major, n per prompt).  A string names a single item, or is the
    prefix of ``<rid>_<k>``; with ``per_prompt`` (completions: SGLang's ``rid`` list for a batch of
    prompts) a list gives each prompt its id, ``<id>_<j>`` for its samples when n > 1."""
    if per_prompt and isinstance(rid, list):
        if len(rid) != prompts:
            raise RequestError("rid", f"has {len(rid)} entries for {prompts} prompts")
        for i, one in enumerate(rid):
            if not isinstance(one, str):
                raise RequestError(f"rid[{i}]", "must be a string")
        return [one if n == 1 else f"{one}_{j}" for one in rid for j in range(n)]
    if rid is not None and not isinstance(rid, str):
        raise RequestError(
            "rid", "must be a string" + (" or a list of strings, one per prompt" if per_prompt else "")
        )
    if prompts == 1 and n == 1:
        return [rid]
    return [f"{rid}_{k}" if rid else None for k in range(prompts * n)]


def _items(
    prompts: list[list[int]],
    sampling: Any,
    rid: Any,
    top: int | None,
    token_ids: bool,
    per_prompt: bool = False,
) -> list[GenerateItem]:
    rids = iter(_item_rids(len(prompts), sampling.n, rid, per_prompt))
    items = [
        GenerateItem(
            next(rids),
            ids,
            sampling,
            return_logprob=top is not None,
            top_logprobs_num=top or 0,
            return_prompt_token_ids=token_ids,
        )
        for ids in prompts
        for _ in range(sampling.n)
    ]
    unique_rids(items)
    return items


def _chat_role(field: str, role: str) -> str:
    """``role`` as SGLang hands it to the chat template (see :data:`CHAT_ROLES`); else the
    RequestError naming ``field``."""
    if role == "user":
        return role
    if role.lower() in CHAT_ROLES:
        return role.lower()
    allowed = ", ".join(repr(r) for r in ("user", *CHAT_ROLES))
    raise RequestError(field, f"must be one of {allowed}, got {role!r}")


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(name, f"must be true or false, got {type(value).__name__}")
    return value


def _top(name: str, value: Any, vocab_size: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= vocab_size:
        raise RequestError(name, f"must be an integer in [0, {vocab_size}], got {value!r}")
    return value


def _max_tokens(body: dict[str, Any], default: int) -> Any:
    """``max_completion_tokens`` or ``max_tokens`` as sent (checked as max_new_tokens), else ``default``."""
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    return default if value is None else value


Codec = TypeVar("Codec", bound=TextCodec)


def _opened(
    body: Any, fields: dict[str, FieldRule], text_field: str, codec: Codec | None
) -> tuple[dict[str, Any], Codec]:
    """A /v1 body as a JSON object that asks only what ``fields`` allows, and the tokenizer its
    text (in ``text_field``) needs; else the request's one-line refusal."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    refuse_asked("", body, fields)
    if codec is None:
        raise RequestError(text_field, NO_TOKENIZER)
    return body, codec


def parse_completion(
    body: Any, *, vocab_size: int, context_length: int, defaults: dict[str, Any], codec: TextCodec | None
) -> OpenAIRequest:
    body, codec = _opened(body, COMPLETION_FIELDS, "prompt", codec)
    if body.get("prompt") is None:
        raise RequestError("prompt", "is required")
    prompts = _prompt_ids(body["prompt"], codec, vocab_size, context_length)
    sampling = _sampling(body, defaults, codec, _max_tokens(body, OPENAI_DEFAULT_MAX_TOKENS))
    raw_top = body.get("logprobs")
    top = None if raw_top is None else _top("logprobs", raw_top, vocab_size)
    token_ids = _bool(body, "return_token_ids")
    items = _items(prompts, sampling, body.get("rid"), top, token_ids, per_prompt=True)
    model = str(body.get("model") or "")
    stream, usage = _streaming(body, token_ids)
    minimum = body_min_version(body)
    return OpenAIRequest(items, len(prompts), sampling.n, top, token_ids, model, stream, usage, minimum)


def parse_chat(
    body: Any, *, vocab_size: int, context_length: int, defaults: dict[str, Any], codec: ChatCodec | None
) -> OpenAIRequest:
    body, codec = _opened(body, CHAT_FIELDS, "messages", codec)
    if not codec.has_chat_template:
        raise RequestError("messages", "the tokenizer has no chat template")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty list of messages")
    roles: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}]", "must be an object with a role")
        roles.append(_chat_role(f"messages[{i}].role", message["role"]))
        if not isinstance(message.get("content"), str):
            raise RequestError(
                f"messages[{i}].content", "must be a string (multimodal parts are not supported)"
            )
        unicode_text(f"messages[{i}].content", message["content"])
    ids = codec.chat_ids([{"role": r, "content": m["content"]} for r, m in zip(roles, messages, strict=True)])
    if len(ids) >= context_length:
        raise RequestError("messages", f"render to {len(ids)} tokens; the context length is {context_length}")
    sampling = _sampling(body, defaults, codec, _max_tokens(body, context_length - len(ids)))
    top = None
    if _bool(body, "logprobs"):
        top = _top("top_logprobs", body.get("top_logprobs") or 0, vocab_size)
    elif body.get("top_logprobs"):
        raise RequestError("top_logprobs", "needs logprobs: true")
    token_ids = _bool(body, "return_token_ids") or _bool(body, "return_prompt_token_ids")
    items = _items([ids], sampling, body.get("rid"), top, token_ids)
    model = str(body.get("model") or "")
    stream, usage = _streaming(body, token_ids)
    return OpenAIRequest(items, 1, sampling.n, top, token_ids, model, stream, usage, body_min_version(body))


def _streaming(body: dict[str, Any], token_ids: bool) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``, checked."""
    stream = _bool(body, "stream")
    if stream and token_ids:
        raise RequestError("return_token_ids", "is not supported with streaming (as SGLang's chat)")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise RequestError("stream_options", "must be an object")
    if not stream:
        raise RequestError("stream_options", "needs stream: true")
    if options.get("continuous_usage_stats"):
        raise RequestError("stream_options.continuous_usage_stats", "usage is reported once, at the end")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise RequestError("stream_options.include_usage", "must be true or false")
    return stream, bool(include)


# ---------------------------------------------------------------------------------- answers


def _finish(seq: FinishedTokens) -> tuple[str | None, Any]:
    reason = seq.finish_reason or {}
    return reason.get("type"), reason.get("matched")


def _usage(request: OpenAIRequest, seqs: Sequence[FinishedTokens]) -> dict[str, Any]:
    # prompt tokens once per prompt (SGLang counts a prompt once for its n choices)
    prompt = sum(len(seq.prompt_ids) for seq in seqs[:: request.samples])
    return openai_usage(prompt, sum(len(seq.tokens) for seq in seqs))


def _answer(
    rid: str,
    kind: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The envelope every /v1 answer and chunk shares, in OpenAI's key order (``usage`` last,
    only where given)."""
    answer: dict[str, Any] = {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        answer["usage"] = usage
    return answer


@dataclass(frozen=True)
class _Shown:
    token_id: int
    logprob: float
    cand_ids: list[int]
    cand_logprobs: list[float]


def _top_candidates(tokens: Sequence[TokenRecord], k: int) -> list[_Shown]:
    """Each token with its ``k`` most likely candidates (most likely first, as the record keeps them)."""
    out = []
    for t in tokens:
        order = sorted(range(len(t.cand_ids)), key=lambda i: (-t.cand_logprobs[i], t.cand_ids[i]))[:k]
        out.append(
            _Shown(t.token_id, t.logprob, [t.cand_ids[i] for i in order], [t.cand_logprobs[i] for i in order])
        )
    return out


def _token_entry(codec: TextCodec, token_id: int, logprob: float) -> dict[str, Any]:
    text = codec.token_text(token_id)
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob}


def _chat_logprobs(tokens: Sequence[TokenRecord], k: int, codec: TextCodec) -> list[dict[str, Any]]:
    return [
        {
            **_token_entry(codec, t.token_id, t.logprob),
            "top_logprobs": [
                _token_entry(codec, c, lp) for c, lp in zip(t.cand_ids, t.cand_logprobs, strict=True)
            ],
        }
        for t in _top_candidates(tokens, k)
    ]


def _completion_logprobs(
    tokens: Sequence[TokenRecord], k: int, codec: TextCodec, offset: int
) -> dict[str, Any]:
    texts = [codec.token_text(t.token_id) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": [t.logprob for t in tokens],
        "tokens": texts,
        "top_logprobs": [
            {codec.token_text(c): lp for c, lp in zip(t.cand_ids, t.cand_logprobs, strict=True)}
            if k
            else None
            for t in _top_candidates(tokens, k)
        ],
    }


def _logprobs(
    tokens: Sequence[TokenRecord], k: int, codec: TextCodec, offset: int, *, chat: bool
) -> dict[str, Any]:
    if chat:
        return {"content": _chat_logprobs(tokens, k, codec)}
    return _completion_logprobs(tokens, k, codec, offset)


def response(
    request: OpenAIRequest,
    seqs: Sequence[FinishedTokens],
    codec: TextCodec,
    model: str,
    created: int,
    *,
    chat: bool,
) -> dict[str, Any]:
    """The whole answer: a ``text_completion``, or with ``chat`` a ``chat.completion``."""
    choices = []
    for index, (item, seq) in enumerate(zip(request.items, seqs, strict=True)):
        ids = [t.token_id for t in seq.tokens]
        kind, matched = _finish(seq)
        text = output_text(item, ids, seq.finish_reason, codec)
        body: dict[str, Any] = {"text": text}
        if chat:
            body = {"message": {"role": "assistant", "content": text}}
        choice = {"index": index, **body, "logprobs": None, "finish_reason": kind, "matched_stop": matched}
        if request.top_logprobs is not None:
            choice["logprobs"] = _logprobs(seq.tokens, request.top_logprobs, codec, 0, chat=chat)
        if request.return_token_ids:
            # SGLang's names and order differ between the two answers
            if chat:
                choice["prompt_token_ids"] = list(seq.prompt_ids)
                choice["response_token_ids"] = ids
            else:
                choice["token_ids"] = ids
                choice["prompt_token_ids"] = list(seq.prompt_ids)
        choices.append(choice)
    answer = "chat.completion" if chat else "text_completion"
    return _answer(seqs[0].rid, answer, created, model, choices, usage=_usage(request, seqs))


# ---------------------------------------------------------------------------------- streams


@dataclass
class ChoiceStream:
    """What one choice of a streamed /v1 answer has sent so far."""

    text: str = ""
    tokens: int = 0
    started: bool = False
    offset: int = 0
    """``text_offset`` of the next token: the sent tokens' texts end to end, as the whole answer
    counts them (the sent text itself can be shorter, while text is held back)."""


REPLACEMENT_CHARACTER = "\ufffd"
"""What a token ending inside a multi-byte character decodes to until the rest of it arrives."""


def settled_text(text: str, stops: Sequence[str]) -> str:
    """The part of an unfinished choice's decoded ``text`` that no later token can change.

    Held back: a trailing U+FFFD (the next token may complete its character, and the text would no
    longer start with what was sent), then a complete stop string and everything after it (the
    matcher decodes a tail window, which can differ from the whole text's decoding, and the answer
    is cut before the first match), and any tail a stop string could still complete (the answer is
    cut there if it does).  So what is sent is a prefix of the whole answer's text, however the
    request ends.
    """
    text = text.rstrip(REPLACEMENT_CHARACTER)
    end = len(text)
    for stop in stops:
        found = text.find(stop)
        if found != -1:
            end = min(end, found)
        # the earliest tail that is a proper prefix of the stop string (the longest); only tails
        # starting with its first character are compared
        start = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while start != -1:
            if stop.startswith(text[start:]):
                end = min(end, start)
                break
            start = text.find(stop[0], start + 1)
    return text[:end]


def stream_delta(text: str, sent: str, *, finished: bool, stops: Sequence[str]) -> str:
    """The text a chunk adds after ``sent``, given the choice's text so far (``output_text``: for a
    finished choice the whole answer's text, cut before a matched stop).

    An unfinished choice sends only :func:`settled_text`; its last chunk sends the rest, so the
    deltas add up to the whole answer's text.  (Only a tokenizer whose decoding rewrites earlier
    characters when more tokens follow, other than completing a U+FFFD, could break that: its
    last chunk then carries what follows the longest common prefix.)
    """
    target = text if finished else settled_text(text, stops)
    if target.startswith(sent):
        return target[len(sent) :]
    if not finished:
        return ""  # cannot be retracted: wait for the last chunk
    common = 0
    for a, b in zip(sent, target, strict=False):
        if a != b:
            break
        common += 1
    return target[common:]


def _delta(item: GenerateItem, seq: FinishedTokens, sent: ChoiceStream, codec: TextCodec) -> str:
    """The text this chunk adds (:func:`stream_delta`), recorded as sent."""
    text = output_text(item, [t.token_id for t in seq.tokens], seq.finish_reason, codec)
    finished = seq.finish_reason is not None
    delta = stream_delta(text, sent.text, finished=finished, stops=item.sampling.stop)
    sent.text += delta
    return delta


def stream_chunk(
    request: OpenAIRequest,
    index: int,
    seq: FinishedTokens,
    sent: ChoiceStream,
    codec: TextCodec,
    model: str,
    created: int,
    *,
    chat: bool,
) -> dict[str, Any]:
    """One chunk of choice ``index`` with the text and log-probs since the last: a
    ``text_completion`` chunk, or with ``chat`` a ``chat.completion.chunk`` (the role first, then
    content deltas)."""
    new = list(seq.tokens[sent.tokens :])
    kind, matched = _finish(seq)
    text = _delta(request.items[index], seq, sent, codec)
    logprobs: dict[str, Any] | None = None
    if request.top_logprobs is not None and new:
        logprobs = _logprobs(new, request.top_logprobs, codec, sent.offset, chat=chat)
    sent.tokens += len(new)
    sent.offset += sum(len(codec.token_text(t.token_id)) for t in new)
    body: dict[str, Any] = {"text": text}
    if chat:
        body = {"delta": {"content": text} if sent.started else {"role": "assistant", "content": text}}
        sent.started = True
    choice = {"index": index, **body, "logprobs": logprobs, "finish_reason": kind, "matched_stop": matched}
    chunk = "chat.completion.chunk" if chat else "text_completion"
    return _answer(seq.rid, chunk, created, model, [choice])


def usage_chunk(
    request: OpenAIRequest, seqs: Sequence[FinishedTokens], kind: str, model: str, created: int
) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    return _answer(seqs[0].rid, kind, created, model, [], usage=_usage(request, seqs))


def models_response(
    served_model_name: str, model_path: str, context_length: int, created: int
) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": served_model_name,
                "object": "model",
                "created": created,
                "owned_by": "mixrl",
                "root": model_path,
                "parent": None,
                "max_model_len": context_length,
            }
        ],
    }
