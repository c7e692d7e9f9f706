"""A real control plane's behaviour against the running operator (kopf's engine, the API stand-in):
failures of one child, immutable fields, drift, deleted children, the periodic resync, restarts."""

from __future__ import annotations

import asyncio
import copy
import json
from collections import Counter
from typing import Any

import kmock
import pytest

from mixrl.operator.builders.objects import AUTH_TOKEN_HASH, token_hash
from mixrl.operator.controller.runtime import OperatorConfig, Runtime
from mixrl.operator.kube.client import ApiError

from .emulator import ApiServer
from .support import (
    DEPLOYMENTS,
    NAMESPACE,
    RLRUNS,
    SAMPLERPOOLS,
    STATEFULSETS,
    assert_covered,
    conditions,
    create,
    delete,
    events,
    eventually,
    operator_calls,
    patch,
    play_workload_controllers,
    run_path,
    settled,
    small_run,
    writes,
    writes_settled,
)
from .test_operator import existing, expected, operator_writes

Obj = dict[str, Any]
CORE = f"/api/v1/namespaces/{NAMESPACE}"
APPS = f"/apis/apps/v1/namespaces/{NAMESPACE}"
SP_PATH = f"/apis/mixrl.dev/v1alpha1/namespaces/{NAMESPACE}/samplerpools"
STS_FORBIDDEN = (
    'StatefulSet.apps "demo-trainer" is invalid: spec: Forbidden: updates to statefulset spec for fields '
    "other than 'replicas', 'ordinals', 'template', 'updateStrategy', 'persistentVolumeClaimRetentionPolicy' "
    "and 'minReadySeconds' are forbidden"
)


def progressing(api: ApiServer) -> Obj:
    return conditions(api.live(RLRUNS, NAMESPACE, "demo")).get("Progressing", {})


def requests_to(api: ApiServer, method: str, path: str, since: int = 0) -> list[kmock.Request]:
    return [r for r in list(api)[since:] if r.method.value == method and r.url.path == path]


def uid(api: ApiServer, resource: str, name: str) -> str | None:
    live = api.live(resource, NAMESPACE, name)
    return live["metadata"]["uid"] if live else None


async def ready_run(api: ApiServer, resyncing: bool = False) -> Obj:
    """A run whose children all exist and are ready; then no more writes are under way."""
    manifest = small_run()
    await create(api, manifest)
    want = set(expected(manifest))
    await eventually(lambda: existing(api) == want, what="the children")
    await (writes_settled(api) if resyncing else settled(api))
    await play_workload_controllers(api)
    await eventually(lambda: conditions(api.live(RLRUNS, NAMESPACE, "demo"))["Ready"]["status"] == "True")
    await (writes_settled(api) if resyncing else settled(api))
    return manifest


# ----------------------------------------------------------------------------- failures of one child


async def test_a_failing_child_does_not_stop_the_others(api: ApiServer, operator: Any) -> None:
    async with operator():
        manifest = await ready_run(api)
        # The API server rejects the trainer's new spec (not an immutable field: nothing to recreate).
        fault = api.fail(
            "PATCH",
            "statefulsets",
            422,
            times=10_000,
            name="demo-trainer",
            reason="Invalid",
            message='StatefulSet.apps "demo-trainer" is invalid: spec.template: Invalid value: "…"',
        )
        changed = copy.deepcopy(manifest)
        changed["spec"]["trainer"]["nodes"] = 3  # the trainer (still several nodes: no claim template)
        changed["spec"]["rollout"] = {"workers": 3}  # the rollout workers, after it in apply order
        await patch(
            api,
            run_path("demo"),
            {"spec": {"trainer": changed["spec"]["trainer"], "rollout": {"workers": 3}}},
        )
        await eventually(
            lambda: api.live(STATEFULSETS, NAMESPACE, "demo-rollout")["spec"]["replicas"] == 3,
            what="the rollout workers applied although the trainer failed",
        )
        await eventually(
            lambda: progressing(api).get("reason") == "ApplyFailed", what="Progressing=ApplyFailed"
        )
        assert progressing(api)["status"] == "True"
        assert "StatefulSet/demo-trainer" in progressing(api)["message"]
        assert api.live(STATEFULSETS, NAMESPACE, "demo-trainer")["spec"]["replicas"] == 2
        tries = len(requests_to(api, "PATCH", f"{APPS}/statefulsets/demo-trainer"))
        await eventually(
            lambda: len(requests_to(api, "PATCH", f"{APPS}/statefulsets/demo-trainer")) > tries + 1,
            what="the failed child retried",
        )
        # Once the server accepts it, the retry applies it and the condition clears.
        fault.times = 0
        await eventually(lambda: api.live(STATEFULSETS, NAMESPACE, "demo-trainer")["spec"]["replicas"] == 3)
        await play_workload_controllers(api)
        await eventually(
            lambda: progressing(api).get("reason") == "Reconciled", what="Progressing=Reconciled"
        )
        await settled(api)


# ----------------------------------------------------------------------------- immutable fields


async def test_an_immutable_statefulset_change_recreates_it(api: ApiServer, operator: Any) -> None:
    async with operator():
        manifest = await ready_run(api)
        old_uid = uid(api, STATEFULSETS, "demo-trainer")
        before = len(list(api))
        fault = api.fail(
            "PATCH",
            "statefulsets",
            422,
            times=1,
            name="demo-trainer",
            reason="Invalid",
            message=STS_FORBIDDEN,
        )
        changed = copy.deepcopy(manifest)
        # One node instead of two: the run directory becomes a claim of its own (a claim template
        # appears: immutable), relabelled for the new GPU type.
        changed["spec"]["trainer"].update(gpuType="B200", nodes=1)
        await patch(api, run_path("demo"), {"spec": {"trainer": changed["spec"]["trainer"]}})

        await eventually(
            lambda: progressing(api).get("reason") == "Recreating", what="Progressing=Recreating"
        )
        deletions = requests_to(api, "DELETE", f"{APPS}/statefulsets/demo-trainer", before)
        assert len(deletions) == 1 and fault.times == 0
        options = json.loads(deletions[0].text)
        # The pods change too (GPU labels, node affinity): they go first, then the StatefulSet.
        assert options["propagationPolicy"] == "Foreground"
        assert options["preconditions"] == {"uid": old_uid}, "only the object we compared"

        def recreated() -> bool:
            live = api.live(STATEFULSETS, NAMESPACE, "demo-trainer")
            return (
                live is not None
                and live["metadata"]["uid"] != old_uid
                and not live["metadata"].get("deletionTimestamp")
            )

        await eventually(recreated, what="a new trainer StatefulSet")
        live = api.live(STATEFULSETS, NAMESPACE, "demo-trainer")
        assert live["spec"]["volumeClaimTemplates"][0]["metadata"]["labels"]["mixrl.dev/gpu-type"] == "B200"
        # The rest of the change went on meanwhile.
        service = api.live("v1/services", NAMESPACE, "demo-trainer")
        assert service["metadata"]["labels"]["mixrl.dev/gpu-type"] == "B200"
        await play_workload_controllers(api)
        await eventually(
            lambda: progressing(api).get("reason") == "Reconciled", what="Progressing=Reconciled"
        )
        await settled(api)
        recreated_events = [e for e in events(api) if e["reason"] == "Recreated"]
        assert len(recreated_events) == 1 and "spec.volumeClaimTemplates" in recreated_events[0]["message"]
        assert "Foreground" in recreated_events[0]["message"]
    assert_covered(operator_calls(api), clusterwide=True)


async def test_a_weights_volume_grows_but_never_shrinks(api: ApiServer, operator: Any) -> None:
    claim = f"{CORE}/persistentvolumeclaims/demo-weights"
    async with operator():
        manifest = await ready_run(api)
        before = len(list(api))
        smaller = copy.deepcopy(manifest)
        smaller["spec"]["weights"]["volumeSize"] = "50Gi"
        smaller["spec"]["rollout"] = {"workers": 2}
        await patch(
            api,
            run_path("demo"),
            {"spec": {"weights": smaller["spec"]["weights"], "rollout": {"workers": 2}}},
        )
        await eventually(
            lambda: progressing(api).get("reason") == "ImmutableFieldChanged", what="the refusal"
        )
        condition = progressing(api)
        assert condition["status"] == "False", "the run cannot get there by itself"
        message = condition["message"]
        assert "weights.volumeSize 50Gi" in message and "at least 100Gi" in message, message
        assert "delete the claim" in message
        await settled(api)
        assert not [r for r in writes(api, before) if r.url.path == claim], "the claim is left alone"
        assert api.live("v1/persistentvolumeclaims", NAMESPACE, "demo-weights")["spec"]["resources"] == {
            "requests": {"storage": "100Gi"}
        }
        assert api.live(STATEFULSETS, NAMESPACE, "demo-rollout")["spec"]["replicas"] == 2, "the rest applied"
        warnings = [e for e in events(api) if e["reason"] == "ImmutableFieldChanged"]
        assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
        assert not requests_to(api, "PATCH", claim, before), "no retry loop: the spec has to change"

        bigger = copy.deepcopy(manifest)
        bigger["spec"]["weights"]["volumeSize"] = "300Gi"
        await patch(api, run_path("demo"), {"spec": {"weights": bigger["spec"]["weights"]}})
        await eventually(
            lambda: (
                api.live("v1/persistentvolumeclaims", NAMESPACE, "demo-weights")["spec"]["resources"]
                == {"requests": {"storage": "300Gi"}}
            ),
            what="the claim expanded",
        )
        (expansion,) = requests_to(api, "PATCH", claim, before)
        assert expansion.headers["Content-Type"] == "application/merge-patch+json"
        await eventually(lambda: progressing(api).get("reason") != "ImmutableFieldChanged")
        await settled(api)
    assert_covered(operator_calls(api), clusterwide=True)


async def test_a_name_another_run_holds_is_left_alone(api: ApiServer, operator: Any) -> None:
    """Run ``demo``'s pool ``x-router`` and run ``demo-x``'s router are both named ``demo-x-router``:
    the later run is told so and changes nothing of the earlier one's."""
    first = small_run("demo", [{"name": "x-router", "gpuType": "H100", "weightPrecision": "fp8"}])
    services = "v1/services"
    async with operator():
        await create(api, first)
        await eventually(lambda: api.live(DEPLOYMENTS, NAMESPACE, "demo-x-router"), what="the pool")
        await eventually(lambda: api.live(services, NAMESPACE, "demo-x-router"), what="its Service")
        await settled(api)
        before = {r: copy.deepcopy(api.live(r, NAMESPACE, "demo-x-router")) for r in (DEPLOYMENTS, services)}
        await create(api, small_run("demo-x"))
        run = lambda: conditions(api.live(RLRUNS, NAMESPACE, "demo-x")).get("Progressing", {})  # noqa: E731
        await eventually(lambda: run().get("reason") == "NameTaken", what="the refusal")
        await settled(api)
        assert run()["status"] == "False"
        assert "SamplerPool demo-x-router controls it" in run()["message"], run()["message"]
        assert "rename this run or pool" in run()["message"]
        for resource, was in before.items():
            now = api.live(resource, NAMESPACE, "demo-x-router")
            assert now["metadata"]["uid"] == was["metadata"]["uid"], f"{resource}: not recreated"
            assert now["metadata"]["ownerReferences"] == was["metadata"]["ownerReferences"], resource
            assert now["spec"] == was["spec"], f"{resource}: not rewritten"
        assert api.live(STATEFULSETS, NAMESPACE, "demo-x-trainer"), "the rest of demo-x is applied"
        warnings = [e for e in events(api) if e["reason"] == "NameTaken"]
        assert warnings and warnings[0]["involvedObject"]["name"] == "demo-x"


async def test_a_run_that_drops_its_sandbox_pods_drops_what_they_needed(
    api: ApiServer, operator: Any
) -> None:
    manifest = small_run("demo")
    manifest["spec"]["rollout"] = {"environment": "coding", "sandbox": {}}
    made = [
        ("v1/serviceaccounts", "demo-rollout"),
        ("rbac.authorization.k8s.io/v1/roles", "demo-rollout"),
        ("rbac.authorization.k8s.io/v1/rolebindings", "demo-rollout"),
        ("networking.k8s.io/v1/networkpolicies", "demo-sandbox"),
    ]
    async with operator():
        run = await create(api, manifest)
        await eventually(lambda: all(api.live(r, NAMESPACE, n) for r, n in made), what="the sandbox objects")
        owner = {
            "apiVersion": "mixrl.dev/v1alpha1",
            "kind": "RLRun",
            "name": "demo",
            "uid": run["metadata"]["uid"],
        }
        labels = {"app.kubernetes.io/name": "mixrl", "app.kubernetes.io/instance": "demo"}
        for name, component, owners in (
            ("left", "sandbox", [owner]),
            ("other", "sandbox", []),
            ("mine", "x", [owner]),
        ):
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": NAMESPACE,
                    "labels": {**labels, "app.kubernetes.io/component": component},
                    "ownerReferences": owners,
                },
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            }
            async with api.post(f"{CORE}/pods", json=pod) as response:
                assert response.status in (200, 201), await response.text()
        await settled(api)
        await patch(api, run_path("demo"), {"spec": {"rollout": {"sandbox": None}}})
        await eventually(lambda: not any(api.live(r, NAMESPACE, n) for r, n in made), what="their removal")
        await settled(api)
        assert not api.live("v1/pods", NAMESPACE, "left"), "a killed worker's sandbox pod"
        assert api.live("v1/pods", NAMESPACE, "other") and api.live("v1/pods", NAMESPACE, "mine"), (
            "not the run's sandboxes"
        )
        deleted = [e for e in events(api) if e["reason"] == "Applied" and "deleted" in e["message"]]
        assert deleted and "Pod/left" in deleted[-1]["message"], deleted
        before = len(list(api))
        await patch(api, run_path("demo"), {"spec": {"rollout": {"workers": 2}}})
        await settled(api)
        later = list(api)[before:]
        assert [r for r in later if r.method.value == "PATCH" and r.url.path.endswith("/demo-rollout")]
        sandbox_calls = [r for r in later if r.url.path.rsplit("/", 2)[-2] in ("serviceaccounts", "roles")]
        assert not sandbox_calls, "once they are gone, the marker policy's absence costs no call"
    assert_covered(operator_calls(api), clusterwide=True)


# ----------------------------------------------------------------------------- drift


async def test_deleted_children_come_back(api: ApiServer, operator: Any) -> None:
    async with operator():
        await ready_run(api)
        pool_uid = uid(api, SAMPLERPOOLS, "demo-b200")
        for path in (
            f"{CORE}/services/demo-router",
            f"{CORE}/configmaps/demo-config",
            f"{SP_PATH}/demo-b200",  # the pool's Deployment and Service follow it (garbage collector)
        ):
            await delete(api, path)
        await eventually(lambda: api.live("v1/services", NAMESPACE, "demo-router"), what="the router Service")
        await eventually(lambda: api.live("v1/configmaps", NAMESPACE, "demo-config"), what="the ConfigMap")

        def pool_back() -> bool:
            new_uid = uid(api, SAMPLERPOOLS, "demo-b200")
            deployment = api.live(DEPLOYMENTS, NAMESPACE, "demo-b200")
            return (
                new_uid not in (None, pool_uid)
                and deployment is not None
                and deployment["metadata"]["ownerReferences"][0]["uid"] == new_uid
            )

        await eventually(pool_back, what="the SamplerPool and, through its controller, its Deployment")
        assert api.live(SAMPLERPOOLS, NAMESPACE, "demo-b200")["spec"]["replicas"] == 2, "seeded again"
        assert api.live("v1/services", NAMESPACE, "demo-b200") is not None
        await settled(api)


def token_hashes(api: ApiServer) -> dict[str, str | None]:
    """Each workload's (and SamplerPool's) token hash: the pod templates' annotation, the pool's label."""
    found: dict[str, str | None] = {}
    for resource in (STATEFULSETS, DEPLOYMENTS):
        for name in api.names(resource, NAMESPACE):
            template = api.live(resource, NAMESPACE, name)["spec"]["template"]
            found[name] = (template["metadata"].get("annotations") or {}).get(AUTH_TOKEN_HASH)
    for name in api.names(SAMPLERPOOLS, NAMESPACE):
        found[f"pool {name}"] = api.live(SAMPLERPOOLS, NAMESPACE, name)["metadata"]["labels"].get(
            AUTH_TOKEN_HASH
        )
    return found


async def test_a_token_drawn_anew_restarts_every_pod_of_the_run(api: ApiServer, operator: Any) -> None:
    """Before: a deleted ``<run>-auth`` Secret came back with a new token that only the pods which
    happened to restart took; the others refused them (every process reads the token once, SGLang
    from its environment).  Now every pod template carries the token's hash, so all of them roll."""
    async with operator(resync_interval_s=0.3):
        await ready_run(api, resyncing=True)
        first = api.live("v1/secrets", NAMESPACE, "demo-auth")["data"]["token"]
        before = token_hashes(api)
        assert set(before) == {
            "demo-trainer", "demo-buffer", "demo-rollout", "demo-router", "demo-b200", "demo-h100",
            "pool demo-b200", "pool demo-h100",
        }  # fmt: skip
        assert set(before.values()) == {token_hash(first)}
        api.vanish("v1/secrets", NAMESPACE, "demo-auth")  # the operator does not watch Secrets
        await eventually(lambda: api.live("v1/secrets", NAMESPACE, "demo-auth"), what="the Secret")
        second = api.live("v1/secrets", NAMESPACE, "demo-auth")["data"]["token"]
        assert second != first
        await eventually(
            lambda: set(token_hashes(api).values()) == {token_hash(second)},
            what="every workload's pods and every pool's engines rolled to the new token",
        )
        await writes_settled(api)
        assert api.live("v1/secrets", NAMESPACE, "demo-auth")["data"]["token"] == second, "drawn once"


async def test_a_hand_edit_of_a_pool_deployment_is_undone(api: ApiServer, operator: Any) -> None:
    async with operator():
        await ready_run(api)
        want = api.live(DEPLOYMENTS, NAMESPACE, "demo-b200")
        engine = want["spec"]["template"]["spec"]["containers"][0]
        edited = {**engine, "image": "someone/else:latest"}
        containers = [edited, *want["spec"]["template"]["spec"]["containers"][1:]]
        await patch(
            api,
            f"{APPS}/deployments/demo-b200",
            {"spec": {"replicas": 7, "template": {"spec": {"containers": containers}}}},
        )

        def restored() -> bool:
            live = api.live(DEPLOYMENTS, NAMESPACE, "demo-b200")
            return (
                live["spec"]["replicas"] == 2
                and live["spec"]["template"]["spec"]["containers"][0]["image"] == engine["image"]
            )

        await eventually(restored, what="the pool's Deployment as its SamplerPool says")
        await settled(api)
        assert "repaired Deployment/demo-b200" in " ".join(e["message"] for e in events(api))


# ----------------------------------------------------------------------------- resync and restarts


def write_calls(runtime: Runtime) -> Counter[tuple[str, str]]:
    return runtime.client.writes()


async def test_the_resync_repairs_what_no_event_announced(api: ApiServer, operator: Any) -> None:
    async with operator(resync_interval_s=0.3):
        await ready_run(api, resyncing=True)
        router = api.live(DEPLOYMENTS, NAMESPACE, "demo-router")
        image = router["spec"]["template"]["spec"]["containers"][0]["image"]
        tampered = copy.deepcopy(router["spec"]["template"]["spec"]["containers"])
        tampered[0]["image"] = "someone/else:latest"
        # As if the watch had missed these: no event reaches the operator.
        api.tamper(
            DEPLOYMENTS, NAMESPACE, "demo-router", {"spec": {"template": {"spec": {"containers": tampered}}}}
        )
        api.vanish("v1/configmaps", NAMESPACE, "demo-config")
        await eventually(
            lambda: (
                api.live(DEPLOYMENTS, NAMESPACE, "demo-router")["spec"]["template"]["spec"]["containers"][0][
                    "image"
                ]
                == image
            ),
            what="the router's image put back by the resync",
        )
        await eventually(lambda: api.live("v1/configmaps", NAMESPACE, "demo-config"), what="the ConfigMap")


async def test_a_reconcile_an_event_asks_for_reads_the_children_the_watches_showed(
    api: ApiServer, operator: Any
) -> None:
    async with operator() as runtime:
        await ready_run(api)
        await settled(api)
        hits, reads = runtime.client.cache.hits, runtime.client.calls[("get", "configmaps")]
        # Not ours to correct: the run's reconcile runs again and finds nothing to do.
        await patch(
            api, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/demo-router",
            {"metadata": {"annotations": {"team": "rl"}}},
        )  # fmt: skip
        await eventually(lambda: runtime.client.cache.hits >= hits + 5, what="the run's reconcile")
        await settled(api)
        assert runtime.client.calls[("get", "configmaps")] == reads, "the ConfigMap was not read again"


async def test_a_new_runs_children_are_created_without_reading_them_first(
    api: ApiServer, operator: Any
) -> None:
    # Created while the watches ran: a child they never showed does not exist, so the run's and
    # its pools' first reconciles create it straight away (a POST is refused if it exists after
    # all); only kinds no watch shows are read first (the run's token Secret and its claims).
    # No live status loop: it reads the run on its own clock, which is not what is counted here.
    async with operator(live_status=None) as runtime:
        # After kopf listed the runs (those of its first listing may predate it) and watches them.
        await eventually(
            lambda: any(r.url.path.endswith("/rlruns") and "watch" in r.params for r in list(api)),
            what="the operator's watch of runs",
        )
        await ready_run(api)
        reads = {plural: runtime.client.calls[("get", plural)] for plural in ("deployments", "services")}
        assert reads == {"deployments": 0, "services": 0}, reads
        # The run itself is read from the API server once, to make sure it still exists before
        # its children are created (a reconcile's owner check), not by every reconcile; so is each
        # pool, by its own reconcile, and by nothing else.
        assert runtime.client.calls[("get", "rlruns")] == 1
        pools = [name for kind, _, name in runtime.known.values() if kind == "SamplerPool"]
        assert pools and runtime.client.calls[("get", "samplerpools")] == len(pools)
    # A restarted operator did not see them created: it reads each before comparing.
    async with operator() as runtime:
        await eventually(lambda: runtime.client.calls[("get", "deployments")] >= 1, what="the resumed reads")
        await settled(api)
        assert runtime.client.writes() == Counter(), runtime.client.writes()


async def test_a_resyncs_reconciles_do_not_hold_back_the_ones_events_ask_for(
    api: ApiServer, operator: Any
) -> None:
    async with operator(reconcile_concurrency=1) as runtime:
        await ready_run(api)
        await settled(api)
        pools = [name for kind, _, name in runtime.known.values() if kind == "SamplerPool"]
        key = f"SamplerPool/{NAMESPACE}/{pools[0]}"
        async with runtime.slots(background=True):  # a resync's reconcile holds its only slot
            reconciled = runtime.reconciled[key]
            runtime.request("SamplerPool", NAMESPACE, pools[0])  # as a child's event does
            await eventually(lambda: runtime.reconciled[key] > reconciled, what="the event's reconcile")
            runtime.request("SamplerPool", NAMESPACE, pools[0], background=True)  # as the resync does
            await settled(api, quiet=0.5)
            assert runtime.reconciled[key] == reconciled + 1, "the resync's waits for its slot"
        await eventually(lambda: runtime.reconciled[key] == reconciled + 2, what="the resync's reconcile")


async def test_a_run_is_reconciled_for_a_change_of_itself_not_for_a_write_of_its_status(
    api: ApiServer, operator: Any
) -> None:
    async with operator() as runtime:
        await ready_run(api)
        await settled(api)
        key = f"RLRun/{NAMESPACE}/demo"
        reconciled = runtime.reconciled[key]
        # A status write (as the live status loop's figures): no reconcile of the run.
        await patch(api, run_path("demo"), {"status": {"step": 7}}, subresource="status")
        await settled(api, quiet=1.0)  # with a 0.1 s debounce, a reconcile would show within this
        assert runtime.reconciled[key] == reconciled, "the run was not reconciled again"
        # A change of its labels (or spec, or annotations) is reconciled at once.
        await patch(api, run_path("demo"), {"metadata": {"labels": {"team": "rl"}}})
        await eventually(lambda: runtime.reconciled[key] > reconciled, what="the run's reconcile")
        await settled(api)
    # Nothing but status is written on the run or its pools by the operator or kopf (no create or
    # update handlers: no bookkeeping annotations; the pools were created with their specs).
    patched = {r for _, r, verb in operator_calls(api) if verb == "patch"}
    assert not patched & {"rlruns", "samplerpools"}, patched


async def test_a_resync_of_an_unchanged_cluster_writes_nothing(api: ApiServer, operator: Any) -> None:
    async with operator(resync_interval_s=0.25) as runtime:
        await ready_run(api, resyncing=True)
        start = len(list(api))
        before = write_calls(runtime)
        lists = runtime.client.calls[("list", "configmaps")]
        reconciled = dict(runtime.reconciled)
        # Several resyncs: each lists every watched kind, then reconciles the run and both pools
        # (reads only). 30 s: a resync is seconds of kopf's work on a loaded 2-core machine (make
        # test runs another test beside it).
        await eventually(
            lambda: runtime.client.calls[("list", "configmaps")] >= lists + 3, 30, "three resyncs"
        )
        await eventually(
            lambda: all(runtime.reconciled[key] >= n + 3 for key, n in reconciled.items()),
            30,
            "the run and both pools reconciled by them",
        )
        assert len(reconciled) == 3, reconciled
        assert write_calls(runtime) == before, "a resync of an unchanged cluster sends no write"
        assert operator_writes(api, start) == []


async def test_a_restarted_operator_writes_nothing_on_an_unchanged_cluster(
    api: ApiServer, operator: Any
) -> None:
    async with operator():
        await ready_run(api)
    start = len(list(api))
    async with operator(resync_interval_s=0.25) as runtime:
        # kopf resumes every RLRun and SamplerPool (each reconciled from the API server's reads),
        # and the resync follows (lists, then reconciles from them).
        await eventually(lambda: runtime.client.calls[("get", "configmaps")] >= 1, what="the resume")
        await eventually(lambda: runtime.client.calls[("get", "services")] >= 5, what="the pools' resume")
        await eventually(
            lambda: runtime.client.calls[("list", "services")] >= 1 and min(runtime.reconciled.values()) >= 2,
            what="a resync",
        )
        assert runtime.client.writes() == Counter(), runtime.client.writes()
        assert runtime.client.calls[("get", "statefulsets")] >= 3, "it did compare the children"
        assert operator_writes(api, start) == []


async def test_a_failed_child_triggered_reconcile_is_retried(api: ApiServer, operator: Any) -> None:
    async with operator() as runtime:
        await ready_run(api)
        before = len(list(api))
        api.fail("PATCH", "services", 500, times=3, name="demo-router")
        await delete(api, f"{CORE}/services/demo-router")
        # No RLRun change: only the child event's reconcile, retried with backoff, can bring it back.
        await eventually(lambda: api.live("v1/services", NAMESPACE, "demo-router"), what="the router Service")
        applies = requests_to(api, "PATCH", f"{CORE}/services/demo-router", before)
        assert len(applies) == 4, "three failures, then the retry that worked"
        await settled(api)
        assert not runtime._queued, "nothing left queued"


async def test_a_new_event_cuts_a_retrys_backoff_short(api: ApiServer, operator: Any) -> None:
    # A long backoff: without the wake-up the retry would come only after 15-30 s.
    async with operator(backoff_base_s=30.0, backoff_cap_s=30.0) as runtime:
        await ready_run(api)
        api.fail("PATCH", "services", 500, times=1, name="demo-router")
        await delete(api, f"{CORE}/services/demo-router")
        await eventually(lambda: "RLRun/rl/demo" in runtime._wake, what="the retry waiting out its backoff")
        # Something else of the run changes (here: someone annotates the router Deployment).
        await patch(api, f"{APPS}/deployments/demo-router", {"metadata": {"annotations": {"team": "rl"}}})
        await eventually(
            lambda: api.live("v1/services", NAMESPACE, "demo-router"),
            timeout=3.0,
            what="the Service, at once",
        )
        await settled(api)


async def test_a_statefulset_whose_pods_stay_the_same_is_recreated_orphaning_them(
    api: ApiServer, operator: Any
) -> None:
    async with operator():
        await ready_run(api)
        old_uid = uid(api, STATEFULSETS, "demo-buffer")
        before = len(list(api))
        # Someone recreated the buffer with another service name (no event reached the operator);
        # the pod template is the operator's, so the pods need not restart.
        api.tamper(STATEFULSETS, NAMESPACE, "demo-buffer", {"spec": {"serviceName": "elsewhere"}})
        await patch(api, f"{APPS}/statefulsets/demo-buffer", {"metadata": {"annotations": {"team": "rl"}}})
        # The operator's reconcile follows after the debounce; its apply meets the API server's 422.
        message = STS_FORBIDDEN.replace("demo-trainer", "demo-buffer")
        api.fail("PATCH", "statefulsets", 422, times=1, name="demo-buffer", reason="Invalid", message=message)

        def recreated() -> bool:
            live = api.live(STATEFULSETS, NAMESPACE, "demo-buffer")
            return live is not None and live["metadata"]["uid"] != old_uid

        await eventually(recreated, what="a new buffer StatefulSet")
        assert api.live(STATEFULSETS, NAMESPACE, "demo-buffer")["spec"]["serviceName"] == "demo-buffer"
        (deletion,) = requests_to(api, "DELETE", f"{APPS}/statefulsets/demo-buffer", before)
        assert json.loads(deletion.text)["propagationPolicy"] == "Orphan", "its pods keep running"
        await settled(api)


async def test_a_resync_walks_the_runs_it_knew_while_kopf_adds_more() -> None:
    """kopf's handlers add runs and pools to the resync's index while it awaits each namespace's
    peering; it walked the live index once, and the first addition ended the resync for good."""
    runtime = Runtime(OperatorConfig(), post_event=lambda *_: None)
    runtime.known = {f"rl/run-{i}": ("RLRun", f"ns-{i}", f"run-{i}") for i in range(3)}
    asked: list[tuple[str, str]] = []

    async def active_in(namespace: str) -> bool:
        await asyncio.sleep(0)
        runtime.known[f"late/{namespace}"] = ("SamplerPool", "late", namespace)  # a handler's addition
        return True

    async def refresh(namespace: str) -> None:
        pass

    runtime.active_in = active_in  # type: ignore[method-assign]
    runtime.refresh = refresh  # type: ignore[method-assign]
    runtime.request = lambda kind, namespace, name, background=False: asked.append((namespace, name))  # type: ignore[method-assign]
    # Every run it knew, and of the later ones those in a namespace it found active.
    assert await runtime.resync_once() == len(asked) >= 3
    assert {("ns-0", "run-0"), ("ns-1", "run-1"), ("ns-2", "run-2")} <= set(asked)


async def test_one_namespaces_failed_read_skips_that_namespace_only(caplog: pytest.LogCaptureFixture) -> None:
    runtime = Runtime(OperatorConfig(), post_event=lambda *_: None)
    runtime.known = {f"rl/run-{i}": ("RLRun", f"ns-{i}", f"run-{i}") for i in range(3)}
    asked: list[str] = []

    async def active_in(namespace: str) -> bool:
        if namespace == "ns-0":
            raise ApiError(429, "TooManyRequests", "slow down")
        return True

    async def refresh(namespace: str) -> None:
        if namespace == "ns-1":
            raise ApiError(500, "InternalError", "etcd timeout")

    runtime.active_in = active_in  # type: ignore[method-assign]
    runtime.refresh = refresh  # type: ignore[method-assign]
    runtime.request = lambda kind, namespace, name, background=False: asked.append(namespace)  # type: ignore[method-assign]
    assert await runtime.resync_once() == 1
    assert asked == ["ns-2"], "the namespaces that could be read are resynced"
    assert (
        "resync of namespace ns-0 failed" in caplog.text and "resync of namespace ns-1 failed" in caplog.text
    )


async def test_a_failed_resync_is_logged_and_the_next_one_comes(caplog: pytest.LogCaptureFixture) -> None:
    runtime = Runtime(OperatorConfig(), post_event=lambda *_: None)
    calls = 0

    async def resync_once() -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in one resync")
        return 0

    runtime.resync_once = resync_once  # type: ignore[method-assign]
    loop = asyncio.create_task(runtime.resync_forever(0.01))
    await eventually(lambda: calls >= 3, what="resyncs after the failed one")
    loop.cancel()
    assert "resync failed" in caplog.text and "a bug in one resync" in caplog.text
