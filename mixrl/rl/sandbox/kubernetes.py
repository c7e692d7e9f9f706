"""The cluster backend: each sandboxed command runs in a sandbox pod of its own (docs/sandbox.md#sandbox-pods-in-a-cluster).

    pods = SandboxPods(KubePodClient.in_cluster(), template, worker=os.environ["POD_NAME"], size=4)
    sandbox = KubernetesSandbox(pods)
    await sandbox.start()          # deletes an earlier incarnation's pods, starts filling the pool
    result = await sandbox.run("python3 -m unittest -q", {"solution.py": "..."}, Limits(wall_s=10))
    await sandbox.close()          # deletes every pod of this worker

``run`` has the local backend's call shape and results (:class:`mixrl.rl.sandbox.Sandbox`): a
leased pod (:mod:`mixrl.rl.sandbox.lease`) gets the command, the files and the limits over HTTP
(:mod:`mixrl.rl.sandbox.executor`, ``mixrl sandbox-exec`` in the pod), and is deleted after it,
whatever happened.  The pod manifest is the operator's (``sandbox-pod.json`` in the run's
ConfigMap, built by :mod:`mixrl.operator.builders.sandbox`); the worker adds a name and its label.
The Kubernetes calls go through :class:`PodClient` (create, get, list, delete pods in one
namespace: exactly what the rollout worker's Role grants).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from mixrl.api.kube_types import Obj
from mixrl.rl.http import HttpError
from mixrl.rl.sandbox.executor import decode_result, encode_request
from mixrl.rl.sandbox.lease import WORKER_LABEL, PoolState, executor_port, named_pod
from mixrl.rl.sandbox.limits import Limits
from mixrl.rl.sandbox.runner import SandboxResult, SandboxUnavailable

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
POLL_S = 0.5
LEASE_MARGIN_S = 30.0
"""A lease lasts the command's wall clock plus this (copying files, the HTTP round trip); past it
the pool deletes the pod even if the call never came back."""


class PodClient(Protocol):
    """The four pod calls of the rollout worker's Role, in its namespace."""

    async def create(self, pod: Obj) -> None: ...

    async def get(self, name: str) -> Obj | None: ...

    async def list(self, labels: Mapping[str, str]) -> list[Obj]: ...

    async def delete(self, name: str) -> None: ...


class PodApiError(HttpError):
    """The API server refused a pod call (its HTTP status), or gave no usable answer (None)."""


@dataclass(frozen=True)
class KubeConnection:
    server: str
    namespace: str
    token_file: str | None = None
    token: str | None = None
    ca_file: str | None = None

    @classmethod
    def in_cluster(cls) -> KubeConnection:
        """The pod's own service account (its token is reread on each call: it is rotated)."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port or not os.path.exists(f"{SERVICE_ACCOUNT_DIR}/token"):
            raise SandboxUnavailable(
                "sandbox pods: not in a pod with a service-account token (spec.rollout.sandbox needs the "
                "rollout worker's account, which the operator mounts)"
            )
        with open(f"{SERVICE_ACCOUNT_DIR}/namespace") as handle:
            namespace = handle.read().strip()
        server = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
        return cls(
            server,
            namespace,
            token_file=f"{SERVICE_ACCOUNT_DIR}/token",
            ca_file=f"{SERVICE_ACCOUNT_DIR}/ca.crt",
        )

    def bearer(self) -> str:
        if self.token_file:
            with open(self.token_file) as handle:
                return handle.read().strip()
        return self.token or ""

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_file)

    def pods_path(self, name: str | None = None) -> str:
        path = f"{self.server}/api/v1/namespaces/{self.namespace}/pods"
        return f"{path}/{name}" if name else path


class KubePodClient:
    """:class:`PodClient` over the API server's REST API (aiohttp)."""

    def __init__(self, connection: KubeConnection) -> None:
        self.connection = connection
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def in_cluster(cls) -> KubePodClient:
        return cls(KubeConnection.in_cluster())

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self.connection.ssl_context())
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=30)
            )
        return self._session

    async def _call(self, method: str, url: str, ok_missing: bool = False, **kwargs: Any) -> Obj | None:
        headers = {"Authorization": f"Bearer {self.connection.bearer()}", "Accept": "application/json"}
        async with self._client().request(method, url, headers=headers, **kwargs) as response:
            if response.status == 404 and ok_missing:
                return None
            text = await response.text()
            if response.status >= 300:
                raise PodApiError(f"{method} {url}: {response.status} {text[:300]}", response.status)
            try:
                return json.loads(text) if text else {}
            except ValueError:
                raise PodApiError(f"{method} {url}: not a JSON answer: {text[:300]}") from None

    async def create(self, pod: Obj) -> None:
        await self._call("POST", self.connection.pods_path(), json=pod)

    async def get(self, name: str) -> Obj | None:
        return await self._call("GET", self.connection.pods_path(name), ok_missing=True)

    async def list(self, labels: Mapping[str, str]) -> list[Obj]:
        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        found = await self._call("GET", self.connection.pods_path(), params={"labelSelector": selector})
        return list((found or {}).get("items", []))

    async def delete(self, name: str) -> None:
        body = {"gracePeriodSeconds": 0, "propagationPolicy": "Background"}
        await self._call("DELETE", self.connection.pods_path(name), ok_missing=True, json=body)

    def check(self, timeout_s: float = 10.0) -> None:
        """List one pod now (blocking): the API is reachable and the account may list pods."""
        request = urllib.request.Request(
            f"{self.connection.pods_path()}?limit=1",
            headers={"Authorization": f"Bearer {self.connection.bearer()}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=self.connection.ssl_context()):
                pass
        except (urllib.error.URLError, OSError) as error:
            raise SandboxUnavailable(
                f"sandbox pods: cannot list pods in {self.connection.namespace}: {error}"
            ) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def pod_readiness(pod: Obj) -> tuple[bool, str | None, str]:
    """(ready, address, why it ended or ``""``) of a pod as the API returns it."""
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False, None, "being deleted"
    phase = status.get("phase")
    if phase in ("Failed", "Succeeded"):
        return False, None, f"phase {phase}: {status.get('reason') or status.get('message') or ''}".strip()
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    return ready, status.get("podIP") or None, ""


class SandboxPods:
    """A rollout worker's warm pool: :class:`PoolState`'s plan carried out through a :class:`PodClient`."""

    def __init__(
        self,
        client: PodClient,
        template: Mapping[str, Any],
        worker: str,
        size: int,
        ready_timeout_s: float = 120.0,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.template = dict(template)
        self.port = executor_port(template)
        self.worker = worker
        self.state = PoolState(worker, size, ready_timeout_s, token=secrets.token_hex(3))
        self.poll_s = poll_s
        self.clock = clock
        self._changed = asyncio.Event()
        self._ready = asyncio.Condition()
        self._loop: asyncio.Task[None] | None = None
        self._closing = False

    async def start(self) -> None:
        """Delete what an earlier process of this worker left, then keep the pool filled."""
        for pod in await self.client.list({WORKER_LABEL: self.worker}):
            await self.client.delete(pod["metadata"]["name"])
        self._loop = asyncio.create_task(self._maintain())

    async def _maintain(self) -> None:
        # A flag, not cancellation alone: Python 3.11's wait_for can swallow a cancel that races
        # with the event it waits for, and the loop would then never end.
        while not self._closing:
            try:
                await self.step()
            except (PodApiError, aiohttp.ClientError, OSError) as error:
                self.state.last_problem = f"the pod API: {error}"
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.poll_s)

    async def step(self) -> None:
        """One round: create and delete what the plan says, read every pod not being deleted."""
        plan = self.state.plan(self.clock())
        await asyncio.gather(
            *(self._create(name) for name in plan.create), *(self._delete(n) for n in plan.delete)
        )
        # Ready ones too: a warm pod evicted or gone while it waits would otherwise be leased, and
        # its command end `killed` or at its wall clock (a correct solution's tests scoring 0).
        waiting = [n for n, slot in self.state.slots.items() if slot.state in ("creating", "ready", "leased")]
        await asyncio.gather(*(self._observe(name) for name in waiting))
        async with self._ready:
            self._ready.notify_all()

    async def _create(self, name: str) -> None:
        try:
            await self.client.create(named_pod(self.template, name, self.worker))
        except PodApiError as error:
            # A refusal (4xx: a quota, admission, a name taken) made nothing; a server error may
            # have made the pod before it failed.
            refused = error.status is not None and error.status < 500
            self.state.create_failed(name, self.clock(), str(error), maybe_created=not refused)
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            # The answer was lost, not the request: the pod may exist.
            why = str(error) or type(error).__name__
            self.state.create_failed(name, self.clock(), why, maybe_created=True)

    async def _delete(self, name: str) -> None:
        with contextlib.suppress(PodApiError, aiohttp.ClientError, TimeoutError):
            await self.client.delete(name)
            self.state.gone(name)

    async def _observe(self, name: str) -> None:
        try:
            pod = await self.client.get(name)
        except (PodApiError, aiohttp.ClientError, TimeoutError):
            return
        if pod is None:
            self.state.observe(name, self.clock(), False, None, ended="gone")
            return
        ready, address, ended = pod_readiness(pod)
        self.state.observe(name, self.clock(), ready, address, ended)

    @contextlib.asynccontextmanager
    async def lease(self, hold_s: float) -> AsyncIterator[tuple[str, str]]:
        """A ready pod (name, address) for one command; deleted afterwards, whatever happened.
        SandboxUnavailable when no pod became ready for twice the ready timeout, not counting the
        time every pod ran another command (a busy pool is slow, not broken)."""
        wait_s = 2 * self.state.ready_timeout_s
        waiting_since = self.clock()
        async with self._ready:
            while (leased := self.state.lease(self.clock(), hold_s)) is None:
                now = self.clock()
                if self.state.all_leased():
                    waiting_since = now
                remaining = max(waiting_since, self.state.last_ready_at) + wait_s - now
                if remaining <= 0:
                    created = self.state.created
                    why = self.state.last_problem or (
                        f"{created} created, none failed" if created else "none was created"
                    )
                    raise SandboxUnavailable(f"sandbox pods: none became ready within {wait_s:g} s ({why})")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._ready.wait(), min(remaining, self.poll_s * 4))
        try:
            yield leased
        finally:
            self.state.release(leased[0], self.clock())
            self._changed.set()

    async def close(self) -> None:
        """Stop filling the pool and delete every pod of this worker (those it knows and any other
        with its label)."""
        self._closing = True
        self._changed.set()
        if self._loop is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._loop), timeout=10 * self.poll_s + 30)
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        for name in self.state.shutdown(self.clock()):
            await self._delete(name)
        leftovers: list[Obj] = []
        with contextlib.suppress(PodApiError, aiohttp.ClientError, TimeoutError):
            leftovers = await self.client.list({WORKER_LABEL: self.worker})
        for pod in leftovers:  # one failed deletion leaves that pod only, not the rest
            with contextlib.suppress(PodApiError, aiohttp.ClientError, TimeoutError):
                await self.client.delete(pod["metadata"]["name"])


class KubernetesSandbox:
    """:class:`mixrl.rl.sandbox.Sandbox`'s ``run`` and ``check``, each command in a leased pod."""

    def __init__(self, pods: SandboxPods, grace_s: float = LEASE_MARGIN_S) -> None:
        self.pods = pods
        self.grace_s = grace_s
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        await self.pods.start()

    def check(self) -> None:
        checker = getattr(self.pods.client, "check", None)
        if checker is not None:
            checker()

    async def run(
        self, command: str, files: Mapping[str, str | bytes] | None = None, limits: Limits | None = None
    ) -> SandboxResult:
        if not isinstance(command, str) or not command.strip():
            raise ValueError(f"command: must be a non-empty string, got {command!r}")
        limits = limits or Limits()
        body = encode_request(command, files or {}, limits)
        started = time.monotonic()
        async with self.pods.lease(limits.wall_s + self.grace_s) as (name, address):
            url = f"http://{address}:{self.pods.port}/run"
            if ":" in address:
                url = f"http://[{address}]:{self.pods.port}/run"
            try:
                timeout = aiohttp.ClientTimeout(total=limits.wall_s + self.grace_s)
                async with self._client().post(url, json=body, timeout=timeout) as response:
                    status, raw = response.status, await response.read()
            except TimeoutError:
                wall_s = time.monotonic() - started
                detail = f"sandbox pod {name} did not answer within {limits.wall_s + self.grace_s:g} s"
                return SandboxResult(None, "", "", "timeout", wall_s, detail=detail)
            except aiohttp.ClientError as error:
                # The command killed its executor (same user, same pod), or the pod went away.
                wall_s = time.monotonic() - started
                detail = f"sandbox pod {name}: the executor did not answer ({error})"
                return SandboxResult(None, "", "", "killed", wall_s, detail=detail)
        # An answer that is not the executor's JSON (a server error, a proxy's page) is the
        # infrastructure failing: no result to score, not a command that ended `killed`.
        shown = raw[:300].decode(errors="replace")
        if status >= 500:
            raise SandboxUnavailable(f"sandbox pod {name}: {status} {shown}")
        try:
            answer = json.loads(raw)
        except ValueError:
            raise SandboxUnavailable(f"sandbox pod {name}: not a JSON answer: {status} {shown}") from None
        if status != 200:  # a request it refused: a bug on this side
            raise ValueError(f"sandbox pod {name}: {status} {answer}")
        return decode_result(answer)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        await self.pods.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
