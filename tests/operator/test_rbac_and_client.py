"""Least privilege from the code: every request the running operator sends is a declared permission;
the API client refuses undeclared calls; errors map to retry decisions; discovery picks monitoring."""

from __future__ import annotations

import copy
import random
from typing import Any

import kmock
import kopf
import pytest
from pydantic import ValidationError

from mixrl.operator.controller.runtime import OperatorConfig, backoff
from mixrl.operator.kube import rbac
from mixrl.operator.kube.client import ApiError, Connection, KubeClient, UndeclaredApiCall
from mixrl.operator.main import parse_args

from .emulator import ApiServer
from .support import (
    DEPLOYMENTS,
    NAMESPACE,
    PEERING,
    SAMPLERPOOLS,
    assert_covered,
    create,
    delete,
    eventually,
    operator_calls,
    patch,
    play_workload_controllers,
    run_path,
    settled,
    small_run,
)

Obj = dict[str, Any]


async def lifecycle(api: ApiServer) -> None:
    """Create, scale, change, shrink and delete a run, as a user would."""
    manifest = small_run()
    await create(api, manifest)
    await eventually(lambda: len(api.names(DEPLOYMENTS, NAMESPACE)) == 3, what="children")
    await play_workload_controllers(api)
    pool = f"/apis/mixrl.dev/v1alpha1/namespaces/{NAMESPACE}/samplerpools/demo-b200"
    await patch(api, pool, {"spec": {"replicas": 3}}, "scale")
    changed = copy.deepcopy(manifest)
    changed["spec"]["samplerPools"] = [changed["spec"]["samplerPools"][0] | {"maxReplicas": 2}]
    await patch(api, run_path("demo"), {"spec": {"samplerPools": changed["spec"]["samplerPools"]}})
    await eventually(lambda: "demo-h100" not in api.names(SAMPLERPOOLS, NAMESPACE), what="pool removal")
    await settled(api)
    await delete(api, run_path("demo"))
    await eventually(lambda: not api.names(DEPLOYMENTS, NAMESPACE), what="garbage collection")
    await settled(api)


async def test_every_request_of_a_cluster_wide_lifecycle_is_declared(api: ApiServer, operator: Any) -> None:
    async with operator():
        await lifecycle(api)
    calls = operator_calls(api)
    assert_covered(calls, clusterwide=True)
    # The run really exercised the interesting verbs, so this is not vacuous.
    assert {
        ("mixrl.dev", "samplerpools", "delete"),
        ("apps", "deployments", "watch"),
        ("", "events", "create"),
    } <= calls
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in calls, (
        "peering is on: the operator announced itself"
    )
    # Least privilege in the other direction: nothing declared that the operator never needs.
    declared = {(g, r, v) for (g, r), verbs in rbac.permissions(True).items() for v in verbs}
    unused = declared - calls
    # Not exercised by this lifecycle: creating, watching or deleting a PodMonitor (monitoring off
    # here; test_monitoring_switch.py exercises the deletion and checks it with assert_covered), update
    # of finalizers (admission plugin check, no request), peering get (only on conflicts), the
    # built-in autoscaler's scale writes and KEDA's ScaledObjects (the autoscaler is off here; the
    # wiring and KEDA-mode tests exercise those calls and check them with assert_covered), and the
    # recreation of objects with changed immutable fields and volume expansion (test_drift.py
    # exercises those and checks them with assert_covered).
    assert unused <= {
        ("apps", "statefulsets", "delete"),
        ("apps", "deployments", "delete"),
        ("", "services", "delete"),
        ("", "persistentvolumeclaims", "patch"),
        ("keda.sh", "scaledobjects", "list"),
        ("keda.sh", "scaledobjects", "watch"),
        ("monitoring.coreos.com", "podmonitors", "list"),
        ("monitoring.coreos.com", "podmonitors", "watch"),
        ("mixrl.dev", "samplerpools/scale", "patch"),
        ("keda.sh", "scaledobjects", "get"),
        ("keda.sh", "scaledobjects", "create"),
        ("keda.sh", "scaledobjects", "patch"),
        ("keda.sh", "scaledobjects", "delete"),
        ("networking.k8s.io", "networkpolicies", "delete"),  # test_network_policies.py
        # No run here names a Kueue queue (and the emulator serves no Kueue): tests/cluster/test_kueue.py
        # makes these calls against a real Kueue, under the chart's RBAC (the operator fixture's check).
        *{
            ("kueue.x-k8s.io", "workloads", verb)
            for verb in ("get", "create", "patch", "delete", "list", "watch")
        },
        # The emulator serves no LWS: tests/cluster/test_multinode_pool.py makes these calls against a
        # real LWS, under the chart's RBAC (delete only when a pool's replicas come back to one node).
        *{
            ("leaderworkerset.x-k8s.io", "leaderworkersets", verb)
            for verb in ("get", "create", "patch", "delete", "list", "watch")
        },
        ("monitoring.coreos.com", "podmonitors", "get"),
        ("monitoring.coreos.com", "podmonitors", "create"),
        ("monitoring.coreos.com", "podmonitors", "patch"),
        ("monitoring.coreos.com", "podmonitors", "delete"),
        ("", "secrets", "patch"),  # the token Secret is never rewritten; patch only if metadata drifts
        ("mixrl.dev", "rlruns/finalizers", "update"),
        ("mixrl.dev", "samplerpools/finalizers", "update"),
        ("kopf.dev", "clusterkopfpeerings", "get"),
        # The built-in autoscaler reads events only for a pool with an unschedulable pod
        # (test_autoscaling_wiring.py exercises it and checks it with assert_covered).
        ("", "events", "list"),
        # Held only to grant them to the rollout workers' Role (RBAC escalation prevention), never called.
        ("", "pods", "create"),
        ("", "pods", "get"),
        # The rollout workers' account of a run with spec.rollout.sandbox (none here;
        # tests/cluster/test_sandbox_pods.py has one, under the chart's RBAC); deleted with a
        # sandbox pod left when the spec drops sandbox pods (test_drift.py, with assert_covered).
        ("", "pods", "delete"),
        ("", "serviceaccounts", "get"),
        ("", "serviceaccounts", "create"),
        ("", "serviceaccounts", "patch"),
        ("", "serviceaccounts", "delete"),
        ("rbac.authorization.k8s.io", "roles", "get"),
        ("rbac.authorization.k8s.io", "roles", "create"),
        ("rbac.authorization.k8s.io", "roles", "patch"),
        ("rbac.authorization.k8s.io", "roles", "delete"),
        ("rbac.authorization.k8s.io", "rolebindings", "get"),
        ("rbac.authorization.k8s.io", "rolebindings", "create"),
        ("rbac.authorization.k8s.io", "rolebindings", "patch"),
        ("rbac.authorization.k8s.io", "rolebindings", "delete"),
    }, unused


async def test_a_namespaced_operator_stays_within_namespaced_permissions(
    api: ApiServer, operator: Any
) -> None:
    api.objects[kmock.resource("kopf.dev/v1/kopfpeerings"), NAMESPACE, PEERING] = {
        "apiVersion": "kopf.dev/v1",
        "kind": "KopfPeering",
        "metadata": {"name": PEERING, "namespace": NAMESPACE, "uid": "p", "resourceVersion": "1"},
    }
    async with operator(namespaces=[NAMESPACE]):
        await lifecycle(api)
    calls = operator_calls(api)
    assert_covered(calls, clusterwide=False)
    assert ("kopf.dev", "kopfpeerings", "patch") in calls
    assert not any(c[1] == "namespaces" for c in calls), "no namespace listing: least privilege"
    watched = {r.url.path for r in list(api) if r.params.get("watch") == "true"}
    assert all(f"/namespaces/{NAMESPACE}/" in path for path in watched), watched


async def test_podmonitor_is_used_when_discovery_finds_the_prometheus_operator(
    api: ApiServer, operator: Any
) -> None:
    api.register(with_monitoring=True)
    async with operator(monitoring="auto"):
        await create(api, small_run())
        await eventually(
            lambda: api.live("monitoring.coreos.com/v1/podmonitors", NAMESPACE, "demo"), what="PodMonitor"
        )
        await settled(api)
        router = api.live(DEPLOYMENTS, NAMESPACE, "demo-router")
        assert "prometheus.io/scrape" not in router["spec"]["template"]["metadata"]["annotations"]
        calls = operator_calls(api)
    assert_covered(calls, clusterwide=True)


# ----------------------------------------------------------------------------- the client


async def test_the_client_refuses_undeclared_calls_before_sending(api: ApiServer) -> None:
    client = KubeClient(lambda: Connection(server=str(api.url).rstrip("/")))
    try:
        sent = len(list(api))
        with pytest.raises(UndeclaredApiCall, match="delete core/configmaps"):
            await client.request("delete", "DELETE", rbac.CONFIGMAPS, namespace="rl", name="x")
        with pytest.raises(UndeclaredApiCall, match="delete core/persistentvolumeclaims"):
            await client.delete(rbac.PVCS, "rl", "x")  # a claim is never deleted: its data would go
        assert len(list(api)) == sent, "nothing reached the server"
        assert await client.get(rbac.CONFIGMAPS, "rl", "missing") is None
    finally:
        await client.close()


async def test_a_status_goes_through_its_model_before_it_is_sent(api: ApiServer) -> None:
    # The API server's structural schema would prune an unknown status key without a word; the
    # client refuses it first (and a wrongly typed value), and sends what the model takes.
    client = KubeClient(lambda: Connection(server="http://127.0.0.1:9"))  # nothing listens on port 9
    try:
        sent = len(list(api))
        for kind, status in (
            (rbac.RLRUNS, {"phase": "Running", "weightVersoin": 3}),
            (rbac.SAMPLERPOOLS, {"readyReplicas": 1, "trafficShare": "half"}),
            (rbac.RLRUNS, {"pools": [{"name": "a", "klFresh": 0.1, "traficShare": 0.5}]}),
        ):
            with pytest.raises(ValidationError):
                await client.merge_patch(kind, "rl", "x", {"status": status}, subresource="status")
        assert len(list(api)) == sent
        with pytest.raises(ApiError):  # a valid status gets as far as the (absent) server
            await client.merge_patch(
                rbac.SAMPLERPOOLS,
                "rl",
                "x",
                {"status": {"trafficShare": 0.5, "kl": None}},
                subresource="status",
            )
    finally:
        await client.close()


async def test_api_errors_say_whether_to_retry(api: ApiServer) -> None:
    client = KubeClient(lambda: Connection(server=str(api.url).rstrip("/")))
    try:
        for status, retryable in (
            (409, True),
            (429, True),
            (500, True),
            (503, True),
            (403, False),
            (422, False),
        ):
            api.fail("GET", "configmaps", status)
            with pytest.raises(ApiError) as caught:
                await client.get(rbac.CONFIGMAPS, "rl", "x")
            assert (caught.value.status, caught.value.retryable) == (status, retryable)
            assert caught.value.message == f"injected {status}"
    finally:
        await client.close()
    dead = KubeClient(lambda: Connection(server="http://127.0.0.1:9"))  # nothing listens on port 9
    try:
        with pytest.raises(ApiError) as caught:
            await dead.get(rbac.CONFIGMAPS, "rl", "x")
        assert caught.value.status == 0 and caught.value.retryable
    finally:
        await dead.close()


def test_backoff_grows_is_capped_and_honours_retry_after() -> None:
    config = OperatorConfig(backoff_base_s=2.0, backoff_cap_s=60.0, backoff_jitter=0.0)
    delays = [backoff(retry, config) for retry in range(8)]
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert backoff(0, config, retry_after=30.0) == 30.0
    assert backoff(10_000, config) == 60.0


def test_backoff_jitter_stays_within_its_bounds_and_is_reproducible() -> None:
    def delays(seed: int) -> list[float]:
        config = OperatorConfig(backoff_base_s=2.0, backoff_cap_s=60.0, uniform=random.Random(seed).random)
        return [backoff(retry, config) for retry in range(10) for _ in range(50)]

    drawn = delays(7)
    ceilings = [min(60.0, 2.0 * 2**retry) for retry in range(10) for _ in range(50)]
    # Default jitter 0.5: each delay lies in [ceiling / 2, ceiling], never above the cap.
    assert all(c / 2 <= d <= c for d, c in zip(drawn, ceilings, strict=True))
    assert max(drawn) <= 60.0 and min(drawn) >= 1.0
    assert len(set(drawn[:50])) > 40, "retries of one failure are spread out, not in lockstep"
    assert delays(7) == drawn, "a seeded source gives the same delays"
    assert delays(8) != drawn
    # What the server asks for (Retry-After) is a floor the jitter never goes below.
    config = OperatorConfig(backoff_base_s=2.0, backoff_cap_s=60.0, uniform=lambda: 0.999)
    assert backoff(0, config, retry_after=5.0) == 5.0
    assert backoff(5, config) == pytest.approx(60.0 * (1 - 0.5 * 0.999))


def test_connection_from_kopf_login_carries_credentials() -> None:
    info = kopf.ConnectionInfo(
        server="https://k8s:6443", token="t0k", scheme="Bearer", ca_data=b"-----", insecure=False
    )
    connection = Connection.from_kopf(info)
    assert connection.headers() == {"Authorization": "Bearer t0k"}
    assert connection.ca_data == b"-----" and connection.server == "https://k8s:6443"
    basic = Connection(server="https://k8s", username="u", password="p")
    assert basic.headers() == {"Authorization": "Basic dTpw"}


# ----------------------------------------------------------------------------- the command line


def test_operator_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["-n", "rl", "-n", "eval", "--dev"])
    assert args.namespaces == ["rl", "eval"] and not args.all_namespaces and args.dev
    assert parse_args(["-A", "--peering", "p", "--monitoring", "podmonitor"]).peering == "p"
    defaults = parse_args(["-A"])
    assert (defaults.keda, defaults.builtin_autoscaler) == ("auto", True)
    assert parse_args(["-A", "--keda", "off", "--no-builtin-autoscaler"]).builtin_autoscaler is False
    for bad, message in (
        ([], "one of the arguments -n/--namespace -A/--all-namespaces is required"),
        (["-A", "-n", "rl"], "not allowed with argument"),
        (["-A", "--drain-seconds", "-1"], "--drain-seconds: must be 0 or more"),
        (["-A", "--monitoring", "grafana"], "invalid choice: 'grafana'"),
        (["-A", "--keda", "maybe"], "invalid choice: 'maybe'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(bad)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in err, err
