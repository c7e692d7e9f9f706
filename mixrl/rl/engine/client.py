"""One async client for SGLang's native HTTP API: the torch engine and a real SGLang server alike.

Only standard SGLang request fields are sent.  Temperature, top-p and top-k are always sent
explicitly (otherwise SGLang takes them from the model's generation config).  When the sampler
truncates (temperature 0, top-k, top-p or min-p), the client asks for the sampling support
(``return_sampling_mask``) and, with a finite top-k, for at least top-k candidates, so every token
record carries its support S as its leading candidates on either engine.

Authentication: with ``auth_token`` every request carries ``Authorization: Bearer <token>``
(the torch engine's control endpoints need it; SGLang started with ``--api-key`` needs it on all
but ``/health`` and ``/metrics``).

Retries: a request that could not connect is retried with exponential backoff; a connection lost
after sending is retried only for idempotent calls (never ``/generate``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from mixrl.api.trajectory import TokenRecord
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine.records import EngineResponseError, parse_weight_version, token_records
from mixrl.rl.http import SessionClient

log = logging.getLogger(__name__)

__all__ = ["EngineClient", "EngineError", "EngineResponseError", "GenerateResult"]


class EngineError(RuntimeError):
    """The engine answered with an error status, or could not be reached."""

    def __init__(self, message: str, status: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field


@dataclass(frozen=True)
class GenerateResult:
    """One prompt's generation, with a token record per generated token."""

    output_ids: list[int]
    records: list[TokenRecord]
    finish_reason: dict[str, Any]
    weight_version: int
    prompt_tokens: int
    completion_tokens: int
    meta_info: dict[str, Any]

    @property
    def aborted(self) -> bool:
        return (self.finish_reason or {}).get("type") == "abort"


def truncates(temperature: float, top_p: float, top_k: int, min_p: float) -> bool:
    """Whether these sampling parameters sample from a support S rather than the whole vocabulary."""
    return temperature == 0 or top_k > 0 or top_p < 1.0 or min_p > 0.0


class EngineClient(SessionClient):
    """Async client for one engine at ``base_url`` (e.g. ``http://127.0.0.1:30000``)."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession | None = None,
        *,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        auth_token: AuthToken | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        super().__init__(session, auth_token)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s

    def _new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=self._timeout)

    # ------------------------------------------------------------------ transport
    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        idempotent: bool,
        allow: tuple[int, ...] = (),
    ) -> tuple[int, Any]:
        url = f"{self.base_url}{path}"
        for attempt in range(self.retries + 1):
            try:
                async with self._http().request(method, url, json=body, headers=self.headers) as resp:
                    text = await resp.text()
                    status = resp.status
            except aiohttp.ClientConnectorError as exc:
                error: Exception = exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if not idempotent:
                    raise EngineError(f"{method} {path}: connection lost ({exc})") from None
                error = exc
            else:
                payload = _decode(text)
                if status >= 400 and status not in allow:
                    raise _http_error(method, path, status, payload)
                return status, payload
            if attempt == self.retries:
                raise EngineError(f"{method} {path}: cannot reach {self.base_url} ({error})") from None
            await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ generation
    def _generate_body(
        self,
        input_ids: list[int] | list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float,
        stop_token_ids: list[int] | None,
        ignore_eos: bool,
        sampling_seed: int | None,
        top_logprobs_num: int,
        return_sampling_mask: bool | None,
        rid: str | list[str] | None,
    ) -> dict[str, Any]:
        want_mask = (
            truncates(temperature, top_p, top_k, min_p)
            if return_sampling_mask is None
            else return_sampling_mask
        )
        if want_mask and top_k > 0:
            top_logprobs_num = max(top_logprobs_num, top_k)
        sampling: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
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
            "top_logprobs_num": top_logprobs_num,
        }
        if want_mask:
            body["return_sampling_mask"] = True
        if rid is not None:
            body["rid"] = rid
        return body

    async def generate(
        self,
        input_ids: list[int],
        *,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        sampling_seed: int | None = None,
        top_logprobs_num: int = 0,
        return_sampling_mask: bool | None = None,
        rid: str | None = None,
    ) -> GenerateResult:
        """Generate from one prompt; ``return_sampling_mask=None`` asks for it whenever S is truncated."""
        body = self._generate_body(
            input_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            sampling_seed=sampling_seed,
            top_logprobs_num=top_logprobs_num,
            return_sampling_mask=return_sampling_mask,
            rid=rid,
        )
        _, payload = await self._request("POST", "/generate", body, idempotent=False)
        return _result(payload)

    async def generate_batch(self, prompts: list[list[int]], **kwargs: Any) -> list[GenerateResult]:
        """Generate from several prompts in one request (same sampling parameters for all)."""
        if not prompts:
            return []
        rid = kwargs.pop("rid", None)
        body = self._generate_body(
            prompts,
            max_new_tokens=kwargs.pop("max_new_tokens", 128),
            temperature=kwargs.pop("temperature", 1.0),
            top_p=kwargs.pop("top_p", 1.0),
            top_k=kwargs.pop("top_k", -1),
            min_p=kwargs.pop("min_p", 0.0),
            stop_token_ids=kwargs.pop("stop_token_ids", None),
            ignore_eos=kwargs.pop("ignore_eos", False),
            sampling_seed=kwargs.pop("sampling_seed", None),
            top_logprobs_num=kwargs.pop("top_logprobs_num", 0),
            return_sampling_mask=kwargs.pop("return_sampling_mask", None),
            rid=rid,
        )
        if kwargs:
            raise TypeError(f"generate_batch: unexpected arguments {sorted(kwargs)}")
        _, payload = await self._request("POST", "/generate", body, idempotent=False)
        if not isinstance(payload, list) or len(payload) != len(prompts):
            raise EngineResponseError(f"/generate: expected {len(prompts)} results for a batch")
        return [_result(p) for p in payload]

    # ------------------------------------------------------------------ weights
    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: int | None = None,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Ask the engine to load a checkpoint; returns {"success", "message"} (a refusal is not raised)."""
        body: dict[str, Any] = {
            "model_path": model_path,
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        _, payload = await self._request(
            "POST", "/update_weights_from_disk", body, idempotent=True, allow=(400,)
        )
        if not isinstance(payload, dict) or "success" not in payload:
            raise _http_error("POST", "/update_weights_from_disk", 400, payload)
        return payload

    async def get_weight_version(self) -> int:
        _, payload = await self._request("GET", "/get_weight_version", idempotent=True)
        return parse_weight_version(payload.get("weight_version") if isinstance(payload, dict) else None)

    async def update_weight_version(self, version: int, *, abort_all_requests: bool = True) -> None:
        body = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        await self._request("POST", "/update_weight_version", body, idempotent=True)

    # ------------------------------------------------------------------ control
    async def health(self) -> bool:
        """True when /health answers 200 (no retries: a health probe reports what it sees)."""
        try:
            async with self._http().get(f"{self.base_url}/health", headers=self.headers) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def health_generate(self) -> bool:
        status, _ = await self._request("GET", "/health_generate", idempotent=True, allow=(503,))
        return status == 200

    async def wait_healthy(self, timeout_s: float = 60.0, interval_s: float = 0.1) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await self.health():
            if asyncio.get_running_loop().time() > deadline:
                raise EngineError(f"{self.base_url} not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(interval_s)

    async def pause_generation(self, mode: str = "in_place") -> None:
        await self._request("POST", "/pause_generation", {"mode": mode}, idempotent=True)

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {}, idempotent=True)

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache", None, idempotent=True)

    async def get_model_info(self) -> dict[str, Any]:
        _, payload = await self._request("GET", "/get_model_info", idempotent=True)
        return payload

    async def get_server_info(self) -> dict[str, Any]:
        _, payload = await self._request("GET", "/get_server_info", idempotent=True)
        return payload

    async def metrics_text(self) -> str:
        async with self._http().get(f"{self.base_url}/metrics", headers=self.headers) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise EngineError(f"GET /metrics: HTTP {resp.status}", status=resp.status)
            return text

    async def metrics(self) -> dict[str, float]:
        """Scrape /metrics: sample name (colons kept) -> value, summed over label sets."""
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(await self.metrics_text()):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
        return out


def _decode(text: str) -> Any:
    import json

    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return text


def _http_error(method: str, path: str, status: int, payload: Any) -> EngineError:
    field = None
    message = payload if isinstance(payload, str) else ""
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict):
            message = str(err.get("message", ""))
            field = err.get("param")
        else:
            message = str(payload.get("message") or err or payload)
    return EngineError(f"{method} {path}: HTTP {status}: {message}".rstrip(": "), status=status, field=field)


def _result(payload: Any) -> GenerateResult:
    if not isinstance(payload, dict):
        raise EngineResponseError("/generate: expected a JSON object per prompt")
    meta = payload.get("meta_info") or {}
    records = token_records(payload)
    version = records[-1].weight_version if records else parse_weight_version(meta.get("weight_version"))
    return GenerateResult(
        output_ids=list(payload.get("output_ids") or []),
        records=records,
        finish_reason=meta.get("finish_reason") or {},
        weight_version=version,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", len(records))),
        meta_info=meta,
    )
