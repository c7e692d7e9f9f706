"""A small asynchronous Kubernetes REST client for the reconcilers (aiohttp).

It speaks the few calls the operator needs — get, list, create, server-side apply, merge patch,
delete (with a propagation policy), discovery — and nothing else.  Every call names its RBAC verb and is checked against
:data:`mixrl.operator.kube.rbac.RECONCILER` (or the peering read) before it is sent, so an undeclared
call fails in the tests instead of with a 403 in a cluster.  Credentials come from the same login kopf performs (a kopf
``ConnectionInfo``), read again on each request so a refreshed token is used at once.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from mixrl import __version__
from mixrl.api.kube_types import Obj
from mixrl.api.status import RLRunStatus, SamplerPoolStatus, checked_status
from mixrl.operator.kube.cache import ObjectCache
from mixrl.operator.kube.rbac import (
    PEERING_READS,
    PLACEMENT_READS,
    PRIORITY_READS,
    RECONCILER,
    ApiResource,
    is_allowed,
)

FIELD_MANAGER = "mixrl-operator"
USER_AGENT = f"mixrl-operator/{__version__}"
WRITE_VERBS = frozenset({"create", "patch", "update", "delete"})


STATUS_MODELS: dict[str, type[RLRunStatus] | type[SamplerPoolStatus]] = {
    "RLRun": RLRunStatus,
    "SamplerPool": SamplerPoolStatus,
}
"""Kind -> the model its status subresource is written through."""


class ApiError(Exception):
    """A non-2xx answer from the API server (or no answer: status 0)."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None):
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        super().__init__(f"{status} {reason}: {message}" if status else f"connection failed: {message}")

    @property
    def retryable(self) -> bool:
        """Conflicts, throttling, server errors and lost connections heal by themselves."""
        return self.status in (0, 409, 429) or self.status >= 500


class UndeclaredApiCall(AssertionError):
    """The code made a call that rbac.RECONCILER does not declare (a bug: the chart would deny it)."""


@dataclass(frozen=True)
class Connection:
    """Where the API server is and how to authenticate (the fields of kopf's ConnectionInfo)."""

    server: str
    token: str | None = None
    scheme: str | None = None
    username: str | None = None
    password: str | None = None
    ca_path: str | None = None
    ca_data: bytes | None = None
    insecure: bool = False
    certificate_path: str | None = None
    certificate_data: bytes | None = None
    private_key_path: str | None = None
    private_key_data: bytes | None = None

    @classmethod
    def from_kopf(cls, info: Any) -> Connection:
        def as_bytes(value: str | bytes | None) -> bytes | None:
            return value.encode() if isinstance(value, str) else value

        def as_path(value: Any) -> str | None:
            return os.fsdecode(value) if value else None

        return cls(
            server=info.server,
            token=info.token,
            scheme=info.scheme,
            username=info.username,
            password=info.password,
            ca_path=as_path(info.ca_path),
            ca_data=as_bytes(info.ca_data),
            insecure=bool(info.insecure),
            certificate_path=as_path(info.certificate_path),
            certificate_data=as_bytes(info.certificate_data),
            private_key_path=as_path(info.private_key_path),
            private_key_data=as_bytes(info.private_key_data),
        )

    def headers(self) -> dict[str, str]:
        if self.token:
            return {"Authorization": f"{self.scheme or 'Bearer'} {self.token}"}
        if self.username and self.password:
            basic = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            return {"Authorization": f"Basic {basic}"}
        return {}

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        if self.insecure:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            cadata = self.ca_data.decode() if self.ca_data else None
            context = ssl.create_default_context(cafile=self.ca_path, cadata=cadata)
        if self.certificate_path or self.certificate_data:
            with tempfile.TemporaryDirectory() as tmp:
                cert = self.certificate_path or _write(tmp, "cert.pem", self.certificate_data)
                key = self.private_key_path or _write(tmp, "key.pem", self.private_key_data)
                assert cert is not None  # a path or the data, as the condition above holds
                context.load_cert_chain(cert, key)
        return context


def _write(directory: str, name: str, data: bytes | None) -> str | None:
    if data is None:
        return None
    path = os.path.join(directory, name)
    with open(path, "wb") as handle:
        handle.write(data)
    return path


Objs = list[Obj]
"""(an alias: inside KubeClient, ``list`` names its method)"""


class KubeClient:
    """One aiohttp session; ``connection`` is asked for the current credentials on every call."""

    def __init__(self, connection: Callable[[], Connection], timeout_s: float = 30.0):
        self._connection = connection
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._ssl_for: tuple[Connection, ssl.SSLContext | bool] | None = None
        self.calls: Counter[tuple[str, str]] = Counter()
        """(verb, resource) -> number of calls sent: for logs and tests."""
        self.cache = ObjectCache()
        """What the watches and the answers said last (kept for the watched kinds only; the
        operator's handlers name them and feed the events)."""

    def writes(self) -> Counter[tuple[str, str]]:
        """The calls sent so far that change state ((verb, resource) -> count): a reconcile of an
        unchanged cluster must add none."""
        return Counter({key: n for key, n in self.calls.items() if key[0] in WRITE_VERBS})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _ssl(self, connection: Connection) -> ssl.SSLContext | bool:
        if self._ssl_for is None or self._ssl_for[0] != connection:
            self._ssl_for = (connection, connection.ssl_context())
        return self._ssl_for[1]

    async def request(
        self,
        verb: str,
        method: str,
        resource: ApiResource,
        *,
        namespace: str | None = None,
        name: str | None = None,
        subresource: str | None = None,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        rbac_resource = f"{resource.plural}/{subresource}" if subresource else resource.plural
        if not (
            is_allowed(RECONCILER, resource.group, rbac_resource, verb)
            or is_allowed(PEERING_READS, resource.group, rbac_resource, verb)
            or (
                namespace is None
                and any(
                    is_allowed(reads, resource.group, rbac_resource, verb)
                    for reads in (PLACEMENT_READS, PRIORITY_READS)
                )
            )
        ):
            raise UndeclaredApiCall(
                f"{verb} {resource.group or 'core'}/{rbac_resource} is not in rbac.RECONCILER"
            )
        connection = self._connection()
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers={"User-Agent": USER_AGENT})
        url = connection.server.rstrip("/") + resource.path(namespace, name, subresource)
        headers = {**connection.headers(), "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        self.calls[(verb, rbac_resource)] += 1
        try:
            async with self._session.request(
                method, url, params=params, data=data, headers=headers, ssl=self._ssl(connection)
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    raise _api_error(response.status, text, response.headers.get("Retry-After"))
                return json.loads(text) if text else None
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise ApiError(0, "ConnectionFailed", str(exc) or type(exc).__name__) from exc

    async def get(
        self,
        resource: ApiResource,
        namespace: str,
        name: str,
        subresource: str | None = None,
        cached: bool = False,
    ) -> Obj | None:
        """The object, or None when it does not exist.  ``cached``: the last state the watches
        showed when there is one (:mod:`mixrl.operator.kube.cache`), else a read."""
        if cached and subresource is None:
            known = self.cache.get(resource, namespace, name)
            if known is not None:
                return known
        try:
            found: Obj = await self.request(
                "get", "GET", resource, namespace=namespace, name=name, subresource=subresource
            )
        except ApiError as exc:
            if exc.status == 404:
                self.cache.forget(resource, namespace, name)
                return None
            raise
        if subresource is None:
            self.cache.store(resource, found)
        return found

    async def _write(
        self,
        verb: str,
        method: str,
        resource: ApiResource,
        namespace: str,
        name: str,
        to_collection: bool = False,
        **request: Any,
    ) -> Obj:
        """A write whose answer (the object as it is now) is kept; a 404 or a 409 forgets what was
        known of it (gone, or not as we knew it).  ``to_collection``: sent to the kind's collection
        (a create), ``name`` only for the cache."""
        try:
            answer: Obj = await self.request(
                verb, method, resource, namespace=namespace, name=None if to_collection else name, **request
            )
        except ApiError as exc:
            if exc.status in (404, 409):
                self.cache.forget(resource, namespace, name)
            raise
        self.cache.store(resource, answer)
        return answer

    async def list_cluster(self, resource: ApiResource, field_selector: str = "") -> list[Obj]:
        """Every object of ``resource`` in the cluster (all namespaces), ``field_selector`` applied
        by the server (rbac.PLACEMENT_READS: granted only with --explain-placement)."""
        params = {"fieldSelector": field_selector} if field_selector else {}
        found = await self.request("list", "GET", resource, params=params)
        return [item for item in (found or {}).get("items", [])]

    async def get_cluster(self, resource: ApiResource, name: str) -> Obj | None:
        """A cluster-scoped object, or None when it does not exist (rbac.PRIORITY_READS: granted
        only with --kueue-workload-priority)."""
        try:
            found: Obj = await self.request("get", "GET", resource, name=name)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return found

    async def list(
        self,
        resource: ApiResource,
        namespace: str,
        label_selector: dict[str, str],
        cached: bool = False,
        field_selector: str = "",
    ) -> list[Obj]:
        """The objects of ``resource`` in ``namespace`` carrying ``label_selector`` (and matching
        ``field_selector``, applied by the server); ``cached``: those the watches last showed, where
        the kind is watched (:mod:`mixrl.operator.kube.cache`) and no field selector is asked."""
        if cached and not field_selector and self.cache.keeps(resource):
            return self.cache.list(resource, namespace, label_selector)
        return (await self.list_as_of(resource, namespace, label_selector, field_selector))[0]

    async def list_as_of(
        self, resource: ApiResource, namespace: str, label_selector: dict[str, str], field_selector: str = ""
    ) -> tuple[Objs, str]:
        """The objects of ``resource`` in ``namespace`` carrying ``label_selector`` (and matching
        ``field_selector``), and the resource version the list was taken at."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(label_selector.items()))
        params = {"labelSelector": selector} if selector else {}
        if field_selector:
            params["fieldSelector"] = field_selector
        found = await self.request("list", "GET", resource, namespace=namespace, params=params)
        items: list[Obj] = found.get("items", []) if found else []
        version = str(((found or {}).get("metadata") or {}).get("resourceVersion") or "")
        # Filter here as well: the selector is an optimization, the labels are the contract.
        return [
            item
            for item in items
            if all(item.get("metadata", {}).get("labels", {}).get(k) == v for k, v in label_selector.items())
        ], version

    async def create(self, resource: ApiResource, namespace: str, body: Obj) -> Obj:
        name = body.get("metadata", {}).get("name", "")
        return await self._write("create", "POST", resource, namespace, name, to_collection=True, body=body)

    async def apply(self, resource: ApiResource, namespace: str, name: str, body: Obj) -> Obj:
        """Server-side apply as the only manager of these fields: creates or updates, and removes
        what an earlier apply set but this one omits."""
        return await self._patch(resource, namespace, name, body, "application/apply-patch+yaml", force=True)

    async def merge_patch(
        self, resource: ApiResource, namespace: str, name: str, body: Obj, subresource: str | None = None
    ) -> Obj:
        if subresource == "status":
            # Every status the operator writes passes here: through its model, so a mistyped key
            # fails now instead of being pruned silently by the API server's schema.
            checked_status(STATUS_MODELS[resource.kind], body.get("status") or {})
        return await self._patch(resource, namespace, name, body, "application/merge-patch+json", subresource)

    async def _patch(
        self,
        resource: ApiResource,
        namespace: str,
        name: str,
        body: Obj,
        content_type: str,
        subresource: str | None = None,
        force: bool = False,
    ) -> Obj:
        """A PATCH as mixrl's field manager; ``content_type`` says which kind (an apply's body is
        JSON, which is YAML); ``force`` takes over fields another manager set."""
        params = {"fieldManager": FIELD_MANAGER, **({"force": "true"} if force else {})}
        return await self._write(
            "patch",
            "PATCH",
            resource,
            namespace,
            name,
            subresource=subresource,
            params=params,
            body=body,
            content_type=content_type,
        )

    async def delete(
        self,
        resource: ApiResource,
        namespace: str,
        name: str,
        propagation: str = "Background",
        uid: str | None = None,
    ) -> bool:
        """Delete; False when it was already gone.

        ``propagation``: ``Background`` (the garbage collector removes the dependents afterwards),
        ``Foreground`` (dependents first, the object last) or ``Orphan`` (dependents stay).  ``uid``:
        delete only that incarnation (a precondition: a newer object with the name is left alone)."""
        options: Obj = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        self.cache.forget(resource, namespace, name)
        try:
            await self.request("delete", "DELETE", resource, namespace=namespace, name=name, body=options)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def served_resources(self, group: str, version: str) -> set[str] | None:
        """Plural names a group/version serves, or None when the cluster does not serve it.

        Discovery is a non-resource URL every authenticated user may read (system:discovery)."""
        connection = self._connection()
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers={"User-Agent": USER_AGENT})
        url = f"{connection.server.rstrip('/')}/apis/{group}/{version}"
        headers = {**connection.headers(), "Accept": "application/json"}
        try:
            async with self._session.get(url, headers=headers, ssl=self._ssl(connection)) as response:
                if response.status == 404:
                    return None
                text = await response.text()
                if response.status >= 400:
                    raise _api_error(response.status, text, response.headers.get("Retry-After"))
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise ApiError(0, "ConnectionFailed", str(exc) or type(exc).__name__) from exc
        listed = json.loads(text).get("resources", [])
        return {entry["name"] for entry in listed if "/" not in entry.get("name", "/")}


def _api_error(status: int, text: str, retry_after: str | None) -> ApiError:
    try:
        payload = json.loads(text)
        reason, message = str(payload.get("reason", "")), str(payload.get("message", ""))
    except (ValueError, AttributeError):
        reason, message = "", text[:200]
    delay = None
    if retry_after:
        try:
            delay = float(retry_after)
        except ValueError:
            delay = None
    return ApiError(status, reason or "Error", message.splitlines()[0] if message else "", delay)
