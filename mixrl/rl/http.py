"""The aiohttp session handling shared by our HTTP clients (engine, buffer, router)."""

from __future__ import annotations

from typing import Self

import aiohttp

from mixrl.rl.auth import AuthToken, bearer_headers

RETRY_STATUSES = frozenset({502, 503, 504})
"""Answers that ask for the same request again: a proxy with no server behind it (502, 504) or a
server not able to serve now (503: restarting, a replica moved, the buffer's disk failing)."""


class HttpError(RuntimeError):
    """A server refused a request (``status``: its HTTP status), or could not be reached (None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SessionClient:
    """A client of the server at ``base_url`` (kept without a trailing ``/``, so a path joins it).
    Uses the caller's ``aiohttp.ClientSession``, or opens its own on first use and closes it.

    ``async with Client(url) as client: ...`` closes an owned session on the way out; a session the
    caller passed in stays open (the caller closes it).  Subclasses override ``_new_session`` to set
    timeouts or connection limits.

    ``auth_token``: the run's token, sent as ``Authorization: Bearer …`` with every request (see
    :attr:`headers`), on read-only endpoints too: SGLang's ``--api-key`` protects everything but
    ``/health`` and ``/metrics``, and one client talks to SGLang and mixrl's servers alike.  It goes
    with each request rather than on the session, so a session the caller passed in carries it too.
    """

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession | None = None,
        auth_token: AuthToken | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._owns_session = session is None
        self.headers: dict[str, str] = bearer_headers(auth_token)
        """Headers every request of this client carries (the token's, when there is one)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = self._new_session()
        return self._session
