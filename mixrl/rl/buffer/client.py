"""``BufferClient``: the async client the rollout worker and the trainer use to talk to ``mixrl buffer``.

Batches: :meth:`BufferClient.get_batch` is the trainer's call (``POST /batch``: it takes the
batch of the trainer's next step, or returns the one that step already has);
:meth:`BufferClient.read_batch` only reads (``GET /batch``: another rank of the same trainer, a
monitor) and never assigns anything.

Retries: calls that are safe to repeat (batch, commit, stats, evaluations list) are retried with
backoff when the buffer cannot be reached, drops the connection, or answers 502, 503 or 504 (it
may be restarting, and it rebuilds its state from its logs; a proxy in front of it has no buffer
behind it; its disk fails, and it stored nothing of the request), and so are trajectory posts:
the buffer stores a trajectory it already holds once (keyed by prompt and sample index), so a
retry whose first attempt was stored is acknowledged without a second copy.  Any other status (a
401: no token, or not this run's) is never retried.  Posting an evaluation or a quarantine is
retried only when the connection could not be made at all.

How long: a call keeps retrying for ``retry_budget_s`` (:data:`RETRY_BUDGET_S`, five minutes: a
buffer pod rescheduled and replaying its logs), its waits doubling from ``backoff_s`` up to
``max_backoff_s``, like the rollout's RouterClient; then it raises BufferError, one line naming
the last failure (a status with the buffer's or the proxy's message, or the connection's error).
``retries`` caps the number of retries too (tests that want a quick failure pass a small budget or
count).
"""

from __future__ import annotations

import asyncio
import io
import json as jsonlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from mixrl.api.errors import one_line
from mixrl.api.trajectory import Trajectory
from mixrl.rl.auth import AuthToken
from mixrl.rl.buffer.grouping import StalenessStats
from mixrl.rl.health.routing import MismatchReport
from mixrl.rl.http import RETRY_STATUSES, HttpError, SessionClient


class BufferError(HttpError):
    """The buffer refused a request (status 400/409...) or could not be reached."""


@dataclass(frozen=True)
class BatchGroup:
    prompt_id: str
    trajectories: list[Trajectory]
    staleness: list[StalenessStats]
    """Per trajectory, the staleness of its generated tokens at the batch's step."""


@dataclass(frozen=True)
class Batch:
    step: int
    groups: list[BatchGroup]
    staleness: StalenessStats
    """Over every generated token of the batch."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for group in self.groups for t in group.trajectories]

    @staticmethod
    def from_json(payload: Mapping[str, Any]) -> Batch:
        groups = [
            BatchGroup(
                prompt_id=group["prompt_id"],
                trajectories=[Trajectory.model_validate(t) for t in group["trajectories"]],
                staleness=[StalenessStats(**s) for s in group["staleness"]],
            )
            for group in payload["groups"]
        ]
        return Batch(int(payload["step"]), groups, StalenessStats(**payload["staleness"]))


RETRY_BUDGET_S = 300.0
"""How long a call retries a buffer it cannot reach: a buffer pod restarting (rescheduled, its
image pulled, its logs replayed) takes minutes; a trainer that gave up sooner would exit and redo
up to ``checkpointEvery`` − 1 steps."""


class BufferClient(SessionClient):
    """``async with BufferClient("http://127.0.0.1:8100") as buffer: await buffer.get_batch(3)``.

    ``auth_token``: the run's token, sent with every request; the buffer's writes need it.
    ``retry_budget_s``, ``backoff_s``, ``max_backoff_s``, ``retries``: how a call that cannot reach
    the buffer, or is answered 502/503/504, is retried (the module's docstring).
    """

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession | None = None,
        *,
        timeout_s: float = 120.0,
        retry_budget_s: float = RETRY_BUDGET_S,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        retries: int | None = None,
        auth_token: AuthToken | None = None,
    ) -> None:
        super().__init__(base_url, session, auth_token)
        self.timeout_s = timeout_s
        self.retry_budget_s = retry_budget_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.retries = retries

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        idempotent: bool,
        timeout_s: float | None = None,
    ) -> tuple[int, Any]:
        url = f"{self.base_url}{path}"
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        # A group is megabytes of JSON: encoded once, and streamed from a file-like object, which
        # aiohttp sends in chunks (raw bytes of that size would be written in one go, and warned about).
        body = None if json is None else jsonlib.dumps(json).encode()
        headers = dict(self.headers) if body is None else {**self.headers, "Content-Type": "application/json"}
        error: Exception | None = None
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.retry_budget_s
        delay, attempt = self.backoff_s, 0
        while True:
            try:
                async with self._http().request(
                    method,
                    url,
                    data=None if body is None else io.BytesIO(body),
                    params=params,
                    timeout=timeout,
                    headers=headers,
                ) as resp:
                    status = resp.status
                    # aiohttp's own answers (413 for a body over the limit) are plain text.
                    json_answer = resp.content_type == "application/json"
                    payload = (
                        (await resp.json() if json_answer else await resp.text()) if status != 204 else None
                    )
            except aiohttp.ClientConnectorError as exc:  # never connected: nothing was sent
                error = exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                # Sent, and the answer lost: the connection dropped or reset (a buffer pod going
                # away), a body cut short, no answer within the timeout.
                if not idempotent:
                    raise BufferError(
                        f"{method} {path}: connection lost ({exc}); the outcome is unknown"
                    ) from None
                error = exc
            else:
                if status < 400:
                    return status, payload
                # One line: a proxy's answer is an HTML page.
                message = one_line(str(payload.get("error") if isinstance(payload, dict) else payload))
                if status not in RETRY_STATUSES or not idempotent:
                    raise BufferError(f"{method} {path}: {status}: {message}", status)
                # A proxy with no buffer behind it (502, 504) or a buffer that cannot serve now (503:
                # restarting, its disk failing; nothing of the request was stored): like a refused
                # connection, worth another try for a call that is safe to repeat.
                error = BufferError(f"{status}: {message}", status)
            if (self.retries is not None and attempt >= self.retries) or loop.time() + delay > deadline:
                break
            attempt += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)
        spent = f"{attempt + 1} attempts in {loop.time() - started:.1f} s; last: {error}"
        if isinstance(error, BufferError):  # it answered, with a status worth retrying each time
            raise BufferError(
                f"{method} {path}: the buffer at {self.base_url} kept failing ({spent})", error.status
            )
        raise BufferError(f"{method} {path}: cannot reach the buffer at {self.base_url} ({spent})")

    async def post_trajectories(
        self, trajectories: Sequence[Trajectory | Mapping[str, Any]], group: str | None = None
    ) -> int:
        """Log finished trajectories; returns how many groups they completed.

        ``group``: the trajectories are that prompt's whole group, and the buffer refuses them
        otherwise (a stray trajectory cannot complete another prompt's group)."""
        body = [t.model_dump(mode="json") if isinstance(t, Trajectory) else dict(t) for t in trajectories]
        params = None if group is None else {"group": group}
        _, payload = await self._request("POST", "/trajectories", json=body, params=params, idempotent=True)
        return int(payload["groups_completed"])

    async def quarantine(self, step: int, prompt_ids: Sequence[str], reason: str) -> dict[str, Any]:
        """Report the served batch of ``step`` (its groups' ``prompt_ids``) as one the trainer cannot
        train: the buffer takes it back for good and the step's next request gets other groups."""
        body = {"prompt_ids": list(prompt_ids), "reason": reason[:2000]}
        _, payload = await self._request(
            "POST", "/quarantine", json=body, params={"step": str(step)}, idempotent=False
        )
        return dict(payload["quarantined"])

    async def get_batch(self, step: int, timeout: float = 30.0) -> Batch | None:
        """The trainer's batch of ``step`` (the same on every call), or None if not ready within ``timeout`` s.

        ``step`` must be the trainer's next step (the one after the last committed) or a step that
        already has a batch; anything else raises :class:`BufferError` with status 409.
        """
        return await self._batch("POST", step, timeout)

    async def read_batch(self, step: int, timeout: float = 30.0) -> Batch | None:
        """Like :meth:`get_batch` but never assigns groups: None until the trainer has taken the step."""
        return await self._batch("GET", step, timeout)

    async def _batch(self, method: str, step: int, timeout: float) -> Batch | None:
        status, payload = await self._request(
            method,
            "/batch",
            params={"step": str(step), "timeout": str(timeout)},
            idempotent=True,  # a step's batch never changes once assigned: asking again is safe
            timeout_s=timeout + self.timeout_s,
        )
        return None if status == 204 else Batch.from_json(payload)

    async def commit(self, step: int) -> None:
        """Mark the step just served consumed (again for one already committed: a no-op)."""
        await self._request("POST", "/commit", params={"step": str(step)}, idempotent=True)

    async def post_mismatch(self, report: MismatchReport) -> None:
        """One step's per-pool fresh mismatch, for the router's health (a later step replaces it)."""
        await self._request("POST", "/mismatch", json=report.model_dump(), idempotent=True)

    async def post_trainer_record(self, record: Mapping[str, Any]) -> None:
        """One step's metrics record, kept by the buffer after the trainer is gone."""
        await self._request("POST", "/trainer-metrics", json=dict(record), idempotent=True)

    async def stats(self) -> dict[str, Any]:
        _, payload = await self._request("GET", "/stats", idempotent=True)
        return dict(payload)

    async def post_evaluation(
        self, step: int, weight_version: int, pass_at_k: Mapping[int | str, float], **extra: Any
    ) -> None:
        body = {
            "step": step,
            "weight_version": weight_version,
            "pass_at_k": {str(k): v for k, v in pass_at_k.items()},
            **extra,
        }
        await self._request("POST", "/evaluations", json=body, idempotent=False)

    async def evaluations(self) -> list[dict[str, Any]]:
        _, payload = await self._request("GET", "/evaluations", idempotent=True)
        return list(payload["evaluations"])
