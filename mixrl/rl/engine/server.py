"""``mixrl engine``: the torch engine as an HTTP server speaking SGLang's native API.

Endpoints and fields are listed in docs/engine.md.  Errors: a known request field with a wrong type
or value gets HTTP 400 and ``{"error": {"message": "<field>: <reason>", "param": "<field>", ...}}``;
unknown fields are ignored, as SGLang does; the server keeps serving either way.  A body over
``--max-request-mib`` gets 413.

Version-aware requests (docs/engine.md#version-aware-requests): a ``/generate`` or ``/v1`` request
that demands a newer weight version than the engine serves (``min_weight_version`` in the body,
``X-Mixrl-Min-Weight-Version`` as a header) gets a retryable 409 naming both versions, with
``Retry-After``, after its other fields have been checked.

Authentication (docs/auth.md): with a token, every endpoint that changes the engine's state (weight
updates and versions, pause / continue, aborts, cache flushes) needs ``Authorization: Bearer
<token>`` and answers 401 without it; generation, information, health and metrics stay open.

A client that disconnects has its handler cancelled (aiohttp's ``handler_cancellation``, off by
default): the scheduler then aborts its sequences before the next decode step, so nothing is
generated for nobody.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from aiohttp import web

from mixrl.api.sampling import SamplingRule
from mixrl.rl.activation_quant import ACTIVATION_MODES
from mixrl.rl.auth import (
    AuthConfigError,
    AuthToken,
    add_auth_arguments,
    auth_middlewares,
    refusal_counter,
    token_from_args,
    warn_if_open,
)
from mixrl.rl.engine import openai_api, weight_broadcast
from mixrl.rl.engine.attention import ATTENTION_BACKENDS
from mixrl.rl.engine.kv_cache import KV_CACHE_DTYPES
from mixrl.rl.engine.protocol import (
    SSE_DONE,
    GenerateItem,
    RequestError,
    SamplingRequest,
    build_response,
    parse_generate,
    sse_event,
    stream_chunk,
    unique_rids,
)
from mixrl.rl.engine.scheduler import PAUSE_MODES
from mixrl.rl.engine.service import COMPUTE_DTYPES, ConfigError, EngineConfig, EngineService, engine_rid
from mixrl.rl.engine.staging import PREPARERS
from mixrl.rl.engine.text import TokenizerError
from mixrl.rl.engine.version_gate import (
    CONFLICT,
    header_min_version,
    parse_version,
    refusal_body,
    request_min_version,
    retry_after_headers,
    satisfies,
    strictest,
)
from mixrl.rl.quant import ACTIVATION_SCHEMES, WEIGHT_FORMATS
from mixrl.rl.serving import serve_app

log = logging.getLogger("mixrl.engine")

SERVICE_KEY = web.AppKey("service", EngineService)
RIDS_KEY = web.AppKey("rids_in_flight", set[str])
"""The request ids clients gave the requests running now (:func:`_claimed`)."""
HEALTH_GENERATE_TIMEOUT_S = 20.0
HEALTH_RECENT_TOKEN_S = 5.0
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_ROUTES = frozenset(
    {
        ("POST", "/generate"),
        ("GET", "/get_weight_version"),
        ("GET", "/get_model_info"),
        ("GET", "/model_info"),
        ("GET", "/get_server_info"),
        ("GET", "/server_info"),
        ("GET", "/health"),
        ("GET", "/health_generate"),
        ("GET", "/metrics"),
        ("GET", "/get_load"),
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
    }
)
"""Routes that answer without the run's token: they read or generate, and change no state.
Everything else (including ``GET /flush_cache``, which acts) needs it."""


def _bad_request(exc: RequestError) -> web.Response:
    return web.json_response(exc.to_json(), status=exc.status)


async def _json_body(request: web.Request, allow_empty: bool = False) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestError("body", "a JSON object is required")
    try:
        body = json.loads(raw)
    except RecursionError:  # the decoder recurses per nesting level; 100,000 '[' would exhaust it
        raise RequestError("body", "is not valid JSON (nested too deeply)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError("body", f"is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    return body


def _version_refusal(service: EngineService, minimum: int | None) -> web.Response | None:
    """The retryable 409 for a request demanding newer weights than these (None: serve it).

    Checked once, when the request arrives: a swap while it runs only makes later tokens newer
    (docs/engine.md#version-aware-requests), and each token carries its own version anyway."""
    served = service.weight_version
    if satisfies(served, minimum):
        return None
    assert minimum is not None
    return web.json_response(
        refusal_body(minimum, served, "the engine"), status=CONFLICT, headers=retry_after_headers()
    )


def _field(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise RequestError(name, f"must be a {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


@contextlib.contextmanager
def _claimed(app: web.Application, items: list[GenerateItem]) -> Iterator[None]:
    """Hold the ids a request's items were given while it runs; RequestError naming ``rid`` when
    one is already in flight (SGLang: "Duplicate request ID detected").  Two requests of one id
    would both be aborted by ``/abort_request``, which aborts every match; the first must end (or
    be aborted) before its id is used again."""
    in_flight = app[RIDS_KEY]
    rids = unique_rids(items)
    busy = sorted(in_flight.intersection(rids))
    if busy:
        raise RequestError(
            "rid", f"{', '.join(map(repr, busy))} already in flight; every request needs its own id"
        )
    in_flight.update(rids)
    try:
        yield
    finally:
        in_flight.difference_update(rids)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as exc:
        return _bad_request(exc)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SERVICE_KEY].config.max_request_mib
        too_large = RequestError("body", f"larger than {limit} MiB (--max-request-mib)", status=413)
        return _bad_request(too_large)


# ----------------------------------------------------------------------------------- handlers


async def generate(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    body = await _json_body(request)
    items, batched = parse_generate(
        body,
        vocab_size=service.vocab_size,
        context_length=service.context_length,
        sampling_defaults=service.sampling_defaults,
        codec=service.codec,
    )
    refused = _version_refusal(service, request_min_version(body, request.headers))
    if refused is not None:
        return refused
    with _claimed(request.app, items):
        if items and items[0].stream:
            return await _stream(request, service, items, batched)
        results = await service.generate(items)
    return web.json_response(results if batched else results[0])


def _until_the_client_leaves() -> contextlib.suppress:
    """A stream's writes, ended quietly when its client has gone.  A client that leaves between two
    chunks can make a write fail ("Cannot write to closing transport") before aiohttp cancels the
    handler; that is the same routine departure as the cancellation (the stream's ``finally`` has
    aborted its items), not a server error to log with a traceback."""
    return contextlib.suppress(ConnectionResetError)


async def _stream(
    request: web.Request, service: EngineService, items: list[GenerateItem], batched: bool
) -> web.StreamResponse:
    """SGLang's stream: one ``data: {...}`` event per chunk (the cumulative response; ``index`` in a
    batch), then ``data: [DONE]``.  A client that goes away cancels this handler, which closes the
    stream and aborts the items still running."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    chunks = service.stream(items)
    with _until_the_client_leaves():
        try:
            async for index, snapshot in chunks:
                chunk = build_response(items[index], snapshot, snapshot.e2e_latency, service.codec)
                await response.write(sse_event(stream_chunk(chunk, index if batched else None)))
        finally:
            await chunks.aclose()
        await response.write(SSE_DONE)
        await response.write_eof()
    return response


async def get_load(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE_KEY].load())


def _openai_args(service: EngineService) -> dict[str, Any]:
    return {
        "vocab_size": service.vocab_size,
        "context_length": service.context_length,
        "defaults": service.sampling_defaults,
        "codec": service.codec,
    }


async def v1_models(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    return web.json_response(
        openai_api.models_response(
            service.served_model_name, service.model_path, service.context_length, int(time.time())
        )
    )


async def _v1(request: web.Request, chat: bool) -> web.StreamResponse:
    """/v1/completions or /v1/chat/completions: the whole answer, or with ``stream`` its chunks as
    server-sent events (one per step of a choice, then the usage if asked, then ``[DONE]``)."""
    service = request.app[SERVICE_KEY]
    parse = openai_api.parse_chat if chat else openai_api.parse_completion
    parsed = parse(await _json_body(request), **_openai_args(service))
    minimum = strictest(parsed.min_weight_version, header_min_version(request.headers))
    refused = _version_refusal(service, minimum)
    if refused is not None:
        return refused
    with _claimed(request.app, parsed.items):
        return await _v1_answer(request, service, parsed, chat)


async def _v1_answer(
    request: web.Request, service: EngineService, parsed: openai_api.OpenAIRequest, chat: bool
) -> web.StreamResponse:
    """The answer to a checked ``/v1`` request: whole, or streamed (see :func:`_v1`)."""
    codec = service.codec
    assert codec is not None  # the parsers refuse requests without a tokenizer
    model, created = parsed.model or service.served_model_name, int(time.time())
    if not parsed.stream:
        seqs = await service.run(parsed.items)
        return web.json_response(openai_api.response(parsed, seqs, codec, model, created, chat=chat))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    sent = [openai_api.ChoiceStream() for _ in parsed.items]
    last: dict[int, Any] = {}
    snapshots = service.stream(parsed.items)
    with _until_the_client_leaves():
        try:
            async for index, snapshot in snapshots:
                last[index] = snapshot
                chunk = openai_api.stream_chunk(
                    parsed, index, snapshot, sent[index], codec, model, created, chat=chat
                )
                await response.write(sse_event(chunk))
        finally:
            await snapshots.aclose()
        if parsed.include_usage:
            kind = "chat.completion.chunk" if chat else "text_completion"
            seqs = [last[i] for i in range(len(parsed.items))]
            await response.write(sse_event(openai_api.usage_chunk(parsed, seqs, kind, model, created)))
        await response.write(SSE_DONE)
        await response.write_eof()
    return response


async def v1_completions(request: web.Request) -> web.StreamResponse:
    return await _v1(request, chat=False)


async def v1_chat_completions(request: web.Request) -> web.StreamResponse:
    return await _v1(request, chat=True)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    body = await _json_body(request)
    model_path = _field(body, "model_path", str, None)
    if not model_path:
        raise RequestError("model_path", "is required")
    load_format = body.get("load_format")
    if load_format not in (None, "auto", "safetensors"):
        raise RequestError("load_format", f"only 'auto' or 'safetensors' are supported, got {load_format!r}")
    raw_version = body.get("weight_version")
    version = None if raw_version is None else parse_version("weight_version", raw_version)
    abort_all = _field(body, "abort_all_requests", bool, False)
    # checked for type only: every update empties the prefix cache (ModelRunner.weights_changed)
    _field(body, "flush_cache", bool, True)
    ok, message = await service.update_weights_from_disk(model_path, version, abort_all)
    payload = {"success": ok, "message": message, "weight_version": str(service.weight_version)}
    return web.json_response(payload, status=200 if ok else 400)


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": str(request.app[SERVICE_KEY].weight_version)})


async def update_weight_version(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    body = await _json_body(request)
    if body.get("new_version") is None:
        raise RequestError("new_version", "is required")
    version = parse_version("new_version", body["new_version"])
    await service.set_weight_version(version, _field(body, "abort_all_requests", bool, True))
    return web.json_response({"success": True, "message": f"weight version set to {version}"})


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE_KEY].model_info())


async def server_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE_KEY].server_info())


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    """200 when the engine produced a token recently (or is paused on purpose), else after generating one."""
    service = request.app[SERVICE_KEY]
    age = service.stats.last_token_age()
    if service.sched.paused or (age is not None and age < HEALTH_RECENT_TOKEN_S):
        return web.Response(status=200)
    probe = GenerateItem(
        rid=engine_rid("health_generate"),  # never a client's id (engine_rid says why)
        input_ids=[0],
        sampling=SamplingRequest(rule=SamplingRule(temperature=0.0), max_new_tokens=1),
        log_metrics=False,  # as SGLang's health check: not a client's request
    )
    try:
        (seq,) = await asyncio.wait_for(service.run([probe]), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        return web.Response(status=503, text="generation did not finish in time")
    reason = seq.finish_reason or {}
    if reason.get("type") == "abort":
        # A probe the engine aborted (its model step failed: "engine error: …") generated nothing:
        # SGLang answers 503 when its probe fails, and a 200 here kept a broken engine in service.
        return web.Response(status=503, text=f"the probe generated nothing: {reason.get('message', '')}")
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    # SGLang flushes its prefix (radix) cache here; running requests keep their own keys and values.
    service = request.app[SERVICE_KEY]
    await service.sched.control(service.runner.flush_prefix_cache)
    return web.Response(status=200, text="Cache flushed.")


async def pause_generation(request: web.Request) -> web.Response:
    body = await _json_body(request, allow_empty=True)
    mode = _field(body, "mode", str, "abort")
    if mode not in PAUSE_MODES:
        raise RequestError("mode", f"must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    await request.app[SERVICE_KEY].sched.pause(mode)
    return web.json_response({"success": True, "message": f"generation paused ({mode})"})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[SERVICE_KEY].sched.resume()
    return web.json_response({"success": True, "message": "generation continued"})


async def abort_request(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    body = await _json_body(request)
    if _field(body, "abort_all", bool, False):
        service.sched.abort_all("aborted by abort_request")
        return web.json_response({"success": True})
    rid = _field(body, "rid", str, None)
    if not rid:
        raise RequestError("rid", "is required unless abort_all is true")
    return web.json_response(
        {"success": True, "aborted": service.sched.abort(rid, "aborted by abort_request")}
    )


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SERVICE_KEY].stats.exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def build_app(service: EngineService, auth_token: AuthToken | None = None) -> web.Application:
    """The aiohttp application; the service's scheduler starts and stops with it.

    ``auth_token``: the run's token, required on every route outside :data:`OPEN_ROUTES`
    (None: no check, as with ``--insecure-no-auth``).
    """
    app = web.Application(
        # The token is checked first, before a body is read or a field is looked at.
        middlewares=[
            *auth_middlewares(
                auth_token, OPEN_ROUTES, log, refusal_counter(service.stats.registry, "", "engine")
            ),
            _errors,
        ],
        client_max_size=service.config.max_request_mib << 20,
        # Cancel a request's handler when its client disconnects: generate() then aborts the
        # client's sequences instead of decoding them to the end for nobody.
        handler_args={"handler_cancellation": True},
    )
    app[SERVICE_KEY] = service
    app[RIDS_KEY] = set()

    async def lifecycle(app: web.Application):
        service.start()
        yield
        await service.stop()

    app.cleanup_ctx.append(lifecycle)
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_get("/get_weight_version", get_weight_version)
    r.add_post("/update_weight_version", update_weight_version)
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, model_info)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, server_info)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_route("GET", "/flush_cache", flush_cache)
    r.add_route("POST", "/flush_cache", flush_cache)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/abort_request", abort_request)
    r.add_get("/metrics", metrics)
    r.add_get("/get_load", get_load)
    r.add_get("/v1/models", v1_models)
    r.add_post("/v1/completions", v1_completions)
    r.add_post("/v1/chat/completions", v1_chat_completions)
    weight_broadcast.add_routes(app, weight_broadcast.BroadcastReceiver(service), _json_body)
    return app


# ----------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mixrl engine", description="Serve a transformers causal LM with SGLang's native HTTP API."
    )
    p.add_argument("--model-path", required=True, help="Hugging Face model directory (local)")
    p.add_argument(
        "--weight-precision", choices=WEIGHT_FORMATS, default="bf16", help="emulated weight format"
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=(*KV_CACHE_DTYPES, "auto", "fp8_e4m3"),
        default="bf16",
        help="KV-cache format: bf16 (= SGLang auto) or fp8 (= SGLang fp8_e4m3, emulated)",
    )
    p.add_argument("--dtype", choices=tuple(COMPUTE_DTYPES), default="float32", help="compute dtype")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port to this file once serving")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--pool", default="default", help="sampler pool name (reported in server_info)")
    p.add_argument("--weight-version", type=int, default=0, help="version of the weights at --model-path")
    p.add_argument("--served-model-name", default="", help="model_name label of the metrics")
    p.add_argument("--context-length", type=int, default=0, help="0: the model's max_position_embeddings")
    p.add_argument("--max-total-tokens", type=int, default=0, help="KV capacity reported by token_usage")
    p.add_argument("--sampling-mask-max-tokens", type=int, default=4096)
    p.add_argument("--random-seed", type=int, default=0, help="seed for requests without sampling_seed")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--disable-kv-cache", action="store_true", help="recompute whole sequences every step")
    p.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache (SGLang's flag)")
    p.add_argument(
        "--prefix-cache-max-tokens",
        type=int,
        default=0,
        help="prefix cache budget in tokens, LRU-evicted (0: --max-total-tokens)",
    )
    p.add_argument(
        "--weight-root",
        default="",
        help="weight updates load only from inside this directory (default: the directory that "
        "holds --model-path, after following links: the weight store when starting from a version)",
    )
    p.add_argument(
        "--max-request-mib", type=int, default=8, help="largest request body in MiB (413 beyond it)"
    )
    p.add_argument("--enable-metrics", action="store_true", help="accepted for SGLang parity; always on")
    p.add_argument(
        "--tokenizer-path",
        default="",
        help="tokenizer for text in and out (default: --model-path, if it holds a Hugging Face tokenizer)",
    )
    p.add_argument(
        "--skip-tokenizer-init", action="store_true", help="token-in/token-out only; text requests get 400"
    )
    p.add_argument(
        "--weight-preparer",
        choices=PREPARERS,
        default="auto",
        help="where a weight update is prepared while decoding: a process of its own, a thread of "
        "the engine, or auto (the process from 256 MiB of parameters)",
    )
    schemes = "; ".join(f"{fmt}: {scheme or 'none'}" for fmt, scheme in ACTIVATION_SCHEMES.items())
    p.add_argument(
        "--activation-quant",
        choices=ACTIVATION_MODES,
        default="auto",
        help="auto: quantize the inputs of the quantized GEMMs as --weight-precision's kernels do, "
        f"W8A8 for fp8 and fp8_channel, W4A4 for mxfp4 and nvfp4 ({schemes}; nvfp4's per-tensor "
        "scale is calibrated once per weight version); off: emulate the weights only",
    )
    p.add_argument(
        "--attention-backend",
        choices=tuple(ATTENTION_BACKENDS),
        default="sdpa",
        help="sdpa: attention in the trainer's order; split_kv: in a serving kernel's (keys in splits "
        "of 64 merged by log-sum-exp, probabilities rounded to --dtype); with --dtype bfloat16 a "
        "BF16 pool differs from its trainer by kernels, as a real one does",
    )
    add_auth_arguments(p)
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default="info",
        help="the engine's log level (any case)",
    )
    return p


FLAGS_SPELLED_OTHERWISE = {
    "kv_cache_dtype": "--kv-cache-dtype",
    "use_kv_cache": "--disable-kv-cache",
    "radix_cache": "--disable-radix-cache",
}
"""The EngineConfig fields whose flags take SGLang's spelling or values (each field's flag); every
other field is the flag of its own name, so a field and its flag are declared once each and meet
here by name."""


def flag_of(field: str) -> str:
    """The command-line flag that sets the EngineConfig field ``field``."""
    return FLAGS_SPELLED_OTHERWISE.get(field, "--" + field.replace("_", "-"))


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config the flags describe; a bad value is a :class:`ConfigError` naming its flag."""
    kv = {"auto": "bf16", "fp8_e4m3": "fp8"}.get(args.kv_cache_dtype, args.kv_cache_dtype)
    same_named = {
        f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name not in FLAGS_SPELLED_OTHERWISE
    }
    try:
        return EngineConfig(
            **same_named,
            kv_cache_dtype=kv,
            use_kv_cache=not args.disable_kv_cache,
            radix_cache=not args.disable_radix_cache,
        )
    except ConfigError as exc:
        # the checks live in EngineConfig; on the command line the user knows the flag, not the field
        raise ConfigError(flag_of(exc.field), exc.reason) from None


async def serve(
    service: EngineService,
    host: str,
    port: int,
    port_file: str | None,
    auth_token: AuthToken | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then finish in-flight requests with an abort and exit."""

    def announce(bound: int) -> None:
        log.info(
            "serving %s (weights %s, kv %s, version %d) on http://%s:%d",
            service.model_path,
            service.config.weight_precision,
            service.config.kv_cache_dtype,
            service.weight_version,
            host,
            bound,
        )

    def abort_open_requests() -> None:
        # answer every open request (with an abort reason) before the HTTP server waits for them
        service.sched.abort_all("server shutting down")
        service.sched.resume()

    warn_if_open(auth_token, log, "load weights, pause generation and abort requests")
    await serve_app(
        build_app(service, auth_token),
        host,
        port,
        log=log,
        port_file=Path(port_file) if port_file else None,
        on_listening=announce,
        on_stop=abort_open_requests,
        shutdown_timeout=5.0,
    )
    log.info("stopped")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"mixrl engine: {exc}", file=sys.stderr)
        return 2
    if config.weight_root and not Path(config.weight_root).is_dir():
        print(f"mixrl engine: --weight-root {config.weight_root}: not a directory", file=sys.stderr)
        return 2
    model_dir = Path(config.model_path)
    if not (model_dir / "config.json").is_file():
        why = "no config.json in it" if model_dir.is_dir() else "not a directory"
        print(
            f"mixrl engine: --model-path {config.model_path}: {why} (a local Hugging Face model directory)",
            file=sys.stderr,
        )
        return 2
    try:
        # Before the model loads: a missing token is a one-line refusal, not a minute's wait.
        auth_token = token_from_args(args)
    except AuthConfigError as exc:
        print(f"mixrl engine: {exc}", file=sys.stderr)
        return 2
    if args.torch_threads > 0:
        import torch

        torch.set_num_threads(args.torch_threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        service = EngineService(config)
    except TokenizerError as exc:
        print(f"mixrl engine: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"mixrl engine: cannot load --model-path {config.model_path}: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(service, args.host, args.port, args.port_file, auth_token))
    # Everything is closed; skip the interpreter's teardown of torch and transformers, which takes
    # seconds, so that stopping and restarting an engine is quick.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
