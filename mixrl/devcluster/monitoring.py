"""The bed's Prometheus, beside real nodes: Debian's ``prometheus`` on the host, scraping every pod
annotated ``prometheus.io/scrape`` (what the operator's ``monitoring: annotations`` mode sets, the
mode it picks where no Prometheus Operator runs) at the pod's IP, which the host routes to.

Debian builds Prometheus without Kubernetes service discovery, so the bed runs a stand-in for it:
``python -m mixrl.devcluster.monitoring`` lists the pods from the bed's API server every few
seconds and writes them as a ``file_sd`` target file, with the labels ``kubernetes_sd_configs``'
usual relabelling gives (``namespace``, ``pod``); Prometheus reads the file as it changes.

Pods find Prometheus where an RLRun's ``autoscaling.prometheusUrl`` looks by default
(``http://prometheus-operated.monitoring.svc:9090``): a Service without a selector whose
EndpointSlice is the host's address on the bed's bridge. So ``kubectl get rlr`` shows the trainer's
step, reward and KL from a real scrape, as in a cluster with kube-prometheus-stack. The builders
here are pure; :mod:`mixrl.devcluster.cluster` starts both processes and creates the objects.
"""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

PROMETHEUS_PORT = 9090
NAMESPACE = "monitoring"
SERVICE = "prometheus-operated"
SCRAPE_INTERVAL = "5s"
DISCOVERY_INTERVAL_S = 2.0


def prometheus_config(targets_file: Path) -> dict[str, Any]:
    """Scrape the targets of ``targets_file`` (:func:`scrape_targets`, kept current by :func:`main`);
    ``honor_labels``: the components label their own series with ``run`` and ``pool``."""
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [
            {
                "job_name": "pods",
                "honor_labels": True,
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": SCRAPE_INTERVAL}],
            }
        ],
    }


def scrape_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``file_sd`` entries of the running pods annotated ``prometheus.io/scrape: "true"``: the
    pod's IP at its ``prometheus.io/port``, its ``prometheus.io/path`` (default ``/metrics``),
    labelled ``namespace`` and ``pod``. Sorted, so an unchanged cluster writes the same file."""
    targets = []
    for pod in pods:
        annotations = pod["metadata"].get("annotations") or {}
        ip, port = pod.get("status", {}).get("podIP"), annotations.get("prometheus.io/port", "")
        if (
            annotations.get("prometheus.io/scrape") != "true"
            or pod.get("status", {}).get("phase") != "Running"
        ):
            continue
        if not ip or not port.isdigit():
            continue
        labels = {
            "namespace": pod["metadata"]["namespace"],
            "pod": pod["metadata"]["name"],
            "__metrics_path__": annotations.get("prometheus.io/path") or "/metrics",
        }
        targets.append({"targets": [f"{ip}:{port}"], "labels": labels})
    return sorted(targets, key=lambda t: (t["labels"]["namespace"], t["labels"]["pod"]))


def prometheus_command(binary: str, directory: Path, address: str) -> list[str]:
    return [
        binary,
        f"--config.file={directory / 'prometheus.yml'}",
        f"--storage.tsdb.path={directory / 'tsdb'}",
        f"--web.listen-address={address}:{PROMETHEUS_PORT}",
        "--storage.tsdb.retention.time=1d",
    ]


def prometheus_objects(address: str) -> list[dict[str, Any]]:
    """The Service pods use, and its EndpointSlice: the host's address on the bed's bridge."""
    port = {"name": "web", "port": PROMETHEUS_PORT, "protocol": "TCP"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": SERVICE, "namespace": NAMESPACE},
            "spec": {"ports": [{**port, "targetPort": PROMETHEUS_PORT}]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{SERVICE}-host",
                "namespace": NAMESPACE,
                "labels": {"kubernetes.io/service-name": SERVICE},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
            "ports": [port],
        },
    ]


def discovery_command(python: str, kubeconfig: Path, targets_file: Path) -> list[str]:
    return [python, "-m", "mixrl.devcluster.monitoring", str(kubeconfig), str(targets_file)]


def bed_lister(kubeconfig: Path) -> Callable[[str], list[dict[str, Any]]]:
    """``list(path)``: the items of a GET on the bed's API server with its admin kubeconfig (the
    pod discovery here and the NetworkPolicy enforcer, mixrl.devcluster.netpol)."""
    config = yaml.safe_load(kubeconfig.read_text())
    cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
    context = ssl.create_default_context(cafile=cluster["certificate-authority"])
    headers = {"Authorization": f"Bearer {user['token']}"}

    def items(path: str) -> list[dict[str, Any]]:
        request = urllib.request.Request(f"{cluster['server']}{path}", headers=headers)
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:
            return json.load(answer)["items"]

    return items


def main(argv: list[str]) -> int:
    """Every couple of seconds: the bed's pods, as Prometheus' target file (written atomically,
    only when it changed)."""
    items, targets_file = bed_lister(Path(argv[0])), Path(argv[1])
    written = None
    while True:
        try:
            text = json.dumps(scrape_targets(items("/api/v1/pods")), indent=1)
        except (OSError, ValueError, KeyError) as exc:
            print(f"pod discovery: {exc}", file=sys.stderr, flush=True)
        else:
            if text != written:
                partial = targets_file.with_suffix(".partial")
                partial.write_text(text)
                partial.replace(targets_file)
                written = text
        time.sleep(DISCOVERY_INTERVAL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
