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

A turn may demand a minimum weight version (``X-Mixrl-Min-Weight-Version``; the worker sets it
from ``algorithm.maxStaleness``, docs/api.md#bounded-staleness).  The router or the engine
answers 409 while no replica serves it: the turn waits for the weights, backing off from the
answer's ``Retry-After``, for at most ``version_wait_s``; such waits are counted apart
(``version_waits``), never as a failing replica, and logged once per turn.  A turn still refused
after that raises :class:`VersionUnavailable` (its episode is dropped with its group).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from mixrl.api.resolve import SamplingParams
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine.protocol import SESSION_HEADER, GenerateResult, PoolInfo, generate_body, parse_response
from mixrl.rl.engine.version_gate import CONFLICT, MIN_VERSION_HEADER, VersionRefusal
from mixrl.rl.http import RETRY_STATUSES, HttpError, SessionClient
from mixrl.rl.rollout.agent import Generate

log = logging.getLogger("mixrl.rollout")

MinVersion = Callable[[], int | None]
"""The minimum weight version of an episode's next turn, asked when the turn starts (None: any)."""


class RouterError(HttpError):
    """The router refused a turn (a bad request), or kept failing past the retry budget."""


class VersionUnavailable(RouterError):
    """No replica reached the turn's minimum weight version within the client's ``version_wait_s``."""


@dataclass(frozen=True)
class _Answer:
    """One attempt's outcome: an HTTP status (None: no answer), its JSON and headers, or why not."""

    status: int | None
    payload: Any
    headers: Mapping[str, str]
    reason: Any


class RouterClient(SessionClient):
    """``/generate`` with sessions and retries, against the router (or an engine: same API).

    ``retry_budget_s`` bounds how long one turn keeps retrying 502/503/504 and refused connections
    (a router or replica restarting) before the episode is given up; ``version_wait_s`` how long
    it waits for weights of its minimum version (409s), backing off from ``Retry-After`` up to
    ``max_version_backoff_s``.  ``auth_token``: the run's
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
        version_wait_s: float = 600.0,
        max_version_backoff_s: float = 4.0,
    ) -> None:
        super().__init__(base_url, auth_token=auth_token)
        self.sampling = sampling
        self.stop_token_ids = list(stop_token_ids)
        self.default_pool = default_pool or PoolInfo()
        self.retry_budget_s = retry_budget_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.version_wait_s = version_wait_s
        self.max_version_backoff_s = max_version_backoff_s
        self.retries = 0
        """Turns sent again after a retryable failure (for progress lines and tests)."""
        self.version_waits = 0
        """Turns sent again after a 409 for their minimum weight version (not failures)."""
        self.versions_unavailable = 0
        """Turns given up after ``version_wait_s`` of 409s."""

    def _new_session(self) -> aiohttp.ClientSession:
        # one connection per concurrent episode at most; the default limit (100) would queue turns
        return aiohttp.ClientSession(timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0))

    def generator(self, session_id: str, min_version: MinVersion | None = None) -> Generate:
        """The ``generate`` callable of one episode (its session); ``min_version`` gives each turn's
        minimum weight version when the turn starts."""

        async def generate(input_ids: list[int], max_new_tokens: int) -> GenerateResult:
            minimum = min_version() if min_version is not None else None
            return await self.generate(session_id, input_ids, max_new_tokens, minimum)

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

    async def generate(
        self, session_id: str, input_ids: list[int], max_new_tokens: int, min_version: int | None = None
    ) -> GenerateResult:
        body = self.request_body(input_ids, max_new_tokens)
        headers = {**self.headers, SESSION_HEADER: session_id}
        if min_version is not None:
            headers[MIN_VERSION_HEADER] = str(min_version)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_budget_s
        version_deadline = loop.time() + self.version_wait_s
        delay, version_delay = self.backoff_s, 0.0
        while True:
            answer = await self._attempt(body, headers)
            if answer.status == 200:
                # request=body: an answer without the support it asked for is an error
                # (SamplingMaskMissing), never records that look untruncated
                return parse_response(answer.payload, answer.headers, self.default_pool, request=body)
            refusal = (
                VersionRefusal.read(answer.payload, answer.headers) if answer.status == CONFLICT else None
            )
            if refusal is not None:
                version_delay = self._version_backoff(session_id, refusal, version_delay, version_deadline)
                await asyncio.sleep(version_delay)
                deadline += version_delay  # waiting for weights spends none of the failure budget
                continue
            if answer.status is not None and answer.status not in RETRY_STATUSES:
                raise RouterError(f"POST /generate: HTTP {answer.status}: {answer.reason}", answer.status)
            if loop.time() + delay > deadline:
                raise RouterError(
                    f"POST /generate: still failing after {self.retry_budget_s:.0f}s "
                    f"(last: {answer.status or answer.reason})",
                    answer.status,
                )
            self.retries += 1
            log.debug(
                "session %s: turn failed (%s %s), retrying in %.2fs",
                session_id,
                answer.status,
                answer.reason,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    async def _attempt(self, body: dict[str, Any], headers: dict[str, str]) -> _Answer:
        """One POST /generate: the answer, or the connection's failure as its reason."""
        try:
            async with self._http().post(f"{self.base_url}/generate", json=body, headers=headers) as resp:
                try:
                    payload = await resp.json(content_type=None)
                except ValueError:
                    payload = {"error": "answer is not JSON"}
                reason = payload.get("error") if isinstance(payload, dict) else payload
                return _Answer(resp.status, payload, resp.headers, reason)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            # Refused, dropped, or cut mid-answer (a router restarting): each worth another try.
            return _Answer(None, None, {}, f"{type(exc).__name__}: {exc}")

    def _version_backoff(
        self, session_id: str, refusal: VersionRefusal, previous: float, deadline: float
    ) -> float:
        """How long to wait before asking again for weights the replicas do not serve yet: the
        answer's ``Retry-After`` at first, then doubling up to ``max_version_backoff_s``.  Raises
        VersionUnavailable once waiting longer would pass ``version_wait_s``."""
        first = refusal.retry_after_s if refusal.retry_after_s is not None else self.backoff_s
        wait = min(max(first, previous * 2), self.max_version_backoff_s)
        served = "unknown" if refusal.served is None else f"v{refusal.served}"
        if asyncio.get_running_loop().time() + wait > deadline:
            self.versions_unavailable += 1
            message = (
                f"POST /generate: no replica served weight version {refusal.minimum} or newer "
                f"within {self.version_wait_s:.0f}s (newest: {served})"
            )
            log.warning("session %s: %s", session_id, message)
            raise VersionUnavailable(message, CONFLICT)
        if previous == 0.0:
            log.info(
                "session %s: waiting for weights of version %s or newer (served: %s)",
                session_id,
                refusal.minimum,
                served,
            )
        self.version_waits += 1
        return wait

    async def end_session(self, session_id: str) -> None:
        """Tell the router the episode is over (best effort: it also forgets idle sessions)."""
        try:
            async with self._http().post(
                f"{self.base_url}/sessions/{session_id}/end",
                timeout=aiohttp.ClientTimeout(total=5.0),
                headers=self.headers,
            ) as resp:
                await resp.read()
                if resp.status == 401:  # a wrong token fails every turn too; say it here as well
                    log.warning(
                        "session %s: end refused: 401 (the router does not take this token)", session_id
                    )
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("session %s: end not delivered (%s)", session_id, exc)
