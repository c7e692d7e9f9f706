"""The built-in autoscaler end to end: a real Prometheus scrapes stand-in engines, load rises, and the
SamplerPool's replicas, its Deployment and the Running pods on the pool's GPU nodes follow, then
fall back.

Stand-in: the engines. KWOK pods run no container, so one loopback exporter plays every engine pod of
the pool: at each scrape it lists the pool's Running pods from the API server and exports SGLang's
``sglang:num_queue_reqs`` / ``sglang:num_running_reqs`` gauges for each (``namespace`` and ``pod``
labels kept with ``honor_labels``, where a cluster's pod discovery would attach them), sharing the
load the test sets between them, as the router would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

import yaml

from mixrl.api.gpus import GPU_PRODUCT_LABEL, GPU_TABLE
from mixrl.devcluster.cluster import free_port

from .conftest import ROOT, Bed, OperatorProcess, exposition_server, wait_for

POOL = "h100-fp8"
TARGET = 4.0  # load per replica of capacity 1.0


class PoolExporter:
    """One HTTP endpoint standing in for every engine pod of one pool."""

    def __init__(self, cluster: Bed, namespace: str, deployment: str):
        self.cluster, self.namespace, self.deployment = cluster, namespace, deployment
        self.load = 0.0
        self.port = free_port()
        self.server = exposition_server(self.exposition, self.port)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def pods(self) -> list[str]:
        items = self.cluster.handle.api_get(
            self.cluster.state,
            f"/api/v1/namespaces/{self.namespace}/pods?labelSelector=mixrl.dev%2Fpool%3D{POOL}",
        )["items"]
        return [p["metadata"]["name"] for p in items if p.get("status", {}).get("phase") == "Running"]

    def exposition(self) -> str:
        pods = self.pods()
        lines = ["# TYPE sglang:num_queue_reqs gauge", "# TYPE sglang:num_running_reqs gauge"]
        for pod in pods:
            share = self.load / len(pods)
            labels = f'namespace="{self.namespace}",pod="{pod}",model_name="stand-in"'
            lines.append(f"sglang:num_queue_reqs{{{labels}}} {share / 2}")
            lines.append(f"sglang:num_running_reqs{{{labels}}} {share / 2}")
        return "\n".join(lines) + "\n"


def start_prometheus(tmp: Path, port: int, target: str) -> subprocess.Popen[bytes]:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "scrape_configs": [
            {"job_name": "engines", "honor_labels": True, "static_configs": [{"targets": [target]}]}
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    binary = shutil.which("prometheus")
    assert binary, "the prometheus binary is missing (scripts/setup.sh installs Debian's package)"
    return subprocess.Popen(
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def builtin_run(namespace: str, pools: Collection[str], prom_port: int, **autoscaling: Any) -> dict[str, Any]:
    """examples/rlrun-mixed.yaml in ``namespace`` with only the pools named in ``pools``, scaled by the
    built-in loop from the Prometheus on loopback port ``prom_port``: TARGET per replica, a poll a
    second, no scale-down window; ``autoscaling``: fields over these."""
    run = yaml.safe_load((ROOT / "examples" / "rlrun-mixed.yaml").read_text())
    run["metadata"]["namespace"] = namespace
    run["spec"]["samplerPools"] = [p for p in run["spec"]["samplerPools"] if p["name"] in pools]
    run["spec"]["autoscaling"] = {
        "engine": "builtin",
        "prometheusUrl": f"http://127.0.0.1:{prom_port}",
        "targetPerReplica": TARGET,
        "pollIntervalSeconds": 1,
        "scaleDownWindowSeconds": 0,
        **autoscaling,
    }
    return run


class Exporter(Protocol):
    """A stand-in's exposition server, not started (PoolExporter, and the capacity-loss test's RunExporter)."""

    port: int
    server: ThreadingHTTPServer
    thread: threading.Thread


@contextmanager
def scraped(exporter: Exporter, tmp: Path, prom_port: int) -> Iterator[None]:
    """``exporter`` serving, and a Prometheus on ``prom_port`` scraping it; both stopped at the end."""
    exporter.thread.start()
    prometheus = start_prometheus(tmp, prom_port, f"127.0.0.1:{exporter.port}")
    try:
        yield
    finally:
        prometheus.terminate()
        prometheus.wait(10)
        exporter.server.shutdown()
        exporter.server.server_close()


def pool_replicas(
    cluster: Bed, namespace: str, name: str, exporter: PoolExporter
) -> tuple[int, int, int] | None:
    """(the SamplerPool's replicas, its Deployment's, the Running engine pods), None until both exist."""
    found = cluster.kubectl(
        "get", f"sp/{name}", f"deployment/{name}", "-n", namespace, "-o", "json", check=False
    )
    if found.returncode != 0:
        return None
    sp, deploy = json.loads(found.stdout)["items"]
    return sp["spec"]["replicas"], deploy["spec"]["replicas"], len(exporter.pods())


def test_builtin_autoscaler_follows_prometheus_queue_depth(
    cluster: Bed, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    prom_port = free_port()
    run = builtin_run(namespace, [POOL], prom_port)
    run["spec"]["samplerPools"][0].update(minReplicas=1, maxReplicas=4, capacity=1.0)
    name = f"{run['metadata']['name']}-{POOL}"
    exporter = PoolExporter(cluster, namespace, name)
    with scraped(exporter, tmp_path, prom_port):
        cluster.apply(run)

        def replicas() -> tuple[int, int, int] | None:
            return pool_replicas(cluster, namespace, name, exporter)

        wait_for(replicas, equals=(1, 1, 1), timeout=60, what="one replica at rest")
        exporter.load = 3.5 * TARGET  # wants 4 replicas (ceil 3.5), the pool's maximum
        wait_for(replicas, equals=(4, 4, 4), timeout=150, what="scale-up to 4 with Running pods")
        products = {
            n["metadata"]["name"]: n["metadata"]["labels"].get(GPU_PRODUCT_LABEL)
            for n in cluster.get("nodes")["items"]
        }
        pods = cluster.get("pods", "-n", namespace, "-l", f"mixrl.dev/pool={POOL}")["items"]
        assert {products[p["spec"]["nodeName"]] for p in pods} <= set(GPU_TABLE["H100"].gfd_products)
        exporter.load = 0.0
        wait_for(replicas, equals=(1, 1, 1), timeout=180, what="scale-down back to minReplicas")
        decisions = cluster.get(f"sp/{name}", "-n", namespace)["status"].get("lastScaleDecisions", [])
        assert [d["toReplicas"] for d in decisions][-1] == 1 and max(d["toReplicas"] for d in decisions) == 4
