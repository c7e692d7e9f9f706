"""Reading a run on the real-node bed the way its components read each other: the host reaches
pod IPs directly (the bed routes the node's pod subnet to it)."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from mixrl.api.resolve import BUFFER_PORT, ENGINE_PORT
from mixrl.devcluster import images, netpol, network
from tests.cluster.conftest import Bed, wait_for

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


def probe(name: str, targets: list[str], labels: dict[str, str]) -> dict:
    """A busybox pod that, once released (:func:`probed` creates ``/tmp/go``), sends an HTTP GET to
    each ``host:port`` and prints ``host:port open`` (connected: the server's answer, whatever it
    is, or none) or ``host:port blocked (what nc said: timed out, refused)``."""
    each = ("until [ -e /tmp/go ]; do sleep 0.2; done; "
            f"for t in {' '.join(targets)}; do "
            "out=$(printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 3 ${t%:*} ${t#*:} 2>&1 | head -n 1); "
            "case $out in 'nc: '*) echo \"$t blocked ($out)\";; *) echo \"$t open\";; esac; done")  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": images.SHELL_IMAGE, "command": ["sh", "-c", each]}],
        },
    }


def enforced_rules() -> str:
    """The bed's NetworkPolicy rules as nftables lists them in the (one) real node."""
    (address,) = network.node_addresses(1)
    table = [*address.enter(), "nft", "list", "table", "inet", netpol.TABLE]
    return subprocess.run(table, capture_output=True, text=True).stdout


def mentions(rules: str, ip: str) -> int:
    """How often ``rules`` name the address ``ip`` (not as the prefix of a longer one)."""
    return len(re.findall(rf"(?<![\d.]){re.escape(ip)}(?![\d./])", rules))


def probed(
    bed: Bed, probes: dict[tuple[str, str], dict], enforced: Callable[[dict[tuple[str, str], str], str], bool],
    timeout: float = 90,
) -> dict[tuple[str, str], list[str]]:  # fmt: skip
    """Start every (namespace, name) probe pod; once each has its address and ``enforced(addresses,
    rules)`` says the enforcer's rules cover them (it polls the API server every second, and the
    kubelet reports a pod's address a moment after the pod starts), release them all; return each
    one's lines, ``host:port open|blocked`` (what nc said when blocked is printed)."""
    for (namespace, _), spec in probes.items():
        bed.apply(spec, namespace=namespace)
    ips: dict[tuple[str, str], str] = {}
    for namespace, name in probes:
        ips[(namespace, name)] = wait_for(lambda ns=namespace, n=name: bed.get("pod", n, "-n", ns).get("status", {}).get("podIP"),
                                          timeout=timeout, what=f"probe {namespace}/{name}'s address")  # fmt: skip
    wait_for(lambda: enforced(ips, enforced_rules()), timeout=30, what="the enforcer's rules for the probes")
    for namespace, name in probes:
        bed.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"pod/{name}", "--timeout=60s")
        bed.kubectl("exec", "-n", namespace, name, "--", "touch", "/tmp/go")
    seen = {}
    for namespace, name in probes:
        wait_for(lambda ns=namespace, n=name: bed.get("pod", n, "-n", ns).get("status", {}).get("phase") == "Succeeded",
                 timeout=timeout, what=f"probe {namespace}/{name} to finish")  # fmt: skip
        seen[(namespace, name)] = bed.kubectl("logs", "-n", namespace, name).stdout.splitlines()
    print(f"probes: {seen}")
    return {key: [line.split(" (", 1)[0] for line in lines] for key, lines in seen.items()}
