"""A Kubernetes API stand-in: kmock's emulator plus the API-server behaviour the operator relies on.

kmock (the kopf project's API mock) serves discovery, list, watch, create, merge patch and delete in memory.
What it lacks and the operator depends on is added here, each piece a small, named emulation of
what kube-apiserver or kube-controller-manager does:

- metadata bookkeeping: ``uid``, ``resourceVersion`` (bumped on every write), ``generation``
  (bumped when ``spec`` changes) and ``creationTimestamp``;
- the status subresource: the main endpoint ignores ``status``, ``/status`` changes only ``status``;
- a Secret's ``stringData`` written into its ``data``, base64-encoded, on creation;
- the scale subresource of SamplerPools (``spec.replicas``), as ``kubectl scale`` uses it;
- server-side apply by a single manager: the applied object replaces the previous one (server
  fields and status kept), and applying to a missing object creates it;
- the garbage collector: deleting an object deletes, in the background, every object whose owner
  references all point to deleted uids (recursively); ``propagationPolicy: Orphan`` strips the
  dependents' references to it instead, and ``Foreground`` keeps the object (deletionTimestamp and
  the ``foregroundDeletion`` finalizer) for ``foreground_delay_s`` while its dependents go first;
  a ``preconditions.uid`` that does not match answers 409;
- fault injection: the next N matching requests (by method, resource, subresource and optionally
  name) fail with a chosen status, reason and message, before any state change;
- silent changes (:meth:`ApiServer.tamper`, :meth:`ApiServer.vanish`): storage changed without a
  watch event, as when the operator missed one (a restart, a dropped watch).

Not emulated (and not relied on): admission and schema validation (immutable fields: tests inject
the 422 the API server would answer), defaulting, label selectors, resourceVersion preconditions,
managed fields.  A Deployment controller is played by the tests (they write Deployment status the
way kube-controller-manager would).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import dicts as kmock_dicts
from kmock._internal.k8s import KubernetesError

Obj = dict[str, Any]


def keep_string_data(secret: Obj) -> None:
    """A Secret's write-only ``stringData`` moved into its ``data``, base64-encoded, as the API
    server stores it."""
    if "stringData" in secret:
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in secret.pop("stringData").items()}
        secret["data"] = {**secret.get("data", {}), **encoded}


SERVER_META = ("uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp", "finalizers")

# group/version/plural -> (kind, namespaced, subresources)
RESOURCES: dict[str, tuple[str, bool, set[str]]] = {
    "v1/namespaces": ("Namespace", False, set()),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/secrets": ("Secret", True, set()),
    "v1/services": ("Service", True, {"status"}),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", True, {"status"}),
    "v1/events": ("Event", True, set()),
    "apps/v1/deployments": ("Deployment", True, {"status", "scale"}),
    "apps/v1/statefulsets": ("StatefulSet", True, {"status", "scale"}),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, set()),
    "mixrl.dev/v1alpha1/rlruns": ("RLRun", True, {"status"}),
    "mixrl.dev/v1alpha1/samplerpools": ("SamplerPool", True, {"status", "scale"}),
    "kopf.dev/v1/clusterkopfpeerings": ("ClusterKopfPeering", False, set()),
    "kopf.dev/v1/kopfpeerings": ("KopfPeering", True, set()),
}
MONITORING = {"monitoring.coreos.com/v1/podmonitors": ("PodMonitor", True, set())}
# What installing KEDA adds to discovery (its CRDs); no KEDA controller runs here.
KEDA = {"keda.sh/v1alpha1/scaledobjects": ("ScaledObject", True, {"status"})}
# What a Helm install of the chart touches besides the above.
CLUSTER_BASICS = {
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, {"status"}),
    "rbac.authorization.k8s.io/v1/clusterroles": ("ClusterRole", False, set()),
    "rbac.authorization.k8s.io/v1/clusterrolebindings": ("ClusterRoleBinding", False, set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    "monitoring.coreos.com/v1/prometheusrules": ("PrometheusRule", True, set()),
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


@dataclass
class Fault:
    method: str
    plural: str
    status: int
    times: int = 1
    subresource: str | None = None
    name: str | None = None
    reason: str = "Injected"
    message: str | None = None

    def matches(self, request: kmock.Request) -> bool:
        return (
            self.times > 0
            and request.method.value == self.method
            and request.resource is not None
            and request.resource.plural == self.plural
            and request.subresource == self.subresource
            and (self.name is None or request.name == self.name)
        )


def merge_patch_to(old: Obj, new: Obj) -> Obj:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``."""
    patch: Obj = {key: None for key in old if key not in new}
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(key), dict):
            patch[key] = merge_patch_to(old[key], value)
        elif old.get(key) != value or key not in old:
            patch[key] = value
    return patch


class ApiServer(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.faults: list[Fault] = []
        self._versions = itertools.count(1)
        self._closing = asyncio.Event()
        self.foreground_delay_s = 0.3
        """How long a Foreground deletion keeps the object (its pods terminating, in a cluster)."""
        self._pending: set[asyncio.Task[None]] = set()

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # No keep-alive: a stopping kopf waits (5 s) for every task spawned while it ran, and the
        # server side of an idle keep-alive connection is such a task.
        response = await super().__call__(raw_request)
        response.force_close()
        return response

    async def _serve_server_version(self, request: kmock.Request) -> Any:
        # kmock says 1.26; the chart requires >= 1.28 (and Helm checks it).
        return {"major": "1", "minor": "31", "gitVersion": "v1.31.0", "platform": "linux/amd64"}

    async def _serve_version(self, request: kmock.Request) -> Any:
        # kmock writes the core group's groupVersion as "/v1"; client-go (helm) needs "v1".
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and payload.get("groupVersion", "").startswith("/"):
            payload["groupVersion"] = payload["groupVersion"].lstrip("/")
        return payload

    def end_watches(self) -> None:
        """End every open watch stream, as an API server does at its timeout.  A stopping operator
        waits for tasks spawned while it ran, and the server side of its watches is one of them."""
        self._closing.set()

    def allow_watches(self) -> None:
        self._closing.clear()

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        source = super()._serve_watch(request)
        closing = asyncio.ensure_future(self._closing.wait())
        following: asyncio.Future[Any] | None = None
        try:
            while True:
                following = asyncio.ensure_future(anext(source))
                await asyncio.wait({following, closing}, return_when=asyncio.FIRST_COMPLETED)
                if not following.done():
                    return
                try:
                    event = following.result()
                except StopAsyncIteration:
                    return
                following = None
                yield event
        finally:
            # Also when the client went away and aiohttp cancelled us mid-wait.
            for task in (following, closing):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await task
            await source.aclose()

    def register(
        self,
        with_monitoring: bool = False,
        with_cluster_basics: bool = False,
        crds: bool = True,
        with_keda: bool = False,
    ) -> None:
        """Serve the built-in kinds; ``crds=False`` leaves the custom kinds to CRDs created later."""
        table = {**RESOURCES, **(MONITORING if with_monitoring else {}), **(KEDA if with_keda else {})}
        table |= CLUSTER_BASICS if with_cluster_basics else {}
        if not crds:
            table = {k: v for k, v in table.items() if k.split("/")[0] not in ("mixrl.dev", "kopf.dev")}
        for key, (kind, namespaced, subresources) in table.items():
            self._serve_kind(key, kind, namespaced, subresources)

    def _serve_kind(self, key: str, kind: str, namespaced: bool, subresources: set[str]) -> None:
        self.resources[key] = kmock.ResourceInfo(
            kind=kind, singular=kind.lower(), namespaced=namespaced, verbs=VERBS, subresources=subresources
        )

    def _establish(self, crd: Obj) -> None:
        """What the apiextensions server does with a new CRD: accept its names and serve its kind."""
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for version in spec.get("versions", []):
            if version.get("served"):
                key = f"{spec['group']}/{version['name']}/{names['plural']}"
                subresources = set(version.get("subresources", {}))
                self._serve_kind(key, names["kind"], spec.get("scope") == "Namespaced", subresources)
        crd["status"] = {
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts"},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted"},
            ],
            "acceptedNames": names,
            "storedVersions": [v["name"] for v in spec.get("versions", []) if v.get("storage")],
        }

    def fail(
        self,
        method: str,
        plural: str,
        status: int,
        times: int = 1,
        subresource: str | None = None,
        name: str | None = None,
        reason: str = "Injected",
        message: str | None = None,
    ) -> Fault:
        fault = Fault(method, plural, status, times, subresource, name, reason, message)
        self.faults.append(fault)
        return fault

    def tamper(self, resource: str, namespace: str | None, name: str, patch: Obj) -> None:
        """Merge-patch the stored object without a watch event (one the watch missed): its
        resourceVersion moves, as every write on an API server moves it."""
        version = str(next(self._versions))
        self.objects[kmock.resource(resource), namespace, name].patch(
            {**patch, "metadata": {**patch.get("metadata", {}), "resourceVersion": version}}
        )

    def vanish(self, resource: str, namespace: str | None, name: str) -> None:
        """Remove the stored object without a watch event."""
        self.objects[kmock.resource(resource), namespace, name].delete()

    # ------------------------------------------------------------------ state access for tests

    def live(self, resource: str, namespace: str | None, name: str) -> Obj | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def names(self, resource: str, namespace: str | None = None) -> set[str]:
        wanted = kmock.resource(resource)
        return {
            name
            for (res, ns, name), obj in self.objects.items()
            if res == wanted and not obj.deleted and (namespace is None or ns == namespace)
        }

    # ------------------------------------------------------------------ request handling

    def _has_status(self, request: kmock.Request) -> bool:
        known = {(r.group, r.version, r.plural): info for r, info in self.resources.items()}
        info = known.get((request.resource.group, request.resource.version, request.resource.plural))
        return info is not None and "status" in info.subresources

    def _stored(self, request: kmock.Request, name: str | None = None) -> Obj | None:
        key = (request.resource, request.namespace, name or request.name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key].raw
        return None

    def _fill_new(self, request: kmock.Request, data: Obj) -> None:
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta.setdefault("namespace", request.namespace)
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(next(self._versions))
        meta["generation"] = 1
        meta["creationTimestamp"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if self._has_status(request):
            data.pop("status", None)
        if request.resource.plural == "secrets":
            keep_string_data(data)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        for fault in self.faults:
            if fault.matches(request):
                fault.times -= 1
                message = fault.message or f"injected {fault.status}"
                return await self._render_error(
                    KubernetesError(status=fault.status, reason=fault.reason, message=message)
                )
        if request.action == kmock.action.DELETE and request.name and isinstance(request.data, dict):
            answered = await self._delete_with_options(request, request.data)
            if answered is not None:
                return answered
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                self._fill_new(request, request.data)
                if request.resource.plural == "customresourcedefinitions":
                    self._establish(request.data)
            elif request.action == kmock.action.UPDATE:
                created = await self._prepare_update(request)
                if created is not None:
                    return created
        response = await super()._handle(request)
        if request.action == kmock.action.DELETE:
            await self._collect_garbage()
        return response

    async def _prepare_update(self, request: kmock.Request) -> aiohttp.web.StreamResponse | None:
        """Rewrite a PATCH in place into the merge patch the API server would effectively apply."""
        data: Obj = request.data
        live = self._stored(request)
        apply = request.headers.get("Content-Type", "").startswith("application/apply-patch")
        if live is None:
            if not apply:
                return None  # kmock answers 404
            body = copy.deepcopy(data)
            self._fill_new(request, body)
            async with self._lock:
                self.objects[(request.resource, request.namespace, request.name)] = body
                await self._buses[request.resource].put({"type": "ADDED", "object": copy.deepcopy(body)})
            return aiohttp.web.json_response(body, status=201)
        if request.subresource == "status":
            patch: Obj = {"status": data.get("status")}
        elif request.subresource == "scale":
            patch = {"spec": {"replicas": data.get("spec", {}).get("replicas")}}
        elif apply:
            target = copy.deepcopy(data)
            target["metadata"] = {
                **{k: v for k, v in live["metadata"].items() if k in SERVER_META},
                **{k: v for k, v in target.get("metadata", {}).items() if k not in SERVER_META},
            }
            if "status" in live:
                target["status"] = live["status"]
            patch = merge_patch_to(live, target)
        else:
            patch = copy.deepcopy(data)
            if self._has_status(request):
                patch.pop("status", None)
        after = kmock_dicts.patch_dict(copy.deepcopy(live), patch)
        meta_patch = patch.setdefault("metadata", {})
        if not isinstance(meta_patch, dict):
            patch["metadata"] = meta_patch = {}
        meta_patch["resourceVersion"] = str(next(self._versions))
        if after.get("spec") != live.get("spec"):
            meta_patch["generation"] = int(live["metadata"].get("generation", 1)) + 1
        data.clear()
        data.update(patch)
        return None

    async def _delete_with_options(
        self, request: kmock.Request, options: Obj
    ) -> aiohttp.web.StreamResponse | None:
        """DeleteOptions: the uid precondition, and the Orphan and Foreground propagation policies
        (Background is kmock's deletion plus :meth:`_collect_garbage`).  None: kmock carries on."""
        live = self._stored(request)
        if live is None:
            return None
        uid = (options.get("preconditions") or {}).get("uid")
        if uid is not None and uid != live["metadata"].get("uid"):
            message = f"Precondition failed: UID in precondition: {uid}, UID in object meta: {live['metadata'].get('uid')}"
            return await self._render_error(KubernetesError(status=409, reason="Conflict", message=message))
        policy = options.get("propagationPolicy")
        if policy == "Orphan":
            async with self._lock:
                for obj in self.objects.values():
                    refs = obj.raw.get("metadata", {}).get("ownerReferences") if not obj.deleted else None
                    if refs and any(ref.get("uid") == live["metadata"]["uid"] for ref in refs):
                        kept = [ref for ref in refs if ref.get("uid") != live["metadata"]["uid"]]
                        obj.patch({"metadata": {"ownerReferences": kept or None}})
            return None
        if policy != "Foreground" or live["metadata"].get("deletionTimestamp"):
            return None
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            stored = self.objects[key]
            stored.patch(
                {
                    "metadata": {
                        "deletionTimestamp": now,
                        "finalizers": [*(live["metadata"].get("finalizers") or []), "foregroundDeletion"],
                        "resourceVersion": str(next(self._versions)),
                    }
                }
            )
            raw = copy.deepcopy(stored.raw)
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        task = asyncio.create_task(self._finish_foreground(key, live["metadata"]["uid"]))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return aiohttp.web.json_response(raw, status=200)

    async def _finish_foreground(self, key: Any, uid: str) -> None:
        """The dependents go first (here: at once), then the object itself."""
        await asyncio.sleep(self.foreground_delay_s)
        async with self._lock:
            for (resource, _, _), obj in list(self.objects.items()):
                refs = obj.raw.get("metadata", {}).get("ownerReferences") if not obj.deleted else None
                if refs and any(ref.get("uid") == uid for ref in refs):
                    raw = copy.deepcopy(obj.raw)
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})
            stored = self.objects[key]
            if not stored.deleted and stored.raw["metadata"].get("uid") == uid:
                raw = copy.deepcopy(stored.raw)
                stored.delete()
                await self._buses[key[0]].put({"type": "DELETED", "object": raw})
        await self._collect_garbage()

    async def _collect_garbage(self) -> None:
        """Background cascading deletion by owner uid, as kube-controller-manager does it."""
        while True:
            async with self._lock:
                alive = {obj.raw["metadata"].get("uid") for obj in self.objects.values() if not obj.deleted}
                orphans = [
                    (key, obj)
                    for key, obj in self.objects.items()
                    if not obj.deleted
                    and (refs := obj.raw.get("metadata", {}).get("ownerReferences"))
                    and not any(ref.get("uid") in alive for ref in refs)
                ]
                for (resource, _, _), obj in orphans:
                    raw = copy.deepcopy(obj.raw)
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})
            if not orphans:
                return
