"""The operator's memory of what the watches showed (pure): what it keeps, and what never replaces what."""

from __future__ import annotations

from typing import Any

import pytest

from mixrl.operator.kube import cache as cache_module
from mixrl.operator.kube.cache import ObjectCache
from mixrl.operator.kube.rbac import DEPLOYMENTS, SAMPLERPOOLS, SECRETS

MANAGED = {"app.kubernetes.io/managed-by": "mixrl-operator"}


def obj(name: str, version: str, uid: str = "u1", labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta = {"name": name, "namespace": "n", "uid": uid, "resourceVersion": version}
    return {"metadata": {**meta, "labels": MANAGED if labels is None else labels}}


def test_what_is_kept_leaves_out_the_managed_fields() -> None:
    cache = ObjectCache({DEPLOYMENTS: MANAGED})
    served = obj("d", "5")
    served["metadata"]["managedFields"] = [{"manager": "mixrl-operator", "operation": "Apply"}]
    cache.store(DEPLOYMENTS, served)
    assert cache.get(DEPLOYMENTS, "n", "d") == obj("d", "5")
    assert "managedFields" in served["metadata"]  # the answer itself is left as it was


def test_only_watched_kinds_carrying_the_watched_label_are_kept() -> None:
    cache = ObjectCache({DEPLOYMENTS: MANAGED, SAMPLERPOOLS: {}})
    cache.store(DEPLOYMENTS, {**obj("d", "5"), "spec": {"replicas": 2}})
    cache.store(SECRETS, obj("s", "5"))  # not watched: it could change with no event to say so
    cache.store(SAMPLERPOOLS, obj("p", "5", labels={}))  # watched with no selector
    cache.store(DEPLOYMENTS, obj("other", "5", labels={}))  # outside the watch's selector
    assert cache.get(DEPLOYMENTS, "n", "d") == {**obj("d", "5"), "spec": {"replicas": 2}}
    assert cache.get(SECRETS, "n", "s") is None
    assert cache.get(SAMPLERPOOLS, "n", "p") is not None
    assert cache.get(DEPLOYMENTS, "n", "other") is None
    cache.store(DEPLOYMENTS, obj("d", "6", labels={}))  # relabelled out of the watch
    assert cache.get(DEPLOYMENTS, "n", "d") is None


def test_an_older_answer_never_replaces_a_newer_one() -> None:
    cache = ObjectCache({DEPLOYMENTS: MANAGED})
    cache.store(DEPLOYMENTS, obj("d", "7"))
    cache.store(DEPLOYMENTS, obj("d", "6"))  # a watch event that arrived after our write's answer
    assert cache.get(DEPLOYMENTS, "n", "d")["metadata"]["resourceVersion"] == "7"  # type: ignore[index]
    cache.store(DEPLOYMENTS, obj("d", "3", uid="u2"))  # a new object of that name: newer by definition
    assert cache.get(DEPLOYMENTS, "n", "d")["metadata"]["uid"] == "u2"  # type: ignore[index]


def test_a_deletion_is_not_undone_by_an_answer_sent_before_it() -> None:
    cache = ObjectCache({DEPLOYMENTS: MANAGED})
    cache.store(DEPLOYMENTS, obj("d", "7"))
    cache.deleted(DEPLOYMENTS, obj("d", "9"))
    cache.store(DEPLOYMENTS, obj("d", "8"))  # our patch, answered before the deletion
    assert cache.get(DEPLOYMENTS, "n", "d") is None
    cache.store(DEPLOYMENTS, obj("d", "10", uid="u2"))  # created again
    assert cache.get(DEPLOYMENTS, "n", "d") is not None
    cache.forget(DEPLOYMENTS, "n", "d")
    assert cache.get(DEPLOYMENTS, "n", "d") is None and cache.hits == 1


def test_the_deletions_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_module, "TOMBSTONES", 3)
    cache = ObjectCache({DEPLOYMENTS: MANAGED})
    for index in range(5):
        cache.deleted(DEPLOYMENTS, obj(f"d{index}", str(10 + index)))
    cache.store(DEPLOYMENTS, obj("d0", "5"))  # its deletion is forgotten: an answer can bring it back
    cache.store(DEPLOYMENTS, obj("d4", "5"))  # remembered: refused
    assert cache.get(DEPLOYMENTS, "n", "d0") is not None and cache.get(DEPLOYMENTS, "n", "d4") is None


def test_a_list_gives_the_known_objects_of_one_namespace_carrying_the_labels() -> None:
    cache = ObjectCache({SAMPLERPOOLS: {}})
    run_a = {"mixrl.dev/run": "a"}
    cache.store(SAMPLERPOOLS, obj("a-1", "5", labels=run_a))
    cache.store(SAMPLERPOOLS, obj("b-1", "5", labels={"mixrl.dev/run": "b"}))
    elsewhere = obj("a-2", "5", labels=run_a)
    elsewhere["metadata"]["namespace"] = "other"
    cache.store(SAMPLERPOOLS, elsewhere)
    assert [o["metadata"]["name"] for o in cache.list(SAMPLERPOOLS, "n", run_a)] == ["a-1"]
    assert cache.list(DEPLOYMENTS, "n", {}) == []


def test_a_list_replaces_what_a_kind_showed_in_a_namespace() -> None:
    cache = ObjectCache({DEPLOYMENTS: MANAGED})
    cache.store(DEPLOYMENTS, obj("kept", "5"))
    cache.store(DEPLOYMENTS, obj("gone", "6"))  # deleted while no event came
    cache.store(DEPLOYMENTS, obj("newer", "12"))  # created after the list was taken
    elsewhere = obj("other-namespace", "3")
    elsewhere["metadata"]["namespace"] = "m"
    cache.store(DEPLOYMENTS, elsewhere)
    changed = {**obj("kept", "9"), "spec": {"replicas": 3}}  # changed while no event came
    assert cache.replace(DEPLOYMENTS, "n", [changed], "10") == 1
    kept = cache.get(DEPLOYMENTS, "n", "kept")
    assert kept is not None and kept["spec"] == {"replicas": 3} and kept["kind"] == "Deployment"
    assert cache.get(DEPLOYMENTS, "n", "gone") is None
    assert cache.get(DEPLOYMENTS, "n", "newer") is not None
    assert cache.get(DEPLOYMENTS, "m", "other-namespace") is not None
