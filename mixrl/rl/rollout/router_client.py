"""The rollout's client of the session router (or of one engine directly): ``/generate`` per turn.

Every request carries the episode's session id (``X-Mixrl-Session``), so the router keeps the
whole episode on one pool and one replica (its prefix cache).  Body and response are the wire
module's (:mod:`mixrl.rl.engine.protocol`): SGLang's native ``/generate`` body with every sampling
parameter explicit, and a response read into token records together with the pool that served the
turn (the router's ``X-Mixrl-Pool`` / ``-Gpu-Type`` / ``-Precision`` headers).

When the body asks for the sampling support (``return_sampling_mask``, a truncating rule) and
the answer has none, the turn fails with :class:`~mixrl.rl.engine.protocol.SamplingMaskMissing`
naming the field: a proxy dropped it (sglang-router 0.3.2 does) or the engine cannot answer it, and
records without their support would read as an untruncated rule.  The worker stops on it.

When a session's replica dies the router moves the session and answers 503 (502/504 likewise ask
for a retry): the turn is sent again, unchanged, after a short backoff.  Nothing of the episode
is lost because the context lives here, not in the engine.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from mixrl.api.resolve import SamplingParams
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine.protocol import SESSION_HEADER, GenerateResult, PoolInfo, generate_body, parse_response
from mixrl.rl.http import SessionClient
from mixrl.rl.rollout.agent import Generate

log = logging.getLogger("mixrl.rollout")

RETRY_STATUSES = frozenset({502, 503, 504})


class RouterError(RuntimeError):
    """The router refused a turn (a bad request), or kept failing past the retry budget."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


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

    def request_body(self, input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        """One turn's ``/generate`` body: the run's sampling, the tokenizer's stop tokens."""
        return generate_body(
            list(input_ids),
            self.sampling.rule,
            max_new_tokens=max_new_tokens,
            top_logprobs_num=self.sampling.top_logprobs_num,
            return_sampling_mask=self.sampling.return_sampling_mask,
            stop_token_ids=self.stop_token_ids,
        )

    async def generate(self, session_id: str, input_ids: list[int], max_new_tokens: int) -> GenerateResult:
        body = self.request_body(input_ids, max_new_tokens)
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
                        # request=body: an answer without the support it asked for is an error
                        # (SamplingMaskMissing), never records that look untruncated
                        return parse_response(payload, resp.headers, self.default_pool, request=body)
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
