"""One async client for SGLang's native HTTP API: the torch engine and a real SGLang server alike.

Only standard SGLang request fields are sent; the body and the response are the wire module's
(:func:`mixrl.rl.engine.protocol.generate_body`, :func:`~mixrl.rl.engine.protocol.parse_response`):
every sampling parameter explicit and, when the rule truncates, the sampling support with enough
candidates to hold it, so every token record carries its support S on either engine.

Authentication: with ``auth_token`` every request carries ``Authorization: Bearer <token>``
(the torch engine's control endpoints need it; SGLang started with ``--api-key`` needs it on all
but ``/health`` and ``/metrics``).

Retries: a request that could not connect is retried with exponential backoff; a connection lost
after sending is retried only for idempotent calls (never ``/generate``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from mixrl.api.sampling import SamplingRule
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine.protocol import (
    EngineResponseError,
    GenerateResult,
    generate_body,
    parse_response,
    parse_weight_version,
)
from mixrl.rl.http import HttpError, SessionClient

log = logging.getLogger(__name__)


class EngineError(HttpError):
    """The engine answered with an error status, or could not be reached."""

    def __init__(self, message: str, status: int | None = None, field: str | None = None) -> None:
        super().__init__(message, status)
        self.field = field


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
        super().__init__(base_url, session, auth_token)
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
    async def generate(self, input_ids: list[int], **params: Any) -> GenerateResult:
        """Generate from one prompt; ``params`` are :func:`request_body`'s."""
        body = request_body(input_ids, **params)
        _, payload = await self._request("POST", "/generate", body, idempotent=False)
        return parse_response(payload, request=body)

    async def generate_batch(self, prompts: list[list[int]], **params: Any) -> list[GenerateResult]:
        """Generate from several prompts in one request (same sampling parameters for all)."""
        if not prompts:
            return []
        body = request_body(prompts, **params)
        _, payload = await self._request("POST", "/generate", body, idempotent=False)
        if not isinstance(payload, list) or len(payload) != len(prompts):
            raise EngineResponseError(f"/generate: expected {len(prompts)} results for a batch")
        return [parse_response(p, request=body) for p in payload]

    # ------------------------------------------------------------------ weights
    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: int | None = None,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Ask the engine to load a checkpoint; returns its answer, {"success", "message", ...}.

        An update the engine tried and refused (400 with ``success: false``) is returned, not
        raised; a request it turned away before trying (a bad field: 400 with the
        ``{"error": {...}}`` body; 401; any other HTTP error) raises :class:`EngineError`."""
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

    # SGLang's distributed weight update (mixrl.rl.engine.weight_broadcast has the contract): rank 0
    # broadcasts the tensors; a call the engine took up answers {"success", "message"}, returned
    # also when false (a refusal is not raised); a bad field (400 with the {"error": ...} body), a
    # 401 or any other HTTP error raises EngineError.
    # Never retried once sent: a call sent twice would put the engine out of step with the group.
    async def _weight_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        _, payload = await self._request("POST", path, body, idempotent=False, allow=(400,))
        if not isinstance(payload, dict) or "success" not in payload:
            raise _http_error("POST", path, 400, payload)
        return payload

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Join rank 0's group; answers once every rank has joined (or the engine gave up)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._weight_call("/init_weights_update_group", body)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: int | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """Receive these tensors from rank 0's broadcast; answers once they have arrived (and, for
        the call that completes a version on the torch engine, once it is applied)."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return await self._weight_call("/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self._weight_call("/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> dict[str, Any]:
        """Open the session SGLang 0.5.23 requires around ``update_weights_from_distributed``."""
        return await self._weight_call("/begin_weight_update", {})

    async def end_weight_update(self) -> dict[str, Any]:
        return await self._weight_call("/end_weight_update", {})

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


def request_body(
    input_ids: list[int] | list[list[int]],
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
    rid: str | list[str] | None = None,
) -> dict[str, Any]:
    """The client's parameters as a ``/generate`` body; ``return_sampling_mask=None`` asks for the
    support whenever the parameters truncate."""
    return generate_body(
        input_ids,
        SamplingRule(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p),
        max_new_tokens=max_new_tokens,
        top_logprobs_num=top_logprobs_num,
        return_sampling_mask=return_sampling_mask,
        stop_token_ids=stop_token_ids or (),
        ignore_eos=ignore_eos,
        sampling_seed=sampling_seed,
        rid=rid,
    )


def _decode(text: str) -> Any:
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
