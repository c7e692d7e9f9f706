"""The operator end to end: kopf's engine with our handlers against the API stand-in (emulator.py)."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import kmock

from mixrl.api.models import RLRun
from mixrl.api.resolve import resolve
from mixrl.operator.builders import labels as L
from mixrl.operator.builders.objects import HASH_ANNOTATION, BuildOptions, Owner, token_hash
from mixrl.operator.builders.pools import pool_children
from mixrl.operator.builders.resources import run_objects, seed_replicas
from mixrl.operator.controller.observed_status import COMPONENT_CONDITIONS

from .emulator import ApiServer
from .support import (
    DEPLOYMENTS,
    NAMESPACE,
    RLRUNS,
    SAMPLERPOOLS,
    STATEFULSETS,
    conditions,
    create,
    delete,
    events,
    eventually,
    patch,
    play_workload_controllers,
    run_path,
    settled,
    small_run,
    writes,
)

Obj = dict[str, Any]
CHILD_RESOURCES = {
    "ConfigMap": "v1/configmaps",
    "Secret": "v1/secrets",
    "Service": "v1/services",
    "PersistentVolumeClaim": "v1/persistentvolumeclaims",
    "Deployment": DEPLOYMENTS,
    "StatefulSet": STATEFULSETS,
    "NetworkPolicy": "networking.k8s.io/v1/networkpolicies",
    "SamplerPool": SAMPLERPOOLS,
}
SP_PATH = f"/apis/mixrl.dev/v1alpha1/namespaces/{NAMESPACE}/samplerpools"
DEPLOY_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"


def existing(api: ApiServer) -> set[tuple[str, str]]:
    return {(kind, name) for kind, res in CHILD_RESOURCES.items() for name in api.names(res, NAMESPACE)}


def expected(
    manifest: Obj, run_uid: str = "uid", pool_uids: dict[str, str] | None = None, hashed: str | None = None
) -> dict[tuple[str, str], Obj]:
    """What the builders say a run becomes (both controllers' objects), for the given owner uids
    and the hash of the run's token."""
    resolved = resolve(RLRun.model_validate(manifest))
    owner = Owner("mixrl.dev/v1alpha1", "RLRun", resolved.name, run_uid)
    objects = run_objects(resolved, owner, BuildOptions(), token_hash=hashed)
    for pool in resolved.pools:
        uid = (pool_uids or {}).get(pool.object_name, "uid")
        pool_owner = Owner("mixrl.dev/v1alpha1", "SamplerPool", pool.object_name, uid)
        objects += pool_children(
            resolved, pool, seed_replicas(pool), pool_owner, BuildOptions(), token_hash=hashed
        )
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


async def converged(api: ApiServer, manifest: Obj) -> None:
    want = set(expected(manifest))
    await eventually(lambda: existing(api) == want, what=f"children {sorted(want - existing(api))}")
    await settled(api)


async def create_converged(api: ApiServer, manifest: Obj) -> Obj:
    """Create the run; return it once its children are exactly the expected ones and all is quiet."""
    run = await create(api, manifest)
    await converged(api, manifest)
    return run


def writes_to(api: ApiServer, since: int, plural: str, name: str | None = None) -> list[kmock.Request]:
    return [
        r
        for r in writes(api, since)
        if r.resource is not None and r.resource.plural == plural and (name is None or r.name == name)
    ]


def operator_writes(api: ApiServer, since: int) -> list[str]:
    """Writes after ``since``, without kopf's peering keep-alives (a heartbeat, not a reconcile)."""
    return [
        f"{r.method.value} {r.url.path}"
        for r in writes(api, since)
        if r.resource is not None and r.resource.group != "kopf.dev"
    ]


# ----------------------------------------------------------------------------- creation


async def test_applying_a_run_creates_exactly_the_expected_children(api: ApiServer, operator: Any) -> None:
    manifest = small_run()
    async with operator():
        run = await create_converged(api, manifest)
    run_uid = run["metadata"]["uid"]
    pool_uids = {
        name: api.live(SAMPLERPOOLS, NAMESPACE, name)["metadata"]["uid"]
        for name in ("demo-b200", "demo-h100")
    }
    token = api.live("v1/secrets", NAMESPACE, "demo-auth")["data"]["token"]
    assert len(base64.b64decode(token)) == 43  # secrets.token_urlsafe(32), drawn by the operator
    want = expected(manifest, run_uid, pool_uids, token_hash(token))
    assert existing(api) == set(want)
    for (kind, name), desired in want.items():
        live = api.live(CHILD_RESOURCES[kind], NAMESPACE, name)
        assert live is not None
        # Same hash: the stored object is exactly what the builders produce for these owners.
        live_hash = live["metadata"]["annotations"][HASH_ANNOTATION]
        assert live_hash == desired["metadata"]["annotations"][HASH_ANNOTATION], (kind, name)
        assert live["metadata"]["ownerReferences"] == desired["metadata"]["ownerReferences"]
        if kind not in ("SamplerPool", "Secret"):
            assert live.get("spec", live.get("data")) == desired.get("spec", desired.get("data"))
    pools = {name: api.live(SAMPLERPOOLS, NAMESPACE, name) for name in ("demo-b200", "demo-h100")}
    assert {n: p["spec"]["replicas"] for n, p in pools.items()} == {"demo-b200": 2, "demo-h100": 1}
    assert api.live(DEPLOYMENTS, NAMESPACE, "demo-b200")["spec"]["replicas"] == 2
    live_run = api.live(RLRUNS, NAMESPACE, "demo")
    assert not live_run["metadata"].get("finalizers"), "deletion needs no finalizer: owner references do it"
    reasons = [e["reason"] for e in events(api)]
    assert reasons.count("PoolAdded") == 2 and "Applied" in reasons


async def test_a_second_reconcile_without_spec_change_writes_nothing(api: ApiServer, operator: Any) -> None:
    manifest = small_run()
    async with operator() as runtime:
        await create_converged(api, manifest)
        await play_workload_controllers(api)
        await eventually(lambda: conditions(api.live(RLRUNS, NAMESPACE, "demo"))["Ready"]["status"] == "True")
        before = await settled(api)
        # A child changes in a way that is not ours to correct: both owners reconcile again (each
        # reads itself and its children as the watches showed them).
        owners = (f"RLRun/{NAMESPACE}/demo", f"SamplerPool/{NAMESPACE}/demo-b200")
        reconciled = [runtime.reconciled[key] for key in owners]
        await patch(api, f"{DEPLOY_PATH}/demo-router", {"metadata": {"annotations": {"team": "rl"}}})
        await patch(api, f"{DEPLOY_PATH}/demo-b200", {"metadata": {"annotations": {"team": "rl"}}})
        await eventually(
            lambda: all(runtime.reconciled[key] > n for key, n in zip(owners, reconciled, strict=True)),
            what="both owners' reconciles",
        )
        after_events = await settled(api)
        assert operator_writes(api, before + 2) == []
    # A restarted operator resumes every object: it reads them all and writes nothing.
    async with operator():
        await eventually(
            lambda: sum(1 for r in list(api)[after_events:] if r.url.path == f"{DEPLOY_PATH}/demo-h100") >= 1,
            what="the resumed pool reconcile",
        )
        await settled(api)
        assert operator_writes(api, after_events) == []


async def test_status_and_conditions_follow_the_children(api: ApiServer, operator: Any) -> None:
    manifest = small_run()
    async with operator():
        await create_converged(api, manifest)
        run = api.live(RLRUNS, NAMESPACE, "demo")
        c = conditions(run)
        assert run["status"]["phase"] == "Pending" and run["status"]["observedGeneration"] == 1
        assert (c["Ready"]["status"], c["Progressing"]["status"], c["InvalidSpec"]["status"]) == (
            "False",
            "True",
            "False",
        )
        assert {p["name"]: p["replicas"] for p in run["status"]["pools"]} == {"b200": 2, "h100": 1}
        pool = api.live(SAMPLERPOOLS, NAMESPACE, "demo-b200")
        selector = pool["status"]["selector"]
        assert selector == f"{L.COMPONENT}=sampler,{L.INSTANCE}=demo,{L.NAME}=mixrl,{L.POOL}=b200"

        await play_workload_controllers(api)

        def ready() -> bool:
            live = api.live(RLRUNS, NAMESPACE, "demo")
            return conditions(live)["Ready"]["status"] == "True" and live["status"]["phase"] == "Running"

        await eventually(ready, what="Ready=True")
        run = api.live(RLRUNS, NAMESPACE, "demo")
        c = conditions(run)
        assert c["Ready"]["reason"] == "AllComponentsReady"
        assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("False", "Reconciled")
        assert all(c[kind]["status"] == "True" for kind in COMPONENT_CONDITIONS)
        assert {p["name"]: p["readyReplicas"] for p in run["status"]["pools"]} == {"b200": 2, "h100": 1}
        pool = api.live(SAMPLERPOOLS, NAMESPACE, "demo-b200")
        assert (pool["status"]["replicas"], pool["status"]["readyReplicas"]) == (2, 2)
        assert conditions(pool)["Ready"]["status"] == "True"
    status_writes = [r for r in list(api) if r.subresource == "status" and r.resource.plural == "rlruns"]
    # Status goes only through the status subresource, and nothing else goes with it.
    assert status_writes and all(set(json.loads(r.text)) == {"status"} for r in status_writes)


async def test_an_invalid_run_is_marked_and_creates_nothing(api: ApiServer, operator: Any) -> None:
    manifest = small_run(pools=[{"name": "a100", "gpuType": "A100", "weightPrecision": "nvfp4"}])
    message = "spec.samplerPools[0].weightPrecision: nvfp4 needs FP4 tensor cores, which A100 lacks"
    async with operator():
        await create(api, manifest)

        def marked() -> bool:
            return (
                conditions(api.live(RLRUNS, NAMESPACE, "demo")).get("InvalidSpec", {}).get("status") == "True"
            )

        await eventually(marked, what="InvalidSpec=True")
        await settled(api, quiet=1.0)  # with a 0.05 s backoff, a requeue would show within this
        run = api.live(RLRUNS, NAMESPACE, "demo")
        c = conditions(run)
        assert c["InvalidSpec"]["message"] == message
        assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "InvalidSpec")
        assert run["status"]["phase"] == "Invalid"
        assert existing(api) == set()
        assert not [
            r
            for r in writes(api)
            if r.resource is not None and r.resource.plural in ("configmaps", "deployments")
        ]
        warnings = [e for e in events(api) if e["reason"] == "InvalidSpec"]
        assert len(warnings) == 1 and warnings[0]["type"] == "Warning" and warnings[0]["message"] == message

        # Fixing the spec is a change: the run is built.
        fixed = copy.deepcopy(manifest)
        fixed["spec"]["samplerPools"][0]["weightPrecision"] = "bf16"
        await patch(api, run_path("demo"), {"spec": {"samplerPools": fixed["spec"]["samplerPools"]}})
        await converged(api, fixed)
        c = conditions(api.live(RLRUNS, NAMESPACE, "demo"))
        assert c["InvalidSpec"]["status"] == "False" and c["InvalidSpec"]["observedGeneration"] == 2


# ----------------------------------------------------------------------------- spec changes


async def test_adding_and_removing_a_pool(api: ApiServer, operator: Any) -> None:
    manifest = small_run()
    async with operator():
        await create_converged(api, manifest)
        before = len(list(api))
        grown = copy.deepcopy(manifest)
        grown["spec"]["samplerPools"].append(
            {"name": "a100", "gpuType": "A100", "minReplicas": 0, "maxReplicas": 2}
        )
        await patch(api, run_path("demo"), {"spec": {"samplerPools": grown["spec"]["samplerPools"]}})
        await converged(api, grown)
        assert {
            ("SamplerPool", "demo-a100"),
            ("Deployment", "demo-a100"),
            ("Service", "demo-a100"),
        } <= existing(api)
        assert not writes_to(api, before, "deployments", "demo-b200"), "other pools are left alone"
        assert not writes_to(api, before, "statefulsets"), "the trainer is not restarted by a new pool"

        before = len(list(api))
        shrunk = copy.deepcopy(manifest)
        shrunk["spec"]["samplerPools"] = [grown["spec"]["samplerPools"][0], grown["spec"]["samplerPools"][2]]
        await patch(api, run_path("demo"), {"spec": {"samplerPools": shrunk["spec"]["samplerPools"]}})
        await converged(api, shrunk)
        assert not any(name == "demo-h100" for _, name in existing(api))
        deletes = [r.url.path for r in writes(api, before) if r.method.value == "DELETE"]
        assert deletes == [f"{SP_PATH}/demo-h100"], (
            "the operator deletes the pool; the GC removes its children"
        )
        assert "PoolRemoved" in [e["reason"] for e in events(api)]
        status = api.live(RLRUNS, NAMESPACE, "demo")["status"]
        assert [p["name"] for p in status["pools"]] == ["b200", "a100"] and status["poolCount"] == 2


async def test_scaling_a_pool_changes_only_its_own_deployment(api: ApiServer, operator: Any) -> None:
    manifest = small_run()
    async with operator():
        await create_converged(api, manifest)
        old = api.live(DEPLOYMENTS, NAMESPACE, "demo-b200")
        before = len(list(api))
        await patch(
            api, f"{SP_PATH}/demo-b200", {"spec": {"replicas": 5}}, subresource="scale"
        )  # kubectl scale
        await eventually(lambda: api.live(DEPLOYMENTS, NAMESPACE, "demo-b200")["spec"]["replicas"] == 5)
        await settled(api)
        touched = {
            (r.resource.plural, r.name, r.subresource)
            for r in writes(api, before)
            if r.resource is not None and r.resource.group != "kopf.dev" and r.resource.plural != "events"
        }
        assert touched <= {
            ("samplerpools", "demo-b200", "scale"),  # the scale itself
            ("deployments", "demo-b200", None),  # its Deployment
            ("samplerpools", "demo-b200", "status"),
            ("samplerpools", "demo-b200", None),  # kopf's bookkeeping annotations
            ("rlruns", "demo", "status"),  # the run's per-pool summary
        }
        assert ("deployments", "demo-b200", None) in touched
        new = api.live(DEPLOYMENTS, NAMESPACE, "demo-b200")
        assert {**new["spec"], "replicas": None} == {**old["spec"], "replicas": None}
        assert "Scaled" in [e["reason"] for e in events(api)]
        assert api.live(SAMPLERPOOLS, NAMESPACE, "demo-b200")["spec"]["replicas"] == 5


async def test_precision_change_and_tighter_bounds_roll_out(api: ApiServer, operator: Any) -> None:
    manifest = small_run()
    async with operator():
        await create_converged(api, manifest)
        changed = copy.deepcopy(manifest)
        changed["spec"]["samplerPools"][1]["weightPrecision"] = "bf16"  # h100: fp8 -> bf16
        changed["spec"]["samplerPools"][0].update(minReplicas=1, maxReplicas=1)  # b200 runs 2 replicas now
        changed["spec"]["samplerPools"][0]["engineArgs"] = ["--mem-fraction-static", "0.8"]  # not in its spec
        await patch(api, run_path("demo"), {"spec": {"samplerPools": changed["spec"]["samplerPools"]}})

        def rolled() -> bool:
            command = api.live(DEPLOYMENTS, NAMESPACE, "demo-h100")["spec"]["template"]["spec"]["containers"][
                0
            ]
            return "--quantization" not in command["command"]

        await eventually(rolled, what="the h100 Deployment without --quantization")
        await eventually(lambda: api.live(DEPLOYMENTS, NAMESPACE, "demo-b200")["spec"]["replicas"] == 1)

        def new_args() -> bool:
            engine = api.live(DEPLOYMENTS, NAMESPACE, "demo-b200")["spec"]["template"]["spec"]["containers"][
                0
            ]
            return engine["command"][-2:] == ["--mem-fraction-static", "0.8"]

        await eventually(new_args, what="the b200 Deployment with the new engine arguments")
        await settled(api)
        h100 = api.live(SAMPLERPOOLS, NAMESPACE, "demo-h100")
        assert (h100["spec"]["weightPrecision"], h100["metadata"]["labels"][L.PRECISION]) == ("bf16", "bf16")
        b200 = api.live(SAMPLERPOOLS, NAMESPACE, "demo-b200")
        assert (b200["spec"]["replicas"], b200["spec"]["maxReplicas"]) == (1, 1)
        deployment = api.live(DEPLOYMENTS, NAMESPACE, "demo-h100")
        assert deployment["spec"]["template"]["metadata"]["labels"][L.PRECISION] == "bf16"


# ----------------------------------------------------------------------------- failures and deletion


async def test_conflicts_and_server_errors_are_retried(api: ApiServer, operator: Any) -> None:
    manifest = small_run()
    failures = [
        api.fail("POST", "samplerpools", 500),
        api.fail("PATCH", "statefulsets", 409),
        api.fail("PATCH", "deployments", 409),  # the pool controller's first write
        api.fail("PATCH", "rlruns", 500, subresource="status"),
    ]
    async with operator():
        await create_converged(api, manifest)
    assert all(f.times == 0 for f in failures), "every injected failure was hit"
    posts = [
        r
        for r in list(api)
        if r.method.value == "POST" and r.resource and r.resource.plural == "samplerpools"
    ]
    assert len(posts) == 3, "the failed POST was sent again (two pools, one retry)"
    run = api.live(RLRUNS, NAMESPACE, "demo")
    assert run["status"]["observedGeneration"] == 1 and conditions(run)["InvalidSpec"]["status"] == "False"
    assert conditions(run)["Progressing"]["reason"] != "ApplyFailed", "a later success replaced the failure"


async def test_deleting_the_run_cleans_up_through_owner_references(api: ApiServer, operator: Any) -> None:
    manifest = small_run()
    async with operator():
        await create_converged(api, manifest)
        before = len(list(api))
        await delete(api, run_path("demo"))
        await eventually(lambda: not existing(api), what="the garbage collector")
        await settled(api)
        assert api.live(RLRUNS, NAMESPACE, "demo") is None
        after = [w for w in operator_writes(api, before) if w != f"DELETE {run_path('demo')}"]
        assert after == [], "nothing is recreated after the run is gone"
