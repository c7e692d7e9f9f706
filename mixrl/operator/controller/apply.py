"""Idempotent writes: compare each desired object with the live one, write only what differs.

A child is written when it is missing, when its ``mixrl.dev/desired-hash`` annotation differs from
the desired one (the spec changed), or when a field the operator sets no longer holds the value it
set (a hand edit: :func:`first_difference`).  Otherwise nothing is sent, so reconciling an
unchanged cluster — a resync, a child event, an operator restart — costs reads only (and a
reconcile an event asked for reads the children the watches showed from memory:
:mod:`mixrl.operator.kube.cache`).

Writes are server-side applies by the field manager ``mixrl-operator`` (fields it stops setting
disappear; a forced apply takes back a field someone edited).  Exceptions: a SamplerPool is created
with its seed replicas and later merge-patched without them (after creation ``spec.replicas``
belongs to whoever scales the pool), and a PersistentVolumeClaim is created once and afterwards
only grows (:func:`converge_claim`).

When the API server refuses an update because a field is immutable (422), the object is recreated
when that is safe (:func:`immutable_changes`, :func:`deletion_policy`); a claim that would have to
shrink is left alone and reported.  Failures are recorded per object (:class:`Failure`) so one
refused object never keeps the others from being applied.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from mixrl.api.kube_types import Obj
from mixrl.operator.builders.objects import HASH_ANNOTATION
from mixrl.operator.controller.observed_status import Reason
from mixrl.operator.kube.client import ApiError, KubeClient
from mixrl.operator.kube.rbac import PVCS, SAMPLERPOOLS, SECRETS, ApiResource, resource_of

log = logging.getLogger("mixrl.operator")

# Created by POST, never by apply: their later writes are not server-side applies (see above).
# Created by POST, so fields only the creation sets (a pool's first replicas, a Secret's token) belong
# to that request's manager, and later server-side applies without them leave them alone.
CREATED_BY_POST = (SAMPLERPOOLS, PVCS, SECRETS)

# What the API server lets change in a StatefulSet's spec (apps/v1 validation, Kubernetes 1.28+);
# everything else needs a new object.
STATEFULSET_MUTABLE = frozenset(
    {
        "replicas",
        "ordinals",
        "template",
        "updateStrategy",
        "persistentVolumeClaimRetentionPolicy",
        "minReadySeconds",
    }
)


class OwnerGone(Exception):
    """The owner was deleted while we reconciled it: creating children now would orphan them."""


class StillTerminating(Exception):
    """A child with our name is being deleted; it must be gone before we can create it again."""


class NameTaken(Exception):
    """A child's name is taken by an object another owner controls: it is not ours to change."""


@dataclass(frozen=True)
class Failure:
    """One child that could not be made to match its desired state (the others were applied)."""

    object: str
    """``Kind/name``."""
    message: str
    retry: bool = True
    """False when retrying cannot help until the spec (or the cluster) changes: the message then
    says what to do."""
    status: int = 0
    """The API server's HTTP status (0: no answer, or not an API error)."""
    retry_after: float | None = None
    waiting: bool = False
    """Not an error: the old object is still being deleted (a recreation in progress)."""
    reason: str = Reason.IMMUTABLE_FIELD_CHANGED
    """The condition's and event's reason when retrying cannot help."""


class ApplyFailed(Exception):
    """Some children failed (and were reported on the owner's status); the reconcile must be retried."""

    def __init__(self, failures: list[Failure]):
        self.failures = failures
        super().__init__("; ".join(f"{f.object}: {f.message}" for f in failures))

    @property
    def retry_after(self) -> float | None:
        asked = [f.retry_after for f in self.failures if f.retry_after is not None]
        return max(asked) if asked else None

    @property
    def forbidden_only(self) -> bool:
        """Only 401/403: credentials or RBAC, fixable outside the operator (retry slowly)."""
        return all(f.status in (401, 403) for f in self.failures)


@dataclass
class ApplyReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    """Updated because a hand edit changed a field the operator sets (``Kind/name field``)."""
    recreated: list[str] = field(default_factory=list)
    """Deleted to be created again, because an immutable field had to change (``Kind/name (fields)``)."""
    failures: list[Failure] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated or self.deleted or self.recreated)

    def extend(self, other: ApplyReport) -> None:
        """Add ``other``'s records after this report's own."""
        for name in ("created", "updated", "deleted", "unchanged", "repaired", "recreated", "failures"):
            getattr(self, name).extend(getattr(other, name))

    @property
    def retryable(self) -> list[Failure]:
        return [f for f in self.failures if f.retry]

    def summary(self) -> str:
        parts = [f"{verb} {', '.join(names)}" for verb, names in self._groups() if names]
        return "; ".join(parts) if parts else "no changes"

    def _groups(self) -> list[tuple[str, list[str]]]:
        return [
            ("created", self.created),
            ("updated", self.updated),
            ("repaired", self.repaired),
            ("recreated", self.recreated),
            ("deleted", self.deleted),
        ]


def label(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def live_hash(obj: Obj) -> str | None:
    annotations: dict[str, str] = obj.get("metadata", {}).get("annotations") or {}
    return annotations.get(HASH_ANNOTATION)


def merged(base: Obj, extra: Obj) -> Obj:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# ----------------------------------------------------------------------------- comparison (pure)

_QUANTITY = re.compile(
    r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?$"
)
_SUFFIX = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    **{s: Fraction(1024 ** (i + 1)) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
}


def quantity(value: Any) -> Fraction | None:
    """A Kubernetes resource quantity's value ("1500m", "100Gi", 8), or None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return Fraction(value)
    if not isinstance(value, str):
        return None
    found = _QUANTITY.match(value.strip())
    if found is None:
        return None
    number, exponent, suffix = found.groups()
    amount = Fraction(number)
    if exponent:
        amount *= Fraction(10) ** int(exponent[1:])
    if suffix:
        amount *= _SUFFIX[suffix]
    return amount


def same_scalar(want: Any, have: Any) -> bool:
    """Equal, or the same quantity written differently: the API server canonicalizes quantities
    ("0.5" comes back as "500m", a GPU count 8 as "8"), which must not count as a hand edit."""
    if want == have and type(want) is type(have):
        return True
    wanted, found = quantity(want), quantity(have)
    return wanted is not None and wanted == found


def is_empty(value: Any) -> bool:
    """Values the API server omits when it serializes (Go's ``omitempty``): absent means the same."""
    if value is None or value is False:
        return True
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value == 0
    return value in ("", [], {})


# Keys that identify the elements of a list of objects (Kubernetes' merge keys, in order of preference).
LIST_KEYS = ("name", "mountPath", "uid", "containerPort", "port", "devicePath", "type")


def _path(base: str, key: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{base}.{key}" if base else key
    return f'{base}["{key}"]'


def _list_key(items: list[Any]) -> str | None:
    """The key that tells apart the desired list's elements, if there is one."""
    if not items or not all(isinstance(item, dict) for item in items):
        return None
    for key in LIST_KEYS:
        values = [item.get(key) for item in items]
        if all(v is not None for v in values) and len(set(map(str, values))) == len(values):
            return key
    return None


def first_difference(want: Any, have: Any, path: str = "") -> str | None:
    """The first field where ``have`` (live) does not hold what ``want`` (desired) sets, or None.

    Only what ``want`` sets is compared, because that is all a server-side apply by our field
    manager owns: fields the API server defaults, annotations and labels others add, and list
    elements of other managers (an injected sidecar's volume) are not drift, and an apply could
    not remove them anyway.  Lists of objects are matched by their merge key (``name``, ``uid``,
    ``mountPath`` …) when the desired elements have a unique one, else by position; lists of
    scalars (``command``, ``args``) must be equal."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return None if is_empty(want) and have is None else path or "."
        for key, value in want.items():
            sub = _path(path, key)
            if key not in have or have[key] is None:
                if is_empty(value):
                    continue
                return sub
            found = first_difference(value, have[key], sub)
            if found is not None:
                return found
        return None
    if isinstance(want, list):
        if not isinstance(have, list):
            return None if not want and have is None else path
        key = _list_key(want)
        if key is not None:
            index = {str(item.get(key)): item for item in have if isinstance(item, dict)}
            for item in want:
                sub = f'{path}[{key}="{item[key]}"]'
                if str(item[key]) not in index:
                    return sub
                found = first_difference(item, index[str(item[key])], sub)
                if found is not None:
                    return found
            return None
        if len(want) != len(have):
            return path
        for i, (w, h) in enumerate(zip(want, have, strict=True)):
            found = first_difference(w, h, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return None if same_scalar(want, have) else path or "."


def owned_fields(desired: Obj) -> Obj:
    """The part of a desired object that a write sets and a hand edit can change."""
    return {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "status")}


def hand_edit(desired: Obj, live: Obj) -> str | None:
    """The first field the operator sets that someone changed in the live object, or None."""
    return first_difference(owned_fields(desired), live)


def live_hand_edit(desired: Obj, live: Obj) -> str | None:
    """:func:`hand_edit` of an object as the API server gave it, remembered per version of it (its
    uid and resource version) and desired hash: a run's children are compared again at every
    reconcile its pools' status changes ask for, mostly unchanged (27–41 % of the operator's
    reconcile time was this walk: bench/cluster_scale.py, 400 nodes × 20 runs, under py-spy)."""
    meta = live.get("metadata") or {}
    key = (meta.get("uid"), meta.get("resourceVersion"), live_hash(desired))
    if None in key:
        return hand_edit(desired, live)
    if key not in _HAND_EDITS:
        if len(_HAND_EDITS) >= HAND_EDITS_KEPT:
            del _HAND_EDITS[next(iter(_HAND_EDITS))]
        _HAND_EDITS[key] = hand_edit(desired, live)
    return _HAND_EDITS[key]


HAND_EDITS_KEPT = 8192
_HAND_EDITS: dict[tuple[Any, Any, Any], str | None] = {}
"""(live uid, live resourceVersion, desired hash) -> :func:`live_hand_edit`'s answer, the oldest
dropped first."""


def immutable_changes(desired: Obj, live: Obj) -> list[str]:
    """Fields the desired object changes that the API server does not let change in place.

    StatefulSet: anything in ``spec`` but the mutable few (volumeClaimTemplates, selector,
    serviceName, podManagementPolicy …).  Deployment: the selector.  Service: ``clusterIP``
    (headless or not).  Claims are handled by :func:`converge_claim` and never get here."""
    kind = desired.get("kind")
    want, have = desired.get("spec") or {}, live.get("spec") or {}
    if kind == "StatefulSet":
        changed = [
            f"spec.{key}"
            for key in sorted(set(want) - STATEFULSET_MUTABLE)
            if first_difference(want[key], have.get(key), f"spec.{key}") is not None
        ]
        if "volumeClaimTemplates" not in want and have.get("volumeClaimTemplates"):
            changed.append("spec.volumeClaimTemplates")
        return changed
    if kind == "Deployment":
        selector = first_difference(want.get("selector"), have.get("selector"), "spec.selector")
        return ["spec.selector"] if selector is not None else []
    if kind == "Service":
        headless_now = have.get("clusterIP") == "None"
        headless_wanted = want.get("clusterIP") == "None"
        return ["spec.clusterIP"] if headless_now != headless_wanted else []
    return []


def immutable_in_message(kind: str | None, message: str) -> list[str]:
    """What a 422 says cannot change, when comparing found nothing: a field the operator stopped
    setting (an upgrade) that the API server would have to reset.  Only the API server's own,
    unambiguous wording counts; any other 422 is reported, not acted on."""
    if kind == "StatefulSet" and "updates to statefulset spec for fields other than" in message:
        return ["spec"]
    if "field is immutable" in message or "may not change once set" in message:
        known = {"Deployment": ("spec.selector",), "Service": ("spec.clusterIP", "spec.clusterIPs")}
        named = [
            path
            for path in known.get(kind or "", ())
            if re.search(re.escape(path) + r"(\[\d+\])?: ", message)
        ]
        return named[:1]
    return []


def deletion_policy(desired: Obj, live: Obj, changed: list[str]) -> str:
    """How to delete an object that must be recreated.

    A StatefulSet whose pods would survive unchanged (same selector and pod template: only, say,
    its claim templates or service name change) is deleted with ``Orphan``: its pods keep running
    and the new StatefulSet adopts them, nothing restarts.  Otherwise ``Foreground``: the pods are
    deleted first (their GPUs freed before the new pods ask for them — a GPU cluster rarely has
    spare ones), the object goes last, and the new one starts them all together, which is what the
    trainer's rendezvous needs; it resumes from the checkpoint on its ``run`` volumes, which
    outlive the StatefulSet.  A Deployment whose selector changes is deleted ``Foreground`` too (the
    new one would not adopt the old ReplicaSets).  A Service has no dependents worth waiting for."""
    kind = desired.get("kind")
    if kind == "StatefulSet":
        want, have = desired.get("spec") or {}, live.get("spec") or {}
        same_pods = (
            "spec.selector" not in changed
            and first_difference(want.get("template"), have.get("template"), "spec.template") is None
        )
        return "Orphan" if same_pods else "Foreground"
    if kind == "Deployment":
        return "Foreground"
    return "Background"


def controller_of(obj: Obj) -> Obj | None:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return next((ref for ref in refs if ref.get("controller")), None)


def taken_by(desired: Obj, live: Obj) -> str | None:
    """The other owner (``Kind name``) that controls the live object of a desired child's name, or None.

    Children are named ``<run>-<component>`` and ``<run>-<pool>``, so two runs of one namespace can
    ask for the same name (run ``a`` with pool ``b-router``, run ``a-b``'s router): writing it
    would take over, or — a Deployment's selector being immutable — delete and recreate, the
    other run's object.  An owner of the same kind and name with another uid is the owner's
    predecessor (a run deleted and created again before the garbage collector came): its children
    are taken over, as before."""
    want, have = controller_of(desired), controller_of(live)
    if want is None or have is None:
        return None
    if (have.get("kind"), have.get("name")) == (want.get("kind"), want.get("name")):
        return None
    return f"{have.get('kind')} {have.get('name')}"


def refuse_if_taken(desired: Obj, live: Obj) -> None:
    other = taken_by(desired, live)
    if other is not None:
        owner = controller_of(desired) or {}
        raise NameTaken(
            f"the name is taken: {other} controls it, so {owner.get('kind')} {owner.get('name')} leaves "
            "it alone; objects are named <run>-<component> and <run>-<pool>, so rename this run or pool"
        )


def claim_size(obj: Obj) -> Any:
    return (((obj.get("spec") or {}).get("resources") or {}).get("requests") or {}).get("storage")


def shrink_refusal(name: str, source: str, want: str, have: str) -> str:
    return (
        f"{source} {want} is smaller than PersistentVolumeClaim {name}'s {have}, and a claim can only "
        f"grow: set {source} to at least {have}, or delete the claim (its data is lost) so the "
        f"operator creates it at {want}"
    )


# ----------------------------------------------------------------------------- writes


@dataclass(frozen=True)
class Applied:
    before: Obj | None
    """The live object before this call (None when it did not exist)."""
    after: Obj
    """The live object after this call."""


async def apply_object(
    client: KubeClient,
    desired: Obj,
    report: ApplyReport,
    seed: Obj | None = None,
    before_create: Callable[[], Awaitable[None]] | None = None,
    on_update: Callable[[Obj], Obj] | None = None,
    size_source: str = "spec.resources.requests.storage",
    cached: bool = False,
    unseen_absent: bool = False,
) -> Applied | None:
    """Make one child match ``desired``; record a failure in ``report`` instead of raising it.

    ``seed`` holds fields set only on creation (a SamplerPool's first ``spec.replicas``);
    ``before_create`` runs before any creation or recreation and may raise :class:`OwnerGone`
    (which propagates: the owner's reconcile ends); ``on_update`` maps the live object to extra
    fields for the same update (a SamplerPool's replicas brought within new bounds), so an update
    stays one write; ``size_source`` names the spec field a claim's size comes from, for the message
    that refuses to shrink it; ``cached``: compare with the object as the watches last showed it,
    when they did (:meth:`KubeClient.get`); ``unseen_absent``: with ``cached``, one they never
    showed does not exist (:func:`absent_as_watched`).  Returns the object as last seen (None when
    it is not known)."""
    resource = resource_of(desired)
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    live: Obj | None = None
    try:
        if cached and unseen_absent and absent_as_watched(client, resource, namespace, name, seed):
            return await create(client, desired, report, seed, before_create)
        live = await client.get(resource, namespace, name, cached=cached)
        return await converge(client, desired, live, report, seed, before_create, on_update, size_source)
    except StillTerminating as exc:
        report.failures.append(Failure(label(desired), str(exc), waiting=True))
    except NameTaken as exc:
        report.failures.append(Failure(label(desired), str(exc), retry=False, reason=Reason.NAME_TAKEN))
    except ApiError as exc:
        report.failures.append(Failure(label(desired), str(exc), True, exc.status, exc.retry_after))
    return Applied(live, live) if live is not None else None


def absent_as_watched(
    client: KubeClient, resource: ApiResource, namespace: str, name: str, seed: Obj | None
) -> bool:
    """Whether a child may be created without reading it first: the watches, which show every
    object of its kind carrying the operator's label, never showed it, and its creation cannot
    overwrite one that exists after all — a POST is refused (409, then read: :func:`create`), a
    server-side apply updates it instead, which is why one that sets fields only on creation
    (``seed``) is read first.  Saves a GET per child a new run's reconciles create."""
    return (
        (seed is None or resource in CREATED_BY_POST)
        and client.cache.keeps(resource)
        and client.cache.get(resource, namespace, name) is None
    )


@dataclass(frozen=True)
class Child:
    """One object for :func:`apply_objects`, with :func:`apply_object`'s per-object arguments."""

    desired: Obj
    seed: Obj | None = None
    on_update: Callable[[Obj], Obj] | None = None


APPLY_CONCURRENCY = 8
"""Children of one owner written at once.  Sequential writes made a run's first reconcile 60-odd
round trips long, and its pools' own reconciles (the second hop to their Deployments) waited for
them; on the 2-core bench the operator's p99 did not measurably move (bench/cluster_scale.py,
docs/benchmarks.md), its CPU, shared with the control plane, being the limit there."""


async def apply_objects(
    client: KubeClient,
    children: Sequence[Child],
    report: ApplyReport,
    before_create: Callable[[], Awaitable[None]] | None = None,
    size_source: str = "spec.resources.requests.storage",
    first: Callable[[Obj], bool] = lambda _: False,
    concurrency: int = APPLY_CONCURRENCY,
    cached: bool = False,
    unseen_absent: bool = False,
) -> dict[str, Applied]:
    """:func:`apply_object` for each child, up to ``concurrency`` at once, those ``first`` picks
    started before the others; ``report`` gets their records in the order of ``children`` whatever
    order they finished in.  Returns ``Kind/name`` -> the object as last seen.  An
    :class:`OwnerGone` from ``before_create`` (which must tolerate concurrent calls) is raised once
    every started write has finished; the records made until then are in ``report``."""
    slots = asyncio.Semaphore(concurrency)
    reports = [ApplyReport() for _ in children]
    gone: list[OwnerGone] = []

    async def one(index: int) -> Applied | None:
        async with slots:
            if gone:
                return None
            try:
                return await apply_object(
                    client, children[index].desired, reports[index], children[index].seed,
                    before_create, children[index].on_update, size_source, cached, unseen_absent,
                )  # fmt: skip
            except OwnerGone as exc:
                gone.append(exc)
                return None

    starts = sorted(range(len(children)), key=lambda i: not first(children[i].desired))
    ordered = await asyncio.gather(*(one(index) for index in starts), return_exceptions=True)
    results = dict(zip(starts, ordered, strict=True))
    applied: dict[str, Applied] = {}
    for index, child in enumerate(children):
        report.extend(reports[index])
        result = results[index]
        if isinstance(result, BaseException):  # a bug, not an API answer: after the others finished
            raise result
        if result is not None:
            applied[label(child.desired)] = result
    if gone:
        raise gone[0]
    return applied


async def converge(
    client: KubeClient,
    desired: Obj,
    live: Obj | None,
    report: ApplyReport,
    seed: Obj | None,
    before_create: Callable[[], Awaitable[None]] | None,
    on_update: Callable[[Obj], Obj] | None,
    size_source: str,
) -> Applied:
    resource = resource_of(desired)
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    if live is not None and live.get("metadata", {}).get("deletionTimestamp"):
        raise StillTerminating(
            f"{label(desired)} is still being deleted; it is created again once it is gone"
        )
    if live is None:
        return await create(client, desired, report, seed, before_create)
    refuse_if_taken(desired, live)
    if resource is PVCS:
        return await converge_claim(client, desired, live, report, size_source)
    edited = None if live_hash(live) != live_hash(desired) else live_hand_edit(desired, live)
    if live_hash(live) == live_hash(desired) and edited is None:
        report.unchanged.append(label(desired))
        return Applied(live, live)
    body = merged(desired, on_update(live)) if on_update is not None else desired
    try:
        if resource is SAMPLERPOOLS:
            updated = await client.merge_patch(resource, namespace, name, body)
        else:
            updated = await client.apply(resource, namespace, name, body)
    except ApiError as exc:
        changed: list[str] = []
        if exc.status == 422:
            changed = immutable_changes(desired, live) or immutable_in_message(
                desired.get("kind"), exc.message
            )
        if not changed:
            raise
        return await recreate(client, desired, live, changed, report, before_create)
    report.updated.append(label(desired))
    if edited is not None:
        report.repaired.append(f"{label(desired)} {edited}")
        log.info("%s: %s was changed by hand; applied the desired value again", label(desired), edited)
        still = hand_edit(desired, updated)
        if still is not None:  # the server normalizes it, or another manager keeps it: not ours to fight
            log.warning(
                "%s: %s still differs after the apply (normalized by the server?)", label(desired), still
            )
    return Applied(live, updated)


async def create(
    client: KubeClient,
    desired: Obj,
    report: ApplyReport,
    seed: Obj | None,
    before_create: Callable[[], Awaitable[None]] | None,
) -> Applied:
    resource = resource_of(desired)
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    if before_create is not None:
        await before_create()
    try:
        if resource in CREATED_BY_POST:
            created = await client.create(resource, namespace, merged(desired, seed or {}))
        else:
            created = await client.apply(resource, namespace, name, merged(desired, seed or {}))
    except ApiError as exc:
        if exc.status != 409:
            raise
        # Someone (our previous attempt, whose answer was lost) created it: compare and patch next time.
        live = await client.get(resource, namespace, name)
        if live is None:
            raise
        refuse_if_taken(desired, live)
        report.unchanged.append(label(desired))
        return Applied(live, live)
    report.created.append(label(desired))
    return Applied(None, created)


async def recreate(
    client: KubeClient,
    desired: Obj,
    live: Obj,
    changed: list[str],
    report: ApplyReport,
    before_create: Callable[[], Awaitable[None]] | None,
) -> Applied:
    """Delete an object whose immutable fields must change, and create it again once it is gone.

    The deletion names the live uid as a precondition (never delete a newer object someone made
    meanwhile).  Orphan and Background deletions are usually finished at once; a Foreground one
    keeps the object (with a deletionTimestamp) until its pods are gone, and the creation then
    happens on a later reconcile: the retry, or the watch event of the deletion."""
    resource = resource_of(desired)
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    if before_create is not None:
        await before_create()
    policy = deletion_policy(desired, live, changed)
    log.warning(
        "%s: %s cannot change in place; deleting it (propagationPolicy %s) to create it again",
        label(desired),
        ", ".join(changed),
        policy,
    )
    await client.delete(resource, namespace, name, propagation=policy, uid=live["metadata"].get("uid"))
    report.recreated.append(f"{label(desired)} ({', '.join(changed)}; propagationPolicy {policy})")
    again = await client.get(resource, namespace, name)
    if again is not None:
        raise StillTerminating(
            f"{label(desired)} is being recreated ({', '.join(changed)} cannot change in place); "
            "waiting for the old one to be deleted"
        )
    created = await client.apply(resource, namespace, name, desired)
    return Applied(live, created)


async def converge_claim(
    client: KubeClient, desired: Obj, live: Obj, report: ApplyReport, size_source: str
) -> Applied:
    """A claim's spec is immutable but for its size, which may only grow (the storage class must
    allow expansion).  A bigger size is patched; a smaller one, or a refused expansion, is reported
    as a failure that retrying cannot fix (the message says what to do), and the claim is kept."""
    name = desired["metadata"]["name"]
    want, have = claim_size(desired), claim_size(live)
    wanted, found = quantity(want), quantity(have)
    if wanted is None or found is None or wanted == found:
        report.unchanged.append(label(desired))
        return Applied(live, live)
    if wanted < found:
        report.failures.append(
            Failure(label(desired), shrink_refusal(name, size_source, want, have), retry=False)
        )
        return Applied(live, live)
    patch = {
        "metadata": {"annotations": {HASH_ANNOTATION: live_hash(desired)}},
        "spec": {"resources": {"requests": {"storage": want}}},
    }
    try:
        updated = await client.merge_patch(PVCS, desired["metadata"]["namespace"], name, patch)
    except ApiError as exc:
        if exc.status not in (403, 422):
            raise
        message = (
            f"expanding PersistentVolumeClaim {name} from {have} to {want} was refused ({exc.message}): "
            f"its StorageClass must allow volume expansion (allowVolumeExpansion: true), or set "
            f"{size_source} back to {have}"
        )
        report.failures.append(Failure(label(desired), message, retry=False, status=exc.status))
        return Applied(live, live)
    report.updated.append(label(desired))
    return Applied(live, updated)


__all__ = [
    "Applied",
    "ApplyFailed",
    "ApplyReport",
    "Child",
    "Failure",
    "NameTaken",
    "OwnerGone",
    "StillTerminating",
    "apply_object",
    "apply_objects",
    "deletion_policy",
    "first_difference",
    "hand_edit",
    "immutable_changes",
    "immutable_in_message",
    "label",
    "quantity",
]
