"""The last known state of the objects the operator watches, so a reconcile reads its children from
memory instead of the API server.

Fed by kopf's watch events (every RLRun and SamplerPool, and the children the operator labels as
its own, deletions included), by the answers to the operator's own reads and writes, and by the
periodic resync's lists of every watched kind (:meth:`ObjectCache.replace`), which bring in what no
event announced (a watch that broke, a change during a restart).  A reconcile prompted by an event
or the resync compares its desired objects with these; a stale entry costs at most a write the
server finds already done, or a repair one event later (the event that changes an object is also
the one that asks for its owner's reconcile).  A restart's reconciles read the API server.

Only kinds that are watched are kept (anything else could change with no event to say so), and of
children only those carrying the label the watch selects on.  An answer never replaces a newer one:
resource versions are compared when both are integers (etcd's revisions, as every Kubernetes API
server gives them); otherwise the later arrival wins.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from mixrl.api.kube_types import Obj
from mixrl.operator.kube.rbac import ApiResource

Key = tuple[str, str, str, str]
"""(API group, plural, namespace, name)."""
TOMBSTONES = 10_000
"""Deletions remembered (the most recent): an operator that outlives many runs stays bounded."""


def _key(resource: ApiResource, namespace: str, name: str) -> Key:
    return (resource.group, resource.plural, namespace, name)


def _version(obj: Obj) -> int | None:
    value = obj.get("metadata", {}).get("resourceVersion")
    return int(value) if isinstance(value, str) and value.isdigit() else None


class ObjectCache:
    """``watched`` maps each kept resource to the labels its watch selects on (empty: all)."""

    def __init__(self, watched: Mapping[ApiResource, Mapping[str, str]] | None = None):
        self._watched: dict[tuple[str, str], dict[str, str]] = {}
        self._resources: dict[tuple[str, str], ApiResource] = {}
        self._objects: dict[Key, Obj] = {}
        self._deleted: dict[Key, int] = {}
        """The resource version of each watched deletion: an answer sent before it must not bring
        the object back."""
        self.hits = 0
        """Reads answered from memory (for logs and tests)."""
        if watched:
            self.watch(watched.items())

    def watch(self, resources: Iterable[tuple[ApiResource, Mapping[str, str]]]) -> None:
        for resource, labels in resources:
            self._watched[(resource.group, resource.plural)] = dict(labels)
            self._resources[(resource.group, resource.plural)] = resource

    def watched(self) -> list[tuple[ApiResource, dict[str, str]]]:
        """Each kept resource with the labels its watch selects on."""
        return [(self._resources[key], dict(labels)) for key, labels in self._watched.items()]

    def keeps(self, resource: ApiResource) -> bool:
        return (resource.group, resource.plural) in self._watched

    def get(self, resource: ApiResource, namespace: str, name: str) -> Obj | None:
        """The last known object, or None when it is not known (not that it does not exist)."""
        found = self._objects.get(_key(resource, namespace, name))
        if found is not None:
            self.hits += 1
        return found

    def list(self, resource: ApiResource, namespace: str, labels: Mapping[str, str]) -> list[Obj]:
        """The known objects of ``resource`` in ``namespace`` that carry ``labels``."""
        return [
            obj
            for (group, plural, ns, _), obj in self._objects.items()
            if (group, plural, ns) == (resource.group, resource.plural, namespace)
            and all((obj["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    def store(self, resource: ApiResource, obj: Obj) -> None:
        """Keep ``obj`` (an answer or an event) unless an entry as new or newer is kept already, or
        it is not an object the watches would tell about."""
        selector = self._watched.get((resource.group, resource.plural))
        meta = obj.get("metadata") or {}
        if selector is None or "name" not in meta:
            return
        labels = meta.get("labels") or {}
        key = _key(resource, meta.get("namespace", ""), meta["name"])
        if any(labels.get(k) != v for k, v in selector.items()):
            self._objects.pop(key, None)  # relabelled out of the watch: no event will follow it
            return
        version = _version(obj)
        if version is not None and version <= self._deleted.get(key, -1):
            return
        self._deleted.pop(key, None)
        kept = self._objects.get(key)
        if kept is not None:
            old = _version(kept)
            same_object = kept["metadata"].get("uid") == meta.get("uid")
            if same_object and old is not None and version is not None and version < old:
                return
        if "managedFields" in meta:  # often half the object, and nothing a reconcile compares
            obj = {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
        self._objects[key] = obj

    def replace(self, resource: ApiResource, namespace: str, items: Iterable[Obj], version: str) -> int:
        """What a list of ``resource`` in ``namespace`` at resource version ``version`` showed (the
        items carrying the watch's labels): each is kept as an answer is, and what is known but was
        not listed, and is not newer than the list, is forgotten (its deletion's event was missed).
        Returns how many known objects it forgot."""
        listed = set()
        for obj in items:
            # A list's items carry no kind: put it back, as a watch event or a GET has it.
            self.store(resource, {"apiVersion": resource.api_version, "kind": resource.kind, **obj})
            listed.add(obj.get("metadata", {}).get("name"))
        as_of = int(version) if version.isdigit() else None
        forgotten = 0
        for key, obj in list(self._objects.items()):
            if key[:3] != (resource.group, resource.plural, namespace) or key[3] in listed:
                continue
            kept_version = _version(obj)
            if as_of is not None and kept_version is not None and kept_version > as_of:
                continue  # created after the list was taken
            del self._objects[key]
            forgotten += 1
        return forgotten

    def deleted(self, resource: ApiResource, obj: Obj) -> None:
        """A watch said ``obj`` was deleted."""
        meta = obj.get("metadata") or {}
        key = _key(resource, meta.get("namespace", ""), meta.get("name", ""))
        self._objects.pop(key, None)
        version = _version(obj)
        if version is not None and self.keeps(resource):
            self._deleted[key] = version
            if len(self._deleted) > TOMBSTONES:  # the oldest: no answer can still be on its way
                del self._deleted[next(iter(self._deleted))]

    def forget(self, resource: ApiResource, namespace: str, name: str) -> None:
        """Not known any more (a write found it gone, or we deleted it): the next read asks."""
        self._objects.pop(_key(resource, namespace, name), None)
