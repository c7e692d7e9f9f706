"""Reading a run on the real-node bed the way its components read each other: the host reaches
pod IPs directly (the bed routes the node's pod subnet to it)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from mixrl.api.resolve import BUFFER_PORT, ENGINE_PORT
from tests.cluster.conftest import Bed

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rlrun-cluster-cpu.yaml"
RUN = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]


def http_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def pods(bed: Bed, namespace: str, selector: str) -> list[dict]:
    return bed.get("pods", "-n", namespace, "-l", selector)["items"]


def running(bed: Bed, namespace: str, component: str) -> list[dict]:
    """The component's pods that are Running with an IP and not terminating."""
    return [
        p
        for p in pods(bed, namespace, f"app.kubernetes.io/component={component}")
        if p["status"].get("phase") == "Running" and p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
    ]  # fmt: skip


def pod_ip(bed: Bed, namespace: str, component: str) -> str | None:
    found = running(bed, namespace, component)
    return found[0]["status"]["podIP"] if found else None


def buffer_get(bed: Bed, namespace: str, path: str) -> Any:
    """``GET`` one of the buffer's open routes; None while it is unreachable."""
    ip = pod_ip(bed, namespace, "buffer")
    try:
        return http_json(f"http://{ip}:{BUFFER_PORT}{path}") if ip else None
    except (OSError, urllib.error.URLError, ValueError):
        return None


def buffer_text(bed: Bed, namespace: str, path: str) -> str:
    """``GET`` a route of the buffer's that answers text (JSON lines)."""
    ip = pod_ip(bed, namespace, "buffer")
    assert ip, "no buffer pod running"
    with urllib.request.urlopen(f"http://{ip}:{BUFFER_PORT}{path}", timeout=5) as response:
        return response.read().decode()


def buffer_stats(bed: Bed, namespace: str) -> dict:
    return buffer_get(bed, namespace, "/stats") or {}


def evaluations(bed: Bed, namespace: str) -> list[dict]:
    return (buffer_get(bed, namespace, "/evaluations") or {}).get("evaluations", [])


def weight_version(ip: str) -> int | None:
    """The version an engine pod serves (SGLang's ``GET /get_weight_version``)."""
    try:
        answer = http_json(f"http://{ip}:{ENGINE_PORT}/get_weight_version")
    except (OSError, urllib.error.URLError, ValueError):
        return None
    value = answer.get("weight_version") if isinstance(answer, dict) else answer
    return int(str(value).lstrip("v")) if value is not None else None


def counter(ip: str, port: int, name: str) -> float | None:
    """A counter's value summed over its series, from a pod's Prometheus exposition."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)]
    return sum(values)


def describe(bed: Bed, namespace: str) -> str:
    """What a person would look at when the run does not progress."""
    listing = bed.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
    events = bed.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout
    return f"{listing}\n{events[-3000:]}"
