"""Switching the monitoring mode through the running operator: a run reconciled in PodMonitor mode,
then an operator in annotations mode (a restart with ``--monitoring annotations``, or the chart's
``monitoring.mode`` changed) deletes the run's PodMonitor and puts scrape annotations on its pods;
only where the cluster serves PodMonitors, only the run's own, and only with the calls the chart
grants in annotations mode.

Stand-in (see conftest.py): the API server (kmock's emulator; "installing the Prometheus Operator"
registers its podmonitors resource for discovery).  No Prometheus runs: what matters is which
objects tell one to scrape the run.
"""

from __future__ import annotations

from typing import Any

from mixrl.operator.install import chart as chart_module
from mixrl.operator.kube import rbac

from .emulator import ApiServer
from .support import (
    DEPLOYMENTS,
    NAMESPACE,
    RLRUNS,
    assert_covered,
    conditions,
    create,
    events,
    eventually,
    operator_calls,
    rbac_calls,
    settled,
    small_run,
)

Obj = dict[str, Any]
PODMONITORS = "monitoring.coreos.com/v1/podmonitors"
SCRAPE = "prometheus.io/scrape"
# What the chart grants with its default values and `monitoring.mode: annotations`, cluster-wide.
ANNOTATIONS_MODE_FILES = ("base", "keda", "podmonitors-cleanup", "autoscaler", "peering-clusterwide")


def scraped_by_annotations(api: ApiServer, deployment: str = "demo-router") -> bool:
    live = api.live(DEPLOYMENTS, NAMESPACE, deployment)
    annotations = (live or {}).get("spec", {}).get("template", {}).get("metadata", {}).get(
        "annotations"
    ) or {}
    return annotations.get(SCRAPE) == "true"


def podmonitor_calls(api: ApiServer, since: int) -> set[str]:
    """Verbs of the requests on podmonitors after the first ``since`` requests."""
    calls = set()
    for request in list(api)[since:]:
        if request.resource is not None and request.resource.plural == "podmonitors":
            method = request.method.value
            calls.add("watch" if request.params.get("watch") == "true" else method)
    return calls


def annotations_mode_rules() -> list[Obj]:
    files = chart_module.rbac_files()
    return [rule for name in ANNOTATIONS_MODE_FILES for rule in files[name]]


async def post_podmonitor(api: ApiServer, name: str) -> None:
    """A PodMonitor someone else made (no owner reference), as kubectl create would."""
    body = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"selector": {"matchLabels": {"team": "rl"}}, "podMetricsEndpoints": [{"port": "metrics"}]},
    }
    async with api.post(f"/apis/monitoring.coreos.com/v1/namespaces/{NAMESPACE}/podmonitors", json=body) as r:
        assert r.status in (200, 201), await r.text()


async def demo_applied_in_podmonitor_mode(api: ApiServer, operator: Any) -> None:
    """The cluster serves PodMonitors; an operator in podmonitor mode applies run ``demo`` (scraped
    through its PodMonitor alone), settles and stops."""
    api.register(with_monitoring=True)
    async with operator(monitoring="podmonitor"):
        await create(api, small_run("demo"))
        await eventually(lambda: api.live(PODMONITORS, NAMESPACE, "demo"), what="the run's PodMonitor")
        await settled(api)
        assert not scraped_by_annotations(api), "one way to scrape at a time"


async def test_annotations_mode_deletes_the_podmonitor_an_earlier_mode_left(
    api: ApiServer, operator: Any
) -> None:
    await demo_applied_in_podmonitor_mode(api, operator)
    # A run whose name matches a PodMonitor it does not own: that one is not the operator's to delete.
    await post_podmonitor(api, "other")
    before = len(list(api))

    async with operator(monitoring="annotations"):
        await create(api, small_run("other"))
        await eventually(lambda: api.live(PODMONITORS, NAMESPACE, "demo") is None, what="PodMonitor deleted")
        await eventually(lambda: scraped_by_annotations(api), what="scrape annotations on the router")
        await eventually(lambda: scraped_by_annotations(api, "demo-b200"), what="and on the engines")
        await settled(api)
    assert api.live(PODMONITORS, NAMESPACE, "other") is not None, "not owned by the run: left alone"
    deletions = [e for e in events(api) if "deleted PodMonitor/demo" in e["message"]]
    assert len(deletions) == 1 and deletions[0]["reason"] == "Applied", "said once, in the Applied event"
    run = api.live(RLRUNS, NAMESPACE, "demo")
    assert conditions(run)["Progressing"]["reason"] != "ApplyFailed"
    # Read, then deleted; never watched nor written in annotations mode, where the chart grants
    # get and delete only.
    assert podmonitor_calls(api, before) == {"GET", "DELETE"}
    calls = {
        call
        for r in list(api)[before:]
        if r.headers.get("User-Agent", "").startswith(("kopf/", "mixrl-operator/"))
        for call in rbac_calls(r)
    }
    rules = annotations_mode_rules()
    refused = sorted(c for c in calls if not rbac.rules_allow(rules, *c))
    assert not refused, f"calls the chart does not grant in annotations mode: {refused}"
    assert_covered(operator_calls(api), clusterwide=True)


async def test_no_podmonitor_is_asked_for_where_the_cluster_serves_none(
    api: ApiServer, operator: Any
) -> None:
    async with operator(monitoring="annotations"):
        await create(api, small_run("demo"))
        await eventually(lambda: scraped_by_annotations(api), what="scrape annotations")
        await settled(api)
    assert not podmonitor_calls(api, 0), "no get, no delete: discovery says there are none"
    assert any(r.url.path == "/apis/monitoring.coreos.com/v1" for r in list(api)), "discovery was asked"


async def test_a_failed_cleanup_is_reported_and_retried_while_the_rest_is_applied(
    api: ApiServer, operator: Any
) -> None:
    await demo_applied_in_podmonitor_mode(api, operator)
    fault = api.fail("DELETE", "podmonitors", 500, reason="InternalError", message="etcd is away")
    async with operator(monitoring="annotations"):
        await eventually(lambda: scraped_by_annotations(api), what="the router applied despite the failure")

        def reported() -> bool:
            progressing = conditions(api.live(RLRUNS, NAMESPACE, "demo") or {}).get("Progressing", {})
            return progressing.get("reason") == "ApplyFailed" and "PodMonitor/demo" in progressing.get(
                "message", ""
            )

        await eventually(lambda: fault.times == 0, what="the injected failure")
        await eventually(lambda: api.live(PODMONITORS, NAMESPACE, "demo") is None, what="deleted on retry")
        await settled(api)
    assert not reported(), "the retry's success replaced the failure"
    statuses = [
        r
        for r in list(api)
        if r.resource is not None and r.resource.plural == "rlruns" and r.subresource == "status"
    ]
    assert any("PodMonitor/demo" in (r.text or "") for r in statuses), "the failure was on the condition"
