"""The run's bearer token: where components read it, how servers check it, how clients send it.

Every state-changing endpoint of the engine, the router and the buffer needs
``Authorization: Bearer <token>`` with the run's token (docs/auth.md lists which endpoints are open).
The token comes from ``--auth-token-file PATH`` (in a cluster: a mounted Secret; ``mixrl run``
writes one per run) or, without that flag, from ``$MIXRL_AUTH_TOKEN``.  A component given neither
refuses to start unless ``--insecure-no-auth`` says that running open is intended.

The token lives in an :class:`AuthToken`, whose ``repr`` and ``str`` hide it: a token that ends up
in a log line, an exception or a dataclass's repr shows as ``<hidden>``.  Only
:func:`bearer_headers` and the server check call :meth:`AuthToken.reveal`.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry

from mixrl.rl.metrics import MIXRL_AUTH_REFUSED_TOTAL, counter

TOKEN_ENV: Final = "MIXRL_AUTH_TOKEN"
TOKEN_FILE_FLAG: Final = "--auth-token-file"
INSECURE_FLAG: Final = "--insecure-no-auth"
MIN_TOKEN_CHARS: Final = 16
"""Shorter tokens are guessable; ``mixrl run`` writes 43 characters (32 random bytes)."""
MAX_TOKEN_CHARS: Final = 4096
"""A header carries a few KiB at most (aiohttp's limit is 8 KiB per field)."""

# RFC 6750's b64token: the characters a bearer token may carry in an Authorization header.
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] +(\S+) *")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Route = tuple[str, str]
"""(HTTP method, the route's path as registered, e.g. ``/sessions/{session}/end``)."""


class AuthConfigError(ValueError):
    """A token flag or source that cannot be used; the message is one line and never holds the token."""


class AuthToken:
    """The run's token; printing it shows ``AuthToken(<hidden>)``, never the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def matches(self, candidate: str) -> bool:
        """Constant-time comparison: the time taken says nothing about how much of a guess was right."""
        return hmac.compare_digest(candidate.encode("utf-8", "surrogateescape"), self._value.encode())

    def __repr__(self) -> str:
        return "AuthToken(<hidden>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AuthToken) and self.matches(other._value)

    def __hash__(self) -> int:
        return hash(AuthToken)  # equal tokens must hash alike; the value itself is not hashed


def parse_token(raw: str, source: str) -> AuthToken:
    """A token read from ``source`` (named in errors), surrounding whitespace removed.

    Kubernetes Secrets made with ``kubectl create secret --from-file`` often end in a newline,
    which is not part of the token.
    """
    value = raw.strip()
    if not value:
        raise AuthConfigError(f"{source}: empty (expected the run's token)")
    if len(value) < MIN_TOKEN_CHARS:
        raise AuthConfigError(f"{source}: the token is shorter than {MIN_TOKEN_CHARS} characters")
    if len(value) > MAX_TOKEN_CHARS:
        raise AuthConfigError(f"{source}: the token is longer than {MAX_TOKEN_CHARS} characters")
    if not _B64TOKEN.fullmatch(value):
        raise AuthConfigError(
            f"{source}: the token holds characters a bearer token cannot carry "
            "(allowed: letters, digits, - . _ ~ + / and trailing =)"
        )
    return AuthToken(value)


def read_token_file(path: Path) -> AuthToken:
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise AuthConfigError(f"{TOKEN_FILE_FLAG} {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise AuthConfigError(f"{TOKEN_FILE_FLAG} {path}: not UTF-8 text") from None
    return parse_token(raw, f"{TOKEN_FILE_FLAG} {path}")


def write_token_file(path: Path, token: AuthToken) -> None:
    """Write ``token`` to ``path`` readable by its owner only (0600), replacing what was there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the mode above applies only when the file is new
        os.write(fd, (token.reveal() + "\n").encode())
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------- command line


def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    """``--auth-token-file`` and ``--insecure-no-auth``; :func:`token_from_args` reads them."""
    parser.add_argument(
        TOKEN_FILE_FLAG,
        dest="auth_token_file",
        type=Path,
        default=None,
        help=f"file holding the run's bearer token (a mounted Secret); default: the token itself in ${TOKEN_ENV}",
    )
    parser.add_argument(
        INSECURE_FLAG,
        dest="insecure_no_auth",
        action="store_true",
        help="run without a token: anyone who reaches the port can change state (tests, debugging)",
    )


def token_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> AuthToken | None:
    """The token named by the flags (else ``$MIXRL_AUTH_TOKEN``); None with ``--insecure-no-auth``.

    Checked when a component starts, not when its flags are parsed, so a command line without
    either still parses (``--help``, the operator's builder tests).  Flags win over the
    environment: a token exported in a shell never overrides the file ``mixrl run`` passes.
    """
    environ = os.environ if environ is None else environ
    if args.insecure_no_auth:
        if args.auth_token_file is not None:
            raise AuthConfigError(f"{INSECURE_FLAG}: contradicts {TOKEN_FILE_FLAG}; give one of them")
        return None
    if args.auth_token_file is not None:
        return read_token_file(args.auth_token_file)
    if environ.get(TOKEN_ENV) is not None:
        return parse_token(environ[TOKEN_ENV], f"${TOKEN_ENV}")
    raise AuthConfigError(
        f"no auth token: give {TOKEN_FILE_FLAG} PATH or set {TOKEN_ENV} "
        f"({INSECURE_FLAG} runs without one, open to anyone who reaches the port)"
    )


def warn_if_open(token: AuthToken | None, log: logging.Logger, what: str) -> None:
    """One WARNING line when a component runs without a token, so an open server is never silent."""
    if token is None:
        log.warning("authentication is off (%s): anyone who can reach it can %s", INSECURE_FLAG, what)


# ----------------------------------------------------------------------------------- clients


def bearer_headers(token: AuthToken | None) -> dict[str, str]:
    """The header a client sends with every request (none without a token)."""
    return {} if token is None else {"Authorization": f"Bearer {token.reveal()}"}


# ----------------------------------------------------------------------------------- servers


class _RefusalLog:
    """Refused requests logged at most once per ``interval_s``, with a count of the ones in between.

    A caller without the token may retry in a loop; one line per refusal would flood the log.
    """

    def __init__(self, log: logging.Logger, interval_s: float = 10.0) -> None:
        self.log = log
        self.interval_s = interval_s
        self.last = -float("inf")
        self.suppressed = 0

    def refused(self, request: web.Request, why: str) -> None:
        now = time.monotonic()
        if now - self.last < self.interval_s:
            self.suppressed += 1
            return
        more = f" ({self.suppressed} more refused since the last report)" if self.suppressed else ""
        self.last, self.suppressed = now, 0
        self.log.warning(
            "refused %s %s from %s: %s%s", request.method, request.path, request.remote, why, more
        )


def unauthorized(message: str, invalid_token: bool) -> web.Response:
    """401 with SGLang's shape (``{"error": ...}``) and RFC 6750's challenge."""
    challenge = 'Bearer realm="mixrl"' + (', error="invalid_token"' if invalid_token else "")
    return web.json_response({"error": message}, status=401, headers={"WWW-Authenticate": challenge})


def refusal_counter(registry: CollectorRegistry, run: str, component: str) -> Callable[[str], None]:
    """``mixrl_auth_refused_requests_total`` for one server, counted by reason (``missing``/``wrong``)."""
    refused = counter(MIXRL_AUTH_REFUSED_TOTAL, registry)
    for reason in ("missing", "wrong"):  # exported at 0 from the start, so rate() sees the first one
        refused.labels(run=run, component=component, reason=reason)
    return lambda reason: refused.labels(run=run, component=component, reason=reason).inc()


def auth_middleware(
    token: AuthToken,
    open_routes: Collection[Route],
    log: logging.Logger,
    count_refusal: Callable[[str], None] | None = None,
) -> Middleware:
    """Require the token on every route of the app except ``open_routes``.

    Deny by default: a route added later is protected unless it is listed as open.  ``HEAD``
    counts as ``GET``.  Requests that match no route pass through to aiohttp's own 404 / 405.
    Each refusal is logged (at most every 10 s) and passed to ``count_refusal`` (``missing`` or
    ``wrong``; :func:`refusal_counter` makes one).
    """
    opened = frozenset((method.upper(), path) for method, path in open_routes)
    refusals = _RefusalLog(log)
    count = count_refusal or (lambda _reason: None)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        if resource is None:  # no such route: 404 / 405, nothing runs
            return await handler(request)
        method = "GET" if request.method == "HEAD" else request.method
        if (method, resource.canonical) in opened:
            return await handler(request)
        match = _BEARER.fullmatch(request.headers.get("Authorization", ""))
        if match is None:
            refusals.refused(request, "no bearer token")
            count("missing")
            return unauthorized(
                f"unauthorized: {request.method} {resource.canonical} needs the run's token "
                "(Authorization: Bearer <token>)",
                invalid_token=False,
            )
        if not token.matches(match.group(1)):
            refusals.refused(request, "wrong token")
            count("wrong")
            return unauthorized("unauthorized: the bearer token is not this run's", invalid_token=True)
        return await handler(request)

    return check


def auth_middlewares(
    token: AuthToken | None,
    open_routes: Collection[Route],
    log: logging.Logger,
    count_refusal: Callable[[str], None] | None = None,
) -> list[Middleware]:
    """``[auth_middleware(...)]`` with a token, ``[]`` without one (``--insecure-no-auth``)."""
    return [] if token is None else [auth_middleware(token, open_routes, log, count_refusal)]
