"""The rollout's client of the session router (or of one engine directly): ``/generate`` per turn.

Every request carries the episode's session id (``X-Mixrl-Session``), so the router keeps the
whole episode on one pool and one replica (its prefix cache).  The body is SGLang's native
``/generate`` body with every sampling parameter explicit; the response is parsed into token
records by the engine package's parser (:func:`mixrl.rl.engine.records.token_records`), which
reads SGLang's fields and mixrl's per-token extras alike.  The pool that served the turn comes
from the router's ``X-Mixrl-Pool`` / ``-Gpu-Type`` / ``-Precision`` headers.

When a session's replica dies the router moves the session and answers 503 (502/504 likewise ask
for a retry): the turn is sent again, unchanged, after a short backoff.  Nothing of the episode
is lost because the context lives here, not in the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from mixrl.api.resolve import SamplingParams
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine.records import EngineResponseError, token_records
from mixrl.rl.http import SessionClient
from mixrl.rl.rollout.agent import Generate, GenerateResult, PoolInfo, TurnFinish

log = logging.getLogger("mixrl.rollout")

SESSION_HEADER = "X-Mixrl-Session"
POOL_HEADER = "X-Mixrl-Pool"
GPU_TYPE_HEADER = "X-Mixrl-Gpu-Type"
PRECISION_HEADER = "X-Mixrl-Precision"
RETRY_STATUSES = frozenset({502, 503, 504})


class RouterError(RuntimeError):
    """The router refused a turn (a bad request), or kept failing past the retry budget."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def generate_body(
    input_ids: list[int], sampling: SamplingParams, max_new_tokens: int, stop_token_ids: list[int]
) -> dict[str, Any]:
    """SGLang's ``/generate`` body for one turn, every sampling parameter explicit."""
    truncated = sampling.top_k > 0 or sampling.top_p < 1.0
    # With a top-k cut, every member of the support must be among the recorded candidates.
    candidates = max(sampling.top_logprobs_num, sampling.top_k) if truncated and sampling.top_k > 0 else None
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "max_new_tokens": max_new_tokens,
            "stop_token_ids": list(stop_token_ids),
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": candidates if candidates is not None else sampling.top_logprobs_num,
    }
    if sampling.return_sampling_mask:
        body["return_sampling_mask"] = True
    return body


def turn_finish(payload: Mapping[str, Any]) -> TurnFinish:
    """SGLang's ``meta_info.finish_reason`` as stop / length / abort."""
    reason = (payload.get("meta_info") or {}).get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind in ("stop", "length", "abort"):
        return kind
    raise EngineResponseError(f"meta_info.finish_reason: unexpected {reason!r}")


def pool_from_headers(headers: Mapping[str, str], default: PoolInfo) -> PoolInfo:
    pool = headers.get(POOL_HEADER)
    if not pool:
        return default
    return PoolInfo(pool, headers.get(GPU_TYPE_HEADER, ""), headers.get(PRECISION_HEADER, ""))


def parse_generate_response(
    payload: Any, headers: Mapping[str, str], default_pool: PoolInfo
) -> GenerateResult:
    if not isinstance(payload, dict):
        raise EngineResponseError("/generate: expected one JSON object for one prompt")
    return GenerateResult(
        token_records(payload), turn_finish(payload), pool_from_headers(headers, default_pool)
    )


class RouterClient(SessionClient):
    """``/generate`` with sessions and retries, against the router (or an engine: same API).

    ``retry_budget_s`` bounds how long one turn keeps retrying 502/503/504 and refused connections
    (a router or replica restarting) before the episode is given up.  ``auth_token``: the run's
    token, sent with every request (ending a session needs it; ``/generate`` is open on the router
    but not on an SGLang engine started with ``--api-key``, which this client may also talk to).
    """

    def __init__(
        self,
        base_url: str,
        sampling: SamplingParams,
        stop_token_ids: list[int],
        *,
        default_pool: PoolInfo | None = None,
        retry_budget_s: float = 120.0,
        backoff_s: float = 0.2,
        max_backoff_s: float = 2.0,
        request_timeout_s: float = 600.0,
        auth_token: AuthToken | None = None,
    ) -> None:
        super().__init__(auth_token=auth_token)
        self.base_url = base_url.rstrip("/")
        self.sampling = sampling
        self.stop_token_ids = list(stop_token_ids)
        self.default_pool = default_pool or PoolInfo()
        self.retry_budget_s = retry_budget_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.retries = 0
        """Turns sent again after a retryable failure (for progress lines and tests)."""

    def _new_session(self) -> aiohttp.ClientSession:
        # one connection per concurrent episode at most; the default limit (100) would queue turns
        return aiohttp.ClientSession(timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0))

    def generator(self, session_id: str) -> Generate:
        """The ``generate`` callable of one episode (its session)."""

        async def generate(input_ids: list[int], max_new_tokens: int) -> GenerateResult:
            return await self.generate(session_id, input_ids, max_new_tokens)

        return generate

    async def generate(self, session_id: str, input_ids: list[int], max_new_tokens: int) -> GenerateResult:
        body = generate_body(input_ids, self.sampling, max_new_tokens, self.stop_token_ids)
        headers = {**self.headers, SESSION_HEADER: session_id}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_budget_s
        delay = self.backoff_s
        while True:
            try:
                async with self._http().post(f"{self.base_url}/generate", json=body, headers=headers) as resp:
                    status = resp.status
                    try:
                        payload = await resp.json(content_type=None)
                    except ValueError:
                        payload = {"error": "answer is not JSON"}
                    if status == 200:
                        return parse_generate_response(payload, resp.headers, self.default_pool)
                    reason = payload.get("error") if isinstance(payload, dict) else payload
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                status, reason = None, f"{type(exc).__name__}: {exc}"
            if status is not None and status not in RETRY_STATUSES:
                raise RouterError(f"POST /generate: HTTP {status}: {reason}", status)
            if loop.time() + delay > deadline:
                raise RouterError(
                    f"POST /generate: still failing after {self.retry_budget_s:.0f}s (last: {status or reason})",
                    status,
                )
            self.retries += 1
            log.debug("session %s: turn failed (%s %s), retrying in %.2fs", session_id, status, reason, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    async def end_session(self, session_id: str) -> None:
        """Tell the router the episode is over (best effort: it also forgets idle sessions)."""
        try:
            async with self._http().post(
                f"{self.base_url}/sessions/{session_id}/end",
                timeout=aiohttp.ClientTimeout(total=5.0),
                headers=self.headers,
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("session %s: end not delivered (%s)", session_id, exc)
