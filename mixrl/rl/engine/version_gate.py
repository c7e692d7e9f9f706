"""Version-aware requests: a generate request may demand a minimum weight version (pure; no I/O).

A request names its minimum in the body (``min_weight_version``, in the native ``/generate`` body
and in the ``/v1/completions`` and ``/v1/chat/completions`` bodies) or in a header
(``X-Mixrl-Min-Weight-Version``); given both, both must hold, so the larger counts.  A server that
cannot serve it (the torch engine serving an older version, or the router with no ready replica
that serves one) answers a retryable **409** whose body names the requested minimum and the
served version, with ``Retry-After``: the weights are on their way (docs/engine.md#version-aware-requests).

The engine, the router and the rollout's client each import this one module, so the field, the
header and the refusal's shape are spelled once.  It stays free of torch and HTTP clients: the
router imports it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mixrl.rl.engine.protocol import RequestError

MIN_VERSION_FIELD = "min_weight_version"
"""Request body field: the oldest weight version the caller accepts for this request."""
MIN_VERSION_HEADER = "X-Mixrl-Min-Weight-Version"
"""Request header with the same meaning (the router reads it without parsing the body)."""
MAX_VERSION = 10**8 - 1
"""The weight store's largest version (``mixrl.rl.weights.MAX_VERSION``, repeated here so the
router need not import torch; tests/engine/test_version_gate.py keeps the two equal)."""
RETRY_AFTER_S = 1
"""The 409's ``Retry-After``: a weight update takes seconds, so polling faster gains nothing."""
CONFLICT = 409
REFUSAL_TYPE = "WeightVersionTooOld"

_DECIMAL = re.compile(r"-?[0-9]{1,20}")
"""A version's decimal string; bounded so a huge one is refused before ``int`` reads it."""


def parse_version(where: str, value: Any) -> int:
    """``value`` as a weight version (an integer, or its decimal string as SGLang writes versions);
    else a RequestError naming ``where`` (the field or the header) and why.  Every weight version a
    request carries goes through here: the minimum a request asks for, and the version an update
    or the manifest names."""
    expected = f"must be an integer in [0, {MAX_VERSION}] (or its string)"
    if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(where, f"{expected}, got {type(value).__name__} {value!r}")
    if not 0 <= value <= MAX_VERSION:
        raise RequestError(where, f"{expected}, got {value}")
    return value


def header_min_version(headers: Mapping[str, str]) -> int | None:
    """The minimum a request's header asks for (None: no header, or an empty one)."""
    raw = headers.get(MIN_VERSION_HEADER)
    if raw is None or not raw.strip():
        return None
    return parse_version(MIN_VERSION_HEADER, raw)


def body_min_version(body: Mapping[str, Any]) -> int | None:
    """The minimum a parsed JSON body asks for (None: absent or null)."""
    raw = body.get(MIN_VERSION_FIELD)
    return None if raw is None else parse_version(MIN_VERSION_FIELD, raw)


def raw_body_min_version(raw: bytes) -> int | None:
    """The minimum of an unparsed JSON body, for a proxy that forwards bodies as bytes.

    The body is parsed only when the field's name appears in it quoted, so a request without a
    minimum (nearly all) costs one substring search, not a JSON parse of a whole context.  A body
    that is not a JSON object is left for the server behind to refuse (None here)."""
    if f'"{MIN_VERSION_FIELD}"'.encode() not in raw:
        return None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return body_min_version(body) if isinstance(body, dict) else None


def strictest(*minimums: int | None) -> int | None:
    """The minimum that satisfies every given one (the largest), None when none is given."""
    given = [m for m in minimums if m is not None]
    return max(given) if given else None


def request_min_version(body: Mapping[str, Any], headers: Mapping[str, str]) -> int | None:
    """What a request demands from its body and its header together."""
    return strictest(body_min_version(body), header_min_version(headers))


def satisfies(served: int | None, minimum: int | None) -> bool:
    """Whether weights of version ``served`` (None: unknown) may answer a request of ``minimum``."""
    return minimum is None or (served is not None and served >= minimum)


def refusal_body(minimum: int, served: int | None, who: str) -> dict[str, Any]:
    """The 409's JSON: an OpenAI-style ``error`` (as the engine's 400s) plus both versions as
    numbers, so a client reads them without parsing the message.  ``who``: what could not serve
    (``"the engine"``, ``"no ready replica"``)."""
    shown = "an unknown version" if served is None else f"version {served}"
    message = (
        f"{MIN_VERSION_FIELD}: the request needs weights of version {minimum} or newer; "
        f"{who} serves {shown}; retry after {RETRY_AFTER_S}s"
    )
    return {
        "error": {"message": message, "type": REFUSAL_TYPE, "param": MIN_VERSION_FIELD, "code": CONFLICT},
        MIN_VERSION_FIELD: minimum,
        "weight_version": served,
        "retry": True,
    }


def retry_after_headers() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


@dataclass(frozen=True)
class VersionRefusal:
    """A 409 read back by a client: what it asked for, what was served, how long to wait."""

    minimum: int | None
    served: int | None
    retry_after_s: float | None
    message: str

    @staticmethod
    def read(payload: Any, headers: Mapping[str, str]) -> VersionRefusal | None:
        """The refusal in a 409's body, None if the body is not one (another kind of conflict)."""
        if not isinstance(payload, dict) or MIN_VERSION_FIELD not in payload:
            return None
        error = payload.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        return VersionRefusal(
            _version_or_none(payload.get(MIN_VERSION_FIELD)),
            _version_or_none(payload.get("weight_version")),
            _seconds_or_none(headers.get("Retry-After")),
            str(message or ""),
        )


def _version_or_none(value: Any) -> int | None:
    try:
        return parse_version("version", value)
    except RequestError:
        return None


def _seconds_or_none(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 3600 else None
