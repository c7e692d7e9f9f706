"""The router's HTTP side (aiohttp): proxy, session and pool admin, weight-reload fan-out, metrics.

All decisions are made by :class:`~mixrl.rl.router.state.RouterState`; this module only moves
bytes, probes replicas and keeps time.  Endpoints:

- ``POST /generate``: proxied unchanged to the session's replica (header ``X-Mixrl-Session``);
  the answer carries ``X-Mixrl-Pool``, ``X-Mixrl-Gpu-Type``, ``X-Mixrl-Precision``,
  ``X-Mixrl-Replica``.  A replica that cannot be reached is marked down, the session is moved,
  and the client gets 503 ``{"retry": true, ...}``: it resends the same turn, nothing is lost.
  A request demanding a minimum weight version (``min_weight_version`` in the body or
  ``X-Mixrl-Min-Weight-Version``) goes only to a ready replica serving it; with none, 409 naming
  the versions, with ``Retry-After`` (docs/router.md#version-aware-routing).  Each replica's
  version is read at every health probe (``GET /get_weight_version``) and from its answers.
- ``POST /sessions/{id}/end``; ``PUT /pools/{name}`` ``{"replicas": [...], "capacity"?: x}``;
  ``GET /pools``; ``GET /health``; ``GET /metrics``.
- ``POST /update_weights_from_disk``: SGLang's body, sent to every ready replica of every pool
  except those listed in mixrl's ``skip_replicas`` (already at the version: the trainer's broadcast).

Authentication (docs/auth.md): with a token, the weight fan-out, ``PUT /pools/{name}`` and ending a
session need ``Authorization: Bearer <token>`` (401 without); ``/generate``, ``GET /pools``,
``/health`` and ``/metrics`` stay open.  The router sends the same token to every replica with
every request (its own header, never the caller's): SGLang engines started with ``--api-key``
want it on ``/generate`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from mixrl.api.base import MAX_CAPACITY
from mixrl.api.resolve import ENGINE_PORT
from mixrl.rl.auth import AuthToken, bearer_headers, refusal_counter
from mixrl.rl.engine.protocol import (
    GPU_TYPE_HEADER,
    POOL_HEADER,
    PRECISION_HEADER,
    REPLICA_HEADER,
    SESSION_HEADER,
    EngineResponseError,
    RequestError,
    completion_token_counts,
    parse_weight_version,
)
from mixrl.rl.engine.version_gate import (
    CONFLICT,
    MIN_VERSION_HEADER,
    VersionRefusal,
    header_min_version,
    raw_body_min_version,
    refusal_body,
    retry_after_headers,
    strictest,
)
from mixrl.rl.health.routing import HealthPolicy, MismatchReport
from mixrl.rl.metrics import SGLANG_GEN_THROUGHPUT, SGLANG_NUM_QUEUE_REQS
from mixrl.rl.router.config import RouterConfig, check_replica_url
from mixrl.rl.router.exporter import make_registry
from mixrl.rl.router.state import NoReadyReplica, Route, RouterState, VersionUnavailable
from mixrl.rl.serving import ClientGone, component_app, metrics_handler, read_body

log = logging.getLogger("mixrl.router")

CLIENT_CLOSED = 499
"""Status recorded when the client went away before the replica answered (nginx's convention)."""


class ClientLeftMidAnswer(Exception):
    """A write of a streamed answer to the router's client failed: the client went away."""


@contextlib.contextmanager
def to_the_client() -> Iterator[None]:
    """Writes to the router's own client.  aiohttp reports one to a client that went away as a
    ClientConnectionResetError — a ClientConnectionError, like a replica's failure — so these are
    told apart here: a client leaving must not mark its replica down."""
    try:
        yield
    except ConnectionResetError as exc:
        raise ClientLeftMidAnswer(str(exc)) from exc


ENGINE_BODY_LIMIT = 8 << 20
"""The torch engine's default request limit (``--max-request-mib 8``): the router's floor."""
BYTES_PER_CONTEXT_TOKEN = 32
"""Most JSON bytes one context token takes in a request: an id is at most 11 (ten digits and a
comma); as text a token is a few characters, each at most 6 once escaped (``\\uXXXX``)."""


def body_limit(max_context_tokens: int) -> int:
    """The largest request body the router reads: a ``/generate`` carrying a whole context, plus
    1 MiB for the sampling fields, and never less than an engine accepts by default.  A body
    beyond it gets 413 before it is read whole (an engine would refuse it anyway)."""
    return max(ENGINE_BODY_LIMIT, BYTES_PER_CONTEXT_TOKEN * max_context_tokens + (1 << 20))


SKIP_REPLICAS = "skip_replicas"
"""mixrl's field of the reload fan-out: replica URLs that already serve the version (the trainer's
broadcast reached them, mixrl.rl.trainer.weight_broadcast); taken out of the body the replicas get."""


def without_skipped_replicas(raw: bytes) -> tuple[bytes, frozenset[str]]:
    """The reload body to forward and the replicas it skips.  A body without the field is forwarded
    byte for byte, as before; ValueError (one line) for a malformed one."""
    if SKIP_REPLICAS.encode() not in raw:
        return raw, frozenset()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"body: not JSON ({exc})") from None
    if not isinstance(body, dict) or SKIP_REPLICAS not in body:
        return raw, frozenset()
    skipped = body.pop(SKIP_REPLICAS)
    if not isinstance(skipped, list) or not all(isinstance(url, str) for url in skipped):
        raise ValueError(f"{SKIP_REPLICAS}: expected a list of replica URLs")
    return json.dumps(body).encode(), frozenset(skipped)


Resolver = Callable[[str, int], Awaitable[list[str]]]
"""host, port -> IP addresses currently behind that name (empty when the name does not exist)."""


async def getaddrinfo_resolver(host: str, port: int) -> list[str]:
    """The real resolver: a headless Service name resolves to one address per ready pod."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        # A headless Service without ready endpoints has no records: zero replicas, not an error.
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise
    return sorted({str(info[4][0]) for info in infos})


_WEIGHT_VERSION = re.compile(rb'"weight_version"\s*:\s*"(\d{1,9})"')


def newest_weight_version(raw: bytes) -> int | None:
    """The newest ``meta_info.weight_version`` (SGLang's string) in a raw answer, None if none.

    Read without parsing, as the token counts are (:func:`completion_token_counts`): JSON escapes
    the quotes inside generated text, so only the field itself matches."""
    versions = [int(found) for found in _WEIGHT_VERSION.findall(raw)]
    return max(versions) if versions else None


SSE_SEPARATOR = b"\n\n"
"""What ends a server-sent event, as SGLang and the torch engine write them."""
_STREAM_INDEX = re.compile(rb'"index"\s*:\s*(\d+)')


@dataclass
class StreamTally:
    """Tokens and weight version of a streamed ``/generate`` answer, read event by event.

    Each event is its item's cumulative answer, so an item's tokens are its latest event's
    ``completion_tokens``; a batch's events carry the item's ``index``, and its tokens are the
    sum over its items (the latest event alone would be one item's)."""

    per_item: dict[int, int] = field(default_factory=dict)
    version: int | None = None

    def add(self, event: bytes) -> None:
        counts = completion_token_counts(event)
        if counts:
            indices = _STREAM_INDEX.findall(event)
            # the item's index is a top-level key written after its meta_info: the last match
            self.per_item[int(indices[-1]) if indices else -1] = counts[0]
        found = newest_weight_version(event)
        if found is not None:
            self.version = max(found, self.version or 0)

    def tokens(self) -> int:
        return sum(self.per_item.values())


def replica_url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


OPEN_ROUTES = frozenset({("POST", "/generate"), ("GET", "/pools"), ("GET", "/health"), ("GET", "/metrics")})
"""Routes that answer without the run's token; everything else changes state and needs it."""


@dataclass(frozen=True)
class RouterSettings:
    run: str = ""
    health_interval: float = 2.0
    """Seconds between health probes of every replica (and DNS lookups with discovery)."""
    health_timeout: float = 2.0
    request_timeout: float = 900.0
    """Longest a /generate may take at a replica before the router answers 504."""
    fanout_timeout: float = 900.0
    """Longest a replica may take to reload weights."""
    max_inflight_per_replica: int = 0
    """Requests outstanding per replica before the router holds new ones (0 = no limit)."""
    session_ttl: float = 900.0
    """Sessions idle this long are forgotten (their rollout worker is gone)."""
    discover_dns: bool = False
    engine_port: int = ENGINE_PORT
    auth_token: AuthToken | None = None
    """The run's token: required on the router's state-changing routes and sent to every replica
    (None: no check and nothing sent, as with ``--insecure-no-auth``).  Its repr is hidden."""
    max_request_bytes: int = ENGINE_BODY_LIMIT
    """413 beyond it (:func:`body_limit` of the run's context)."""
    buffer_url: str | None = None
    """Where the trainer's per-pool fresh mismatch is read (the buffer's ``GET /stats``)."""
    health_policy: HealthPolicy | None = None
    """Mismatch-aware routing (``spec.health.routing``); None: shares by capacity alone."""


def _retry_response(message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, "retry": True, **extra}, status=503)


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


def _version_response(exc: VersionUnavailable) -> web.Response:
    """409: replicas are ready but none serves the request's minimum weight version yet."""
    body = refusal_body(exc.minimum, exc.newest, "the newest ready replica")
    return web.json_response(body, status=CONFLICT, headers=retry_after_headers())


def requested_min_version(headers: Any, body: bytes) -> int | None:
    """The minimum weight version a proxied request demands (header and body; RequestError if
    either is malformed).  The body is parsed only when it names the field."""
    return strictest(header_min_version(headers), raw_body_min_version(body))


def refused_version(payload: bytes) -> int | None:
    """The version an engine's 409 says it serves (None if the answer is not a version refusal)."""
    try:
        refusal = VersionRefusal.read(json.loads(payload), {})
    except (ValueError, RecursionError):
        return None
    return refusal.served if refusal is not None else None


class Router:
    def __init__(
        self,
        config: RouterConfig,
        settings: RouterSettings | None = None,
        resolver: Resolver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or RouterSettings(run=config.run)
        self.run = self.settings.run or config.run
        self.state = RouterState(config.pools, self.settings.session_ttl)
        self.services = {pool.name: pool.service for pool in config.pools if pool.service}
        self.resolver = resolver or getaddrinfo_resolver
        self.clock = clock
        self.registry, self.latency = make_registry(self.state, self.run)
        self.metrics = metrics_handler(self.registry)
        self._http: aiohttp.ClientSession | None = None
        self._slot_freed = asyncio.Condition()
        # Router-side throughput samples for measured pools whose engines export no gen_throughput.
        self._token_marks: dict[tuple[str, str], tuple[float, int]] = {}
        self._cost_mark: float | None = None
        # Replicas whose /get_weight_version names no version, already logged (one line each).
        self._unversioned: set[str] = set()

    # ------------------------------------------------------------------ application

    def app(self) -> web.Application:
        refused = refusal_counter(self.registry, self.run, "router")
        # A client gone mid-turn cancels its proxied request: the closed upstream connection makes
        # the engine abort the sequence instead of decoding it to the end for nobody.
        app = component_app(
            self.metrics,
            self.settings.auth_token,
            OPEN_ROUTES,
            log,
            self.settings.max_request_bytes,
            refused,
            cancel_on_disconnect=True,
        )
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/sessions/{session}/end", self._end_session)
        app.router.add_put("/pools/{pool}", self._put_pool)
        app.router.add_get("/pools", self._get_pools)
        app.router.add_get("/health", self._health)
        app.router.add_post("/update_weights_from_disk", self._update_weights)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        # Every request to a replica carries the run's token (session-wide: probes, generation, fan-out).
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=bearer_headers(self.settings.auth_token)
        )
        await self.poll_once()
        tasks = [asyncio.create_task(self._monitor(), name="router-monitor")]
        if self.settings.health_policy is not None and self.settings.buffer_url is not None:
            tasks.append(asyncio.create_task(self._watch_mismatch(), name="router-mismatch"))
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._http.close()

    async def _watch_mismatch(self) -> None:
        """Read the trainer's latest per-pool fresh mismatch from the buffer; each new step moves
        the pools' health (mixrl.rl.health.routing) and so the shares of new sessions."""
        assert self.settings.health_policy is not None and self.settings.buffer_url is not None
        url = f"{self.settings.buffer_url.rstrip('/')}/stats"
        while True:
            try:
                timeout = aiohttp.ClientTimeout(total=max(self.settings.health_timeout, 1.0) * 2)
                async with self.http.get(url, timeout=timeout) as response:
                    stats = await response.json(content_type=None)
                raw = stats.get("mismatch") if isinstance(stats, dict) else None
                if raw is not None:
                    report = MismatchReport.model_validate(raw)
                    if self.state.observe_mismatch(report, self.settings.health_policy):
                        health = {name: round(h.health, 3) for name, h in sorted(self.state.health.items())}
                        log.info("pool health after step %d: %s", report.step, health)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.warning("cannot read the trainer's mismatch from %s: %s", url, exc)
            await asyncio.sleep(self.settings.health_interval)

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None, "the router's HTTP client exists only while the app runs"
        return self._http

    # ------------------------------------------------------------------ replica monitoring

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval)
            try:
                await self.poll_once()
            except Exception:  # a monitoring round must never kill the loop
                log.exception("replica monitoring round failed")

    async def poll_once(self) -> None:
        """One monitoring round: DNS discovery, health of every replica, throughput, session expiry,
        and the GPU cost of the replicas held since the last round."""
        now = self.clock()
        if self._cost_mark is not None:
            self.state.accrue_cost(now - self._cost_mark)
        self._cost_mark = now
        if self.settings.discover_dns:
            await self.discover()
        targets = [(pool.name, url) for pool in self.state.pools.values() for url in pool.replicas]
        await self.check_replicas(targets)
        for session_id in self.state.expire_sessions(self.clock()):
            log.info("session %s expired after %.0fs idle", session_id, self.state.session_ttl)

    async def discover(self) -> None:
        """Resolve every pool's Service at once; a lookup that fails or hangs keeps that pool's replicas."""
        pools = list(self.services.items())
        timeout = max(self.settings.health_timeout, 1.0) * 2
        lookups = [
            asyncio.wait_for(self.resolver(service, self.settings.engine_port), timeout)
            for _, service in pools
        ]
        results = await asyncio.gather(*lookups, return_exceptions=True)
        for (pool_name, service), result in zip(pools, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, OSError | TimeoutError):
                    raise result
                log.warning(
                    "cannot resolve %s for pool %s (keeping its replicas): %r", service, pool_name, result
                )
                continue
            urls = [replica_url(address, self.settings.engine_port) for address in result]
            if set(urls) != set(self.state.pool(pool_name).replicas):
                log.info("pool %s: DNS %s lists %d replicas", pool_name, service, len(urls))
                self.state.set_replicas(pool_name, urls)

    async def check_replicas(self, targets: list[tuple[str, str]]) -> None:
        await asyncio.gather(*(self._probe(pool, url) for pool, url in targets))
        async with self._slot_freed:
            self._slot_freed.notify_all()  # held requests re-check readiness

    async def _probe(self, pool_name: str, url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout)
        try:
            async with self.http.get(f"{url}/health", timeout=timeout) as response:
                ready = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ready = False
        replica = self.state.replica(pool_name, url)
        if replica is not None and replica.ready != ready:
            log.info("replica %s of pool %s is %s", url, pool_name, "ready" if ready else "down")
        if ready:
            self.state.set_version(pool_name, url, await self._served_version(url))
        self.state.set_ready(pool_name, url, ready)
        if ready:  # every pool: a declared capacity gives way to a measurement far off it
            await self._measure(pool_name, url)

    async def _measure(self, pool_name: str, url: str) -> None:
        """Throughput sample of a replica: the engine's gen_throughput, else our own count."""
        throughput, queued = await self._engine_throughput(url)
        replica = self.state.replica(pool_name, url)
        if replica is None:
            return
        now = self.clock()
        previous = self._token_marks.get((pool_name, url))
        self._token_marks[(pool_name, url)] = (now, replica.generated_tokens)
        if throughput is None and previous is not None and now > previous[0]:
            throughput = (replica.generated_tokens - previous[1]) / (now - previous[0])
        if throughput is not None:
            self.state.record_throughput(pool_name, url, throughput, queued)

    async def _served_version(self, url: str) -> int | None:
        """The replica's ``GET /get_weight_version`` (SGLang's and the torch engine's); None when it
        cannot say (then its answers and its 409s still tell).

        An answer without a ``weight_version`` (or with a malformed one) says nothing: read as
        version 0 it would let the replica serve requests demanding 0 whatever it holds.  It is
        logged once per replica until the replica names a version again."""
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout)
        try:
            async with self.http.get(f"{url}/get_weight_version", timeout=timeout) as response:
                if response.status != 200:
                    return None
                payload = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        try:
            if not isinstance(payload, dict) or payload.get("weight_version") is None:
                raise EngineResponseError("weight_version: absent from the answer")
            version = parse_weight_version(payload["weight_version"])
        except EngineResponseError as exc:
            if url not in self._unversioned:
                self._unversioned.add(url)
                log.warning("replica %s: /get_weight_version: %s; its version stays unknown", url, exc)
            return None
        self._unversioned.discard(url)
        return version

    async def _engine_throughput(self, url: str) -> tuple[float | None, bool]:
        """The engine's generation throughput (None: it exports none) and whether it has requests
        queued (SGLang's two gauges, either spelling)."""
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout)
        try:
            async with self.http.get(f"{url}/metrics", timeout=timeout) as response:
                if response.status != 200:
                    return None, False
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return None, False
        spelled = {
            spelling: spec.name
            for spec in (SGLANG_GEN_THROUGHPUT, SGLANG_NUM_QUEUE_REQS)
            for spelling in (spec.name, spec.name.replace(":", "_"))
        }
        values: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(text):
                if family.name in spelled and family.samples:
                    values[spelled[family.name]] = sum(sample.value for sample in family.samples)
        except ValueError:
            log.warning("replica %s exports unparsable metrics", url)
        return values.get(SGLANG_GEN_THROUGHPUT.name), values.get(SGLANG_NUM_QUEUE_REQS.name, 0.0) > 0

    # ------------------------------------------------------------------ proxy

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        started = self.clock()
        try:
            body = await read_body(request, log)
        except ClientGone:
            return _bad_request("body: the connection closed before the body arrived")
        session_id = request.headers.get(SESSION_HEADER) or None
        try:
            minimum = requested_min_version(request.headers, body)
        except RequestError as exc:
            return _bad_request(str(exc))
        try:
            route = self.state.route(session_id, started, minimum)
        except (NoReadyReplica, VersionUnavailable) as exc:
            return self._unplaced(exc)
        # Until this request ends its session is busy, not idle: it must not expire while the
        # request waits for a slot or runs past --session-ttl, or its next turn loses its replica.
        held = self.state.hold(session_id)
        try:
            return await self._forward(request, body, route, session_id, minimum, started)
        finally:
            self.state.release(held, self.clock())

    def _unplaced(self, exc: NoReadyReplica | VersionUnavailable) -> web.Response:
        """The answer to a request that could not be placed: 503 (retry), or 409 for its version."""
        if isinstance(exc, NoReadyReplica):
            return _retry_response(f"{exc}; retry the turn")
        self.state.version_refusals += 1
        return _version_response(exc)

    async def _forward(
        self,
        request: web.Request,
        body: bytes,
        route: Route,
        session_id: str | None,
        minimum: int | None,
        started: float,
    ) -> web.StreamResponse:
        """Proxy one routed ``/generate`` to its replica (once it has a slot) and record it."""
        try:
            route = await self._wait_for_slot(route, session_id, minimum)
        except (NoReadyReplica, VersionUnavailable) as exc:
            return self._unplaced(exc)
        pool = self.state.pools[route.pool]
        self.state.begin(route.pool, route.replica)
        status: int | None = CLIENT_CLOSED
        tokens = 0
        version: int | None = None
        stream: web.StreamResponse | None = None
        tally = StreamTally()
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout)
            forward = {"Content-Type": request.headers.get("Content-Type", "application/json")}
            if session_id is not None:
                forward[SESSION_HEADER] = session_id  # for the engine's logs; SGLang ignores it
            if minimum is not None:
                forward[MIN_VERSION_HEADER] = str(minimum)  # the engine checks it again (SGLang ignores it)
            async with self.http.post(
                f"{route.replica}/generate", data=body, headers=forward, timeout=timeout
            ) as upstream:
                headers = {
                    "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                    POOL_HEADER: pool.name,
                    GPU_TYPE_HEADER: pool.gpu_type,
                    PRECISION_HEADER: pool.precision,
                    REPLICA_HEADER: route.replica,
                }
                if upstream.content_type == "text/event-stream":
                    stream = web.StreamResponse(status=upstream.status, headers=headers)
                    with to_the_client():
                        await stream.prepare(request)
                    await self._stream(upstream, stream, tally)
                    status = upstream.status
                    return stream
                payload = await upstream.read()
                status = upstream.status
            if status == 200:
                tokens = sum(completion_token_counts(payload))  # one count per item of a batch
                version = newest_weight_version(payload)
            elif status == CONFLICT:  # the replica is older than the router thought: the client retries
                self.state.version_refusals += 1
                version = refused_version(payload)
                headers.update(retry_after_headers())
            return web.Response(body=payload, status=status, headers=headers)
        except TimeoutError:  # first: aiohttp's socket timeouts are also ClientConnectionErrors
            status = 504
            message = f"replica {route.replica} of pool {route.pool} did not answer within "
            return web.json_response(
                {"error": message + f"{self.settings.request_timeout:.0f}s; retry the turn", "retry": True},
                status=504,
            )
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:  # gone, or cut mid-answer
            status = None
            retry = self._replica_failed(route, session_id, exc, minimum)
            if stream is None:
                return retry
            # A stream already under way cannot become a 503: it is cut here too (aiohttp would
            # end it cleanly), so the client sees the failure and retries.
            if request.transport is not None:
                request.transport.abort()
            return stream
        except ClientLeftMidAnswer:  # its request stays recorded as 499; the replica is not to blame
            assert stream is not None
            return stream
        finally:
            if stream is not None:
                tokens, version = tally.tokens(), tally.version
            self.state.finish(route.pool, route.replica, tokens, status, version)
            self.latency.labels(self.run, pool.name, pool.gpu_type, pool.precision).observe(
                self.clock() - started
            )
            async with self._slot_freed:
                self._slot_freed.notify_all()

    async def _stream(
        self, upstream: aiohttp.ClientResponse, response: web.StreamResponse, tally: StreamTally
    ) -> None:
        """Pass a streamed answer through chunk by chunk, counting its tokens and versions in
        ``tally`` as the events go by (so a stream cut short still counts what reached the client).
        A client that leaves raises :class:`ClientLeftMidAnswer` (its request is then recorded as 499)."""
        pending = bytearray()
        async for chunk in upstream.content.iter_any():
            with to_the_client():
                await response.write(chunk)
            # Events are read whole: an event carries the cumulative answer (with log-probs, tens of
            # kilobytes) and its completion_tokens sits near its start, so a window over the last
            # bytes read missed it; the separator is searched only in what is new.
            scan = max(len(pending) - 1, 0)
            pending += chunk
            begin = 0
            while (end := pending.find(SSE_SEPARATOR, scan)) != -1:
                tally.add(bytes(pending[begin:end]))
                begin = scan = end + len(SSE_SEPARATOR)
            del pending[:begin]
        if pending.strip():
            tally.add(bytes(pending))
        with to_the_client():
            await response.write_eof()

    def _replica_failed(
        self, route: Route, session_id: str | None, exc: Exception, minimum: int | None = None
    ) -> web.Response:
        """The replica is gone: mark it down and move the session now, so the retried turn just works."""
        log.warning("replica %s of pool %s failed: %s", route.replica, route.pool, exc)
        self.state.mark_down(route.pool, route.replica)
        moved_to: dict[str, str] | None = None
        if session_id is not None:
            try:
                new_route = self.state.route(session_id, self.clock(), minimum)
                moved_to = {"pool": new_route.pool, "replica": new_route.replica}
            except (NoReadyReplica, VersionUnavailable):
                moved_to = None
        message = f"replica {route.replica} of pool {route.pool} is unreachable ({exc}); retry the turn"
        return _retry_response(message, pool=route.pool, replica=route.replica, moved_to=moved_to)

    async def _wait_for_slot(self, route: Route, session_id: str | None, minimum: int | None = None) -> Route:
        """Hold the request while its replica has max_inflight_per_replica requests outstanding."""
        limit = self.settings.max_inflight_per_replica
        while limit > 0:
            replica = self.state.replica(route.pool, route.replica)
            if replica is None or not replica.serves(minimum):
                route = self._reroute(route, session_id, minimum)
                continue
            if replica.in_flight < limit:
                break
            replica.waiting += 1
            try:
                async with self._slot_freed:
                    await self._slot_freed.wait()
            finally:
                replica.waiting -= 1
            route = self._reroute(route, session_id, minimum)
        return route

    def _reroute(self, route: Route, session_id: str | None, minimum: int | None = None) -> Route:
        if session_id is not None:
            return self.state.route(session_id, self.clock(), minimum)
        replica = self.state.replica(route.pool, route.replica)
        if replica is not None and replica.serves(minimum):
            return route
        return self.state.route(None, self.clock(), minimum)

    # ------------------------------------------------------------------ admin

    async def _end_session(self, request: web.Request) -> web.Response:
        return web.json_response({"ended": self.state.end_session(request.match_info["session"])})

    async def _put_pool(self, request: web.Request) -> web.Response:
        name = request.match_info["pool"]
        if name not in self.state.pools:
            return web.json_response({"error": f"pool: no pool named {name!r}"}, status=404)
        try:
            body = json.loads(await read_body(request, log))
        except ClientGone:
            return _bad_request("body: the connection closed before the body arrived")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            return _bad_request(f"body: not JSON ({exc})")
        if not isinstance(body, dict):
            return _bad_request("body: expected a JSON object with 'replicas'")
        replicas = body.get("replicas")
        if not isinstance(replicas, list) or not all(isinstance(url, str) for url in replicas):
            return _bad_request("replicas: expected a list of replica URLs")
        try:
            for url in replicas:
                check_replica_url(url)
        except ValueError as exc:
            return _bad_request(f"replicas: {exc}")
        if "capacity" in body:
            capacity = None if body["capacity"] is None else _capacity(body["capacity"])
            if body["capacity"] is not None and capacity is None:
                return _bad_request(
                    f"capacity: expected a number in (0, {MAX_CAPACITY:g}], or null to measure it"
                )
            self.state.set_capacity(name, capacity)
        added = self.state.set_replicas(name, replicas)
        await self.check_replicas([(name, url) for url in added])
        pools = self._pools_snapshot()["pools"]
        assert isinstance(pools, list)
        return web.json_response(next(pool for pool in pools if pool["name"] == name))

    async def _get_pools(self, request: web.Request) -> web.Response:
        snapshot = self._pools_snapshot()
        return web.json_response({"run": self.run, "discover_dns": self.settings.discover_dns, **snapshot})

    def _pools_snapshot(self) -> dict[str, object]:
        """The state's snapshot with each pool's Service (DNS discovery): one entry for both routes."""
        snapshot = self.state.snapshot()
        pools = snapshot["pools"]
        assert isinstance(pools, list)
        for pool in pools:
            pool["service"] = self.services.get(pool["name"])
        return snapshot

    async def _health(self, request: web.Request) -> web.Response:
        ready = sum(len(pool.ready_replicas()) for pool in self.state.pools.values())
        return web.json_response({"status": "ok", "ready_replicas": ready})

    # ------------------------------------------------------------------ fan-out

    async def _update_weights(self, request: web.Request) -> web.Response:
        """Send SGLang's /update_weights_from_disk body to every ready replica; report each result.

        Shielded: a caller that goes away (or times out) mid-reload does not cut the fan-out short,
        which would leave some replicas half-way through their reload."""
        try:
            body = await read_body(request, log)
        except ClientGone:
            return _bad_request("body: the connection closed before the body arrived")
        try:
            body, skipped = without_skipped_replicas(body)
        except ValueError as exc:
            return _bad_request(str(exc))
        targets = [
            (pool.name, replica.url)
            for pool in self.state.pools.values()
            for replica in pool.ready_replicas()
            if replica.url not in skipped
        ]
        if not targets and skipped:
            return web.json_response({"success": True, "results": [], "skipped": sorted(skipped)})
        if not targets:
            return _retry_response("no ready replica to update; retry when replicas are up", results=[])
        fan_out = asyncio.gather(*(self._update_one(pool, url, body) for pool, url in targets))
        results = await asyncio.shield(fan_out)
        success = all(result["success"] for result in results)
        answer = {"success": success, "results": results, "skipped": sorted(skipped)}
        return web.json_response(answer, status=200 if success else 502)

    async def _update_one(self, pool: str, url: str, body: bytes) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=self.settings.fanout_timeout)
        result: dict[str, Any] = {"pool": pool, "replica": url}
        try:
            async with self.http.post(
                f"{url}/update_weights_from_disk",
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=timeout,
            ) as response:
                text = await response.text()
                result["status"] = response.status
        except TimeoutError:
            return {**result, "status": None, "success": False, "message": "timed out"}
        except aiohttp.ClientConnectionError as exc:
            self.state.mark_down(pool, url)
            return {**result, "status": None, "success": False, "message": f"unreachable: {exc}"}
        try:
            answer = json.loads(text)
        except json.JSONDecodeError:
            answer = {"message": text[:500]}
        if not isinstance(answer, dict):
            answer = {"message": str(answer)[:500]}
        success = response.status == 200 and bool(answer.get("success", True))
        if success:  # the torch engine names the version it now serves
            self.state.set_version(pool, url, _version_in(answer))
        return {**result, "success": success, "message": str(answer.get("message", ""))}


def _capacity(value: Any) -> float | None:
    """``value`` as a capacity in (0, MAX_CAPACITY] (the run spec's range), else None.  JSON's NaN
    and Infinity decode to floats, and a finite but astronomical capacity overflows the sum of the
    pools' weights to inf: any of them would make every share NaN.  An integer beyond a float's
    range cannot be converted at all."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) and 0 < number <= MAX_CAPACITY else None


def _version_in(answer: dict[str, Any]) -> int | None:
    """The ``weight_version`` a weight update's answer names, None when it names none (a null is
    none too, not version 0)."""
    try:
        return (
            None if answer.get("weight_version") is None else parse_weight_version(answer["weight_version"])
        )
    except EngineResponseError:
        return None
