"""The bed's Prometheus: its configuration passes Debian's promtool, and the pod discovery stand-in
turns exactly the annotated, running pods into targets."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from mixrl.devcluster.monitoring import prometheus_config, prometheus_objects, scrape_targets


def pod(name: str, phase: str = "Running", ip: str | None = "10.245.0.7", **annotations: str) -> dict:
    return {
        "metadata": {"name": name, "namespace": "rl", "annotations": annotations},
        "status": {"phase": phase, **({"podIP": ip} if ip else {})},
    }


def test_the_config_and_its_targets_pass_promtool(tmp_path: Path) -> None:
    targets = tmp_path / "targets.json"
    found = scrape_targets([pod("trainer", **{"prometheus.io/scrape": "true", "prometheus.io/port": "9400"})])
    targets.write_text(json.dumps(found))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(targets)))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing (Debian's prometheus package, scripts/setup.sh)"
    done = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_only_running_annotated_pods_with_an_address_are_scraped() -> None:
    scraped = {"prometheus.io/scrape": "true", "prometheus.io/port": "9400"}
    pods = [
        pod("b-router", **scraped, **{"prometheus.io/path": "/stats/metrics"}),
        pod("a-trainer", **scraped),
        pod("pending", phase="Pending", ip=None, **scraped),
        pod("finished", phase="Succeeded", **scraped),
        pod("not-annotated"),
        pod("scrape-false", **{"prometheus.io/scrape": "false", "prometheus.io/port": "9400"}),
        pod("no-port", **{"prometheus.io/scrape": "true"}),
    ]
    assert scrape_targets(pods) == [
        {
            "targets": ["10.245.0.7:9400"],
            "labels": {"namespace": "rl", "pod": "a-trainer", "__metrics_path__": "/metrics"},
        },
        {
            "targets": ["10.245.0.7:9400"],
            "labels": {"namespace": "rl", "pod": "b-router", "__metrics_path__": "/stats/metrics"},
        },
    ]


def test_pods_reach_it_at_the_runs_default_prometheus_url() -> None:
    from mixrl.api.models import AutoscalingSpec

    namespace, service, slice_ = prometheus_objects("10.250.0.1")
    default = AutoscalingSpec().prometheus_url
    assert default == f"http://{service['metadata']['name']}.{namespace['metadata']['name']}.svc:9090"
    assert slice_["metadata"]["labels"]["kubernetes.io/service-name"] == service["metadata"]["name"]
    assert slice_["endpoints"][0]["addresses"] == ["10.250.0.1"]
